"""Load one MoE layer of a kt weight directory: memory-mapped packed stacks, NUMA shards.

Legend: E experts, H hidden size, I expert intermediate size, G group size.

On a single NUMA node the returned ``w13`` / ``w2`` are read-only views of the file mapping (no
copy, no repacking). With several nodes each node also gets a shard of the intermediate
dimension, rows [i0, i1) of gate and of up (w13) and the same columns of down (w2), copied into
memory first touched by a thread pinned to that node's CPUs, so the pages live on that node.
Shard boundaries are multiples of 64 (and of G for INT4), so a shard's columns of w2 are whole
packed lines and whole scale groups; the split follows the nodes' CPU counts.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import MoEShape, QuantScheme
from ..cpu_ops import _align
from ..cpu_ops.packing import BLOCK_N, D_ALIGN, PackedWeight, padded_dims
from ._format import MANIFEST, WeightFormatError, read_manifest
from ._layer_file import open_layer
from ._pack import fill_padding_rows, packed_array_specs

__all__ = ["load_experts", "LoadedExperts", "NodeShard", "NumaTopology", "shard_ranges",
           "make_shards"]


@dataclass(frozen=True)
class NumaTopology:
    """CPUs of each NUMA node this process may use: ``nodes[k]`` = CPU ids of node k."""

    nodes: tuple[tuple[int, ...], ...]
    ids: tuple[int, ...] | None = None  # NUMA node ids (default 0, 1, ...)

    def node_id(self, k: int) -> int:
        return self.ids[k] if self.ids is not None else k

    @classmethod
    def of_pool(cls, pool) -> "NumaTopology | None":
        """The topology a CPU pool runs on: ``pool.topology``, or ``pool.nodes`` ({node: CPUs},
        as kt.cpu_ops.CpuPool has); None if it has neither."""
        topo = getattr(pool, "topology", None)
        if isinstance(topo, cls):
            return topo
        nodes = getattr(pool, "nodes", None)
        if isinstance(nodes, dict) and nodes:
            ks = sorted(nodes)
            return cls(tuple(tuple(nodes[k]) for k in ks), tuple(int(k) for k in ks))
        return None

    @classmethod
    def detect(cls) -> "NumaTopology":
        try:
            allowed = set(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - non-Linux
            allowed = set(range(os.cpu_count() or 1))
        root = Path("/sys/devices/system/node")
        nodes, ids = [], []
        for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            try:
                cpus = _parse_cpulist((d / "cpulist").read_text())
            except (OSError, ValueError):
                continue
            cpus = tuple(c for c in cpus if c in allowed)
            if cpus:
                nodes.append(cpus)
                ids.append(int(d.name[4:]))
        if not nodes:
            return cls((tuple(sorted(allowed)),), (0,))
        return cls(tuple(nodes), tuple(ids))


def _parse_cpulist(text: str) -> list[int]:
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def shard_ranges(inter: int, weights, align: int) -> list[tuple[int, int]]:
    """Split [0, I) into len(weights) ranges proportional to ``weights`` (e.g. CPUs per node).

    Every boundary but the last is a multiple of ``align``; a node whose share rounds to zero
    gets an empty range (i0 == i1). Pure function.
    """
    w = np.asarray(list(weights), np.float64)
    if inter <= 0 or align <= 0 or w.size == 0 or (w <= 0).any():
        raise ValueError(f"shard_ranges needs I > 0, align > 0 and positive weights; got I={inter}, "
                         f"align={align}, weights={list(weights)}")
    units = -(-inter // align)
    cum = np.rint(np.cumsum(w) / w.sum() * units).astype(np.int64)
    bounds = [0] + [min(int(c) * align, inter) for c in cum]
    bounds[-1] = inter
    return [(bounds[k], bounds[k + 1]) for k in range(len(w))]


@dataclass(frozen=True)
class NodeShard:
    """Node ``node``'s part: w13 [E, 2(i1-i0), H] (gate rows i0..i1, then up rows), w2 [E, H, i1-i0]."""

    node: int
    cpus: tuple[int, ...]
    i0: int
    i1: int
    w13: PackedWeight
    w2: PackedWeight


@dataclass(frozen=True)
class LoadedExperts:
    """One MoE layer's packed experts. w13: [E, 2I, H] stack, w2: [E, H, I] stack (PackedWeight
    with a leading E axis; E = len(physical_to_logical_map) when a map is given)."""

    layer: int
    path: Path
    scheme: QuantScheme
    group_size: int
    num_experts: int
    hidden: int
    inter: int
    w13: PackedWeight
    w2: PackedWeight
    shards: tuple[NodeShard, ...] = ()
    physical_to_logical_map: np.ndarray | None = None

    @property
    def E(self) -> int:
        return self.num_experts

    @property
    def H(self) -> int:
        return self.hidden

    @property
    def I(self) -> int:  # noqa: E743 - the legend's name
        return self.inter

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes


def _expect(path, what, want, got):
    if want is not None and want != got:
        raise WeightFormatError(path, f"{what} {want!r} (what the caller asks for)",
                                f"{what} is {got!r}")


