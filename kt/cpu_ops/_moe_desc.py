"""CPUMoE's job-descriptor templates: the words of a layer that never change (weights, shapes,
kernels) and, per pool and capacity, its scratch buffers; written by name through
``runtime.job.JobDescriptor`` into the ``driver.layout.MOE_JOB`` layout.
"""
from __future__ import annotations

import numpy as np

from .driver.layout import DEP_STRIDE, MOE_JOB
from .packing import BLOCK_N


def weight_template(moe) -> np.ndarray:
    """The descriptor words of ``moe`` (a CPUMoE) that never change: weight slots, shapes,
    kernel entry points (the per-call down kernel excepted)."""
    d = MOE_JOB.descriptor()
    for name, w in (("w13", moe.w13), ("w2", moe.w2)):
        d.put_array(f"{name}.data", w.data)
        d.put_array(f"{name}.scale", w.scale)
        d.put_array(f"{name}.wsum", w.wsum)
    if moe._tabs is not None:
        d.put_array("w13.tab", moe._tabs[0])
        d.put_array("w2.tab", moe._tabs[1])
        d["tab_m"] = int(moe._tab_m)
    d["E"] = moe.num_experts
    d["H"] = moe.hidden
    d["I"] = moe.intermediate
    d["up_offset"] = moe.up_offset
    d["gs13"] = moe.w13.group_size
    d["gs2"] = moe.w2.group_size
    d["kv13"] = d["kv2"] = moe._kaddr[0]
    d["km13"] = moe._kaddr[1]
    d["scheme"] = moe._scheme_code
    return d.words


def call_rows(xbytes: int, n13: int) -> tuple[int, int]:
    """(gate+up rows per kernel call, rows of a participant's gate+up outputs), multiples of 32.
    A call's gathered activations are about 1 MiB at most (the AMX kernels' M chunk is at most
    1 MiB of A, so larger experts lose nothing by the split), and its gate+up outputs stay in the
    participant's scratch when 2 MiB hold 32 rows or more (a whole-expert task's activations
    then read them from its own cache; else from the shared rows)."""
    gch = max(32, (1 << 20) // xbytes // 32 * 32)
    gus = (2 << 20) // (n13 * 4) // 32 * 32
    if gus >= 32:
        gch = min(gch, gus)
        gus = gch
    else:
        gus = 0
    return gch, gus


def capacity(n: int) -> int:
    """Capacity bucket (powers of two, at least 16) so scratch templates are reused."""
    c = 16
    while c < n:
        c *= 2
    return c


def scratch_template(moe, pool, rows_cap: int, tok_cap: int, K: int, act_dtype) -> np.ndarray:
    """``moe``'s weight template plus the scratch slots (pool-owned buffers, shared by every
    layer on the pool) for rows_cap gathered rows, tok_cap tokens and top-k K; cached on the layer
    per (pool, scratch version, capacities, K, activation dtype)."""
    key = (id(pool), pool.scratch_version, rows_cap, tok_cap, K, act_dtype)
    words = moe._tmpl.get(key)
    if words is not None:
        return words
    E = moe.num_experts
    R = moe.levels
    hp, ip = moe.w13.d_pad, moe.w2.d_pad
    n13, n2 = moe.w13.n_pad, moe.w2.n_pad
    nb13, nb2 = n13 // BLOCK_N, n2 // BLOCK_N
    hacc = -(-max(moe.hidden, moe.intermediate) // 16) * 16 + 16
    nth = pool.num_threads
    s = pool.scratch
    bufs = {
        "pos": s("moe.pos", tok_cap * K, np.int32).reshape(tok_cap, K),
        "offs": s("moe.offs", E + 1, np.int32),
        "order": s("moe.order", E, np.int32),
        "t13": s("moe.t13", E * nb13 * 3, np.int32).reshape(E * nb13, 3),
        "t2": s("moe.t2", E * nb2 * 3, np.int32).reshape(E * nb2, 3),
        "xg": s("moe.xg", tok_cap * R * hp, act_dtype).reshape(tok_cap * R, hp).view(np.int8),
        "xs": s("moe.xs", tok_cap * R, np.float32),
        "rslot": s("moe.rslot", rows_cap, np.int32),
        "gu": s("moe.gu", rows_cap * n13, np.float32).reshape(rows_cap, n13),
        "hq": s("moe.hq", rows_cap * ip, act_dtype).reshape(rows_cap, ip).view(np.int8),
        "hs": s("moe.hs", rows_cap, np.float32),
        "y": s("moe.y", rows_cap * n2, np.float32).reshape(rows_cap, n2),
        "acc": s("moe.acc", nth * hacc, np.float32).reshape(nth, hacc),
        "dep": s("moe.dep", E * DEP_STRIDE, np.int64),
    }
    # per-participant scratch (rows per kernel call, see call_rows): gathered activations and
    # their scales, a whole-expert task's gate+up outputs
    xb = hp * np.dtype(act_dtype).itemsize
    gch, gus = call_rows(xb, n13)
    for name, nbytes in (("xgs", gch * xb), ("xss", gch * 4), ("gus", max(gus * n13 * 4, 64))):
        nbytes = -(-nbytes // 64) * 64
        bufs[name] = s(f"moe.{name}", nth * nbytes, np.int8).reshape(nth, nbytes)
    d = MOE_JOB.descriptor()
    d.words[:] = moe._wdesc
    d["K"] = K
    d["gch"], d["gus_rows"] = gch, gus
    for name, a in bufs.items():
        d.put_array(name, a)
    if len(moe._tmpl) > 16:
        moe._tmpl.clear()
    moe._tmpl[key] = d.words
    # the scratch buffers may have bumped the version while allocating: key on the final one
    moe._tmpl[(id(pool), pool.scratch_version, rows_cap, tok_cap, K, act_dtype)] = d.words
    return d.words