def load_experts(out_dir, layer: int, physical_to_logical_map=None, *, scheme=None, shape=None,
                 group_size: int | None = None, verify: bool = True, pool=None,
                 topology: NumaTopology | None = None, threads: int | None = None) -> LoadedExperts:
    """Map layer ``layer`` of the kt weight directory ``out_dir``.

    physical_to_logical_map: int [P]; physical slot p holds logical expert map[p] (copies the
    stacks unless it is the identity). scheme / shape (MoEShape or (E, H, I)) / group_size: what the
    caller expects; a mismatch raises WeightFormatError naming the file. verify: re-check the
    file's checksum (reads every page once; XXH64, ~14 GB/s per thread). Whatever ``verify``,
    the manifest and the layer file's header are checked as ``kt convert --verify`` checks them
    (``_format.manifest_problems``, ``_layer_file``) and the stored scales must be finite.
    pool / topology: NUMA nodes to shard over (``topology``, else the pool's ``topology`` or
    ``nodes``, else detected from sysfs); one node = no copy.
    """
    out = Path(out_dir)
    m = read_manifest(out)
    mpath = out / MANIFEST
    sch = QuantScheme(m["scheme"])
    E, H, I, g = m["num_experts"], m["hidden_size"], m["intermediate_size"], m["group_size"]
    if sch is QuantScheme.INT4 and m.get("int4_scales") != "ratio":
        import warnings

        warnings.warn(f"{out}: INT4 weights converted before their group scales became integer "
                      "ratios of a row scale; they load and run, but AMX prefill takes the slower "
                      "per-group kernel. `kt convert ... --force` re-converts them.", UserWarning,
                      stacklevel=2)
    if scheme is not None:
        _expect(mpath, "scheme", QuantScheme.parse(scheme).value, sch.value)
    if group_size is not None and sch is QuantScheme.INT4:
        _expect(mpath, "group_size", int(group_size), g)
    if shape is not None:
        want = ((shape.num_experts, shape.hidden, shape.intermediate) if isinstance(shape, MoEShape)
                else tuple(int(v) for v in shape))
        _expect(mpath, "(E, H, I)", want, (E, H, I))
    if (isinstance(layer, bool) or not isinstance(layer, (int, np.integer))
            or str(int(layer)) not in m["files"]):
        raise WeightFormatError(mpath, f"a layer of this conversion (layers: {m['layers']})",
                                f"layer {layer!r} is not in this conversion")
    layer = int(layer)
    arrays = open_layer(out, m, layer, verify=verify, threads=threads)
    path = out / m["files"][str(layer)]["file"]
    g_eff = g or 64
    w13 = _packed(sch, 2 * I, H, g_eff, arrays, "w13")
    w2 = _packed(sch, H, I, g_eff, arrays, "w2")
    p2l = None
    if physical_to_logical_map is not None:
        p2l = _check_map(physical_to_logical_map, E)
        if not np.array_equal(p2l, np.arange(E)):
            w13, w2 = _take_experts(w13, p2l), _take_experts(w2, p2l)
    topo = topology or (NumaTopology.of_pool(pool) if pool is not None else None) or NumaTopology.detect()
    shards = ()
    if len(topo.nodes) > 1:
        shards = make_shards(w13, w2, I, topo)
    return LoadedExperts(layer, path, sch, g if sch is QuantScheme.INT4 else 0,
                         w13.data.shape[0], H, I, w13, w2, shards, p2l)


def _packed(sch, n, d, g, arrays, pre) -> PackedWeight:
    n_pad, d_pad = padded_dims(n, d, sch, g)
    return PackedWeight(sch, n, d, n_pad, d_pad, g if sch is QuantScheme.INT4 else 0,
                        arrays[f"{pre}.data"], arrays[f"{pre}.scale"], arrays[f"{pre}.wsum"])


def _check_map(p2l, E: int) -> np.ndarray:
    a = np.asarray(p2l.cpu() if hasattr(p2l, "cpu") else p2l)
    if a.ndim != 1 or a.size == 0 or a.dtype.kind not in "iu":
        raise ValueError(f"physical_to_logical_map must be a non-empty 1-D integer array, got "
                         f"dtype {a.dtype} shape {a.shape}")
    if a.min() < 0 or a.max() >= E:
        raise ValueError(f"physical_to_logical_map values must be in [0, {E}), got "
                         f"[{a.min()}, {a.max()}]")
    return a.astype(np.int64)


def _take_experts(p: PackedWeight, idx: np.ndarray) -> PackedWeight:
    return PackedWeight(p.scheme, p.n, p.d, p.n_pad, p.d_pad, p.group_size,
                        *(np.take(a, idx, axis=0, out=_align.empty((len(idx),) + a.shape[1:], a.dtype))
                          for a in (p.data, p.scale, p.wsum)))


# ---------------------------------------------------------------------------- NUMA shards

def take_rows(p: PackedWeight, rows: np.ndarray, g: int) -> PackedWeight:
    """A new stack holding rows ``rows`` of every expert of ``p`` (whole 16-row blocks are copied
    as blocks). p: [E, N, D] packed; result [E, len(rows), D] packed."""
    sch = p.scheme
    E = p.data.shape[0]
    n_o = len(rows)
    specs = packed_array_specs(sch, E, n_o, p.d, g)
    data, scale, wsum = (_align.empty(*specs[k]) for k in ("data", "scale", "wsum"))
    o = 0
    while o < n_o:
        s = int(rows[o])
        if (o % BLOCK_N == 0 and s % BLOCK_N == 0 and o + BLOCK_N <= n_o
                and rows[o + BLOCK_N - 1] == s + BLOCK_N - 1
                and np.array_equal(rows[o:o + BLOCK_N], np.arange(s, s + BLOCK_N))):
            ob, sb = o // BLOCK_N, s // BLOCK_N
            data[:, ob] = p.data[:, sb]
            if sch is QuantScheme.INT8:
                scale[:, o:o + BLOCK_N] = p.scale[:, s:s + BLOCK_N]
                wsum[:, o:o + BLOCK_N] = p.wsum[:, s:s + BLOCK_N]
            elif sch is QuantScheme.INT4:
                scale[:, ob] = p.scale[:, sb]
            o += BLOCK_N
            continue
        ob, orr = divmod(o, BLOCK_N)
        sb, srr = divmod(s, BLOCK_N)
        data[:, ob, :, orr] = p.data[:, sb, :, srr]
        if sch is QuantScheme.INT8:
            scale[:, o] = p.scale[:, s]
            wsum[:, o] = p.wsum[:, s]
        elif sch is QuantScheme.INT4:
            scale[:, ob, :, orr] = p.scale[:, sb, :, srr]
        o += 1
    fill_padding_rows(sch, n_o, data, scale, wsum)
    n_pad, d_pad = padded_dims(n_o, p.d, sch, g)
    return PackedWeight(sch, n_o, p.d, n_pad, d_pad, p.group_size, data, scale, wsum)


def take_cols(p: PackedWeight, d0: int, d1: int, g: int) -> PackedWeight:
    """Columns [d0, d1) of every expert of ``p`` ([E, N, D] packed); d0 a multiple of 64 (and of
    G for INT4). INT8 row sums are recomputed for the shard."""
    sch = p.scheme
    align = max(D_ALIGN, g) if sch is QuantScheme.INT4 else D_ALIGN
    if d0 % align or not (0 <= d0 < d1 <= p.d):
        raise ValueError(f"take_cols: [d0, d1) = [{d0}, {d1}) must lie in [0, {p.d}) with d0 a "
                         f"multiple of {align}")
    n_pad, d_pad = padded_dims(p.n, d1 - d0, sch, g)
    per = {QuantScheme.INT8: 4, QuantScheme.INT4: 8, QuantScheme.BF16: 2}[sch]
    j0 = d0 // per
    data = _align.aligned(p.data[:, :, j0:j0 + d_pad // per])
    if sch is QuantScheme.INT8:
        scale = _align.copy(p.scale)
        wsum = data.astype(np.int32).sum(axis=(2, 4)).reshape(data.shape[0], -1)
        wsum = _align.copy(wsum, np.int32)
    elif sch is QuantScheme.INT4:
        scale = _align.aligned(p.scale[:, :, d0 // g: d0 // g + d_pad // g])
        wsum = np.zeros((data.shape[0], 0), np.int32)
    else:
        scale, wsum = np.zeros((data.shape[0], 0), np.float32), np.zeros((data.shape[0], 0), np.int32)
    return PackedWeight(sch, p.n, d1 - d0, n_pad, d_pad, p.group_size, data, scale, wsum)


def make_shards(w13: PackedWeight, w2: PackedWeight, I: int, topo: NumaTopology,
                up_offset: int | None = None) -> tuple[NodeShard, ...]:
    """Each node's shard of the intermediate dimension (see the module doc), built in a thread
    pinned to the node's CPUs; nodes whose share rounds to nothing get no shard. ``up_offset``:
    the first up row of w13 (default I)."""
    g = w13.group_size or 64
    up = I if up_offset is None else int(up_offset)
    align = max(D_ALIGN, g) if w13.scheme is QuantScheme.INT4 else D_ALIGN
    ranges = shard_ranges(I, [len(c) for c in topo.nodes], align)

    def build(node, cpus, i0, i1):
        try:
            os.sched_setaffinity(0, cpus)  # this thread only: its first touch places the pages
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot pin a thread to node {node}'s CPUs {list(cpus)}: {exc}") from None
        rows = np.concatenate([np.arange(i0, i1), np.arange(up + i0, up + i1)])
        return NodeShard(node, tuple(cpus), i0, i1, take_rows(w13, rows, g), take_cols(w2, i0, i1, g))

    jobs = [(topo.node_id(k), c, i0, i1) for k, (c, (i0, i1)) in enumerate(zip(topo.nodes, ranges))
            if i1 > i0]
    with ThreadPoolExecutor(len(jobs)) as ex:
        return tuple(f.result() for f in [ex.submit(build, *j) for j in jobs])
