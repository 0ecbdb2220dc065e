"""Fused MoE over the GPU-resident ("hot") experts: check, allocate, pick the config, launch.

Legend: T tokens, E experts, K top-k, H hidden, I intermediate, S GPU expert slots, N = T*K.
Two paths, chosen by the config (default: `pick_config`):
- sorted (`MoEConfig`): align token-slots by slot into row blocks, grouped gate+up GEMM, grouped down
  GEMM into rows y (bf16 for a bf16 output, else fp32), combine: five launches (three for
  decode-sized N), for any T;
- direct (`DirectConfig`, the default for N <= DIRECT_MAX_N or T <= DIRECT_MAX_T): gate+up programs
  that find their slot's token-slots themselves, then a down GEMV per token that sums its experts:
  two launches, no sort and no fp32 [N, H] round trip, which at decode sizes were most of the time.

Everything runs on the caller's current stream with no host synchronisation (no .item(), no .cpu(),
no data-dependent shapes), so a call can be captured in a CUDA graph. Under TRITON_INTERPRET=1 the
same kernels run on CPU tensors (slowly; for tests).
"""
from __future__ import annotations

import contextlib
from functools import lru_cache

import torch

from .configs import DirectConfig, MoEConfig, pick_config, table_for_device

__all__ = ["fused_moe", "align_by_slot", "gate_up", "down", "combine", "direct_gate_up", "direct_down",
           "act_quant2", "y_dtype_for", "sorted_h_for", "kernels_interpreted"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_WNAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int8: "int8"}

_kernels_mod = None
# Token-slots up to which the alignment runs as one program (where the per-slot path below does not
# take them: only when forced), and slots (next power of two) up to which larger N takes the
# two-launch path (else four launches with atomics). H200, us, one program / two launches /
# atomics (git show lab-archive:benchmarks/results/gpu_s13_run7_a8_probe.json): N=512 S=32: 9.8 / 18.0 /
# 11.6; N=1024: 14.4 / 16.7 / 18.2; N=8192: 69 / 15.6 / 18.8; N=32768 S=32: - / 15.8 / 22.1; S=64:
# - / 19.7 / 25.6; S=128: - / 45.8 / 39.5.
_ALIGN_ONE_PROGRAM_MAX_N = 1024
# Token-slots up to which the alignment runs as one program per slot (align_per_slot_kernel), and
# the ids each of its programs maps per step. H200, us alone, per slot / the path before it
# (git show lab-archive:benchmarks/gpu_align_probe.py): N=512 S=32: 4.8 / 8.1 (one program); N=2048: 6.6 / 16.3 (two
# launches); N=4096: 10.6 / 16.3, S=128: 12.3 / 24.3 (atomics); N=8192: 20.6 / 16.1 (each program
# reads all ids: it loses from here on).
_ALIGN_PER_SLOT_MAX_N = 4096
_ALIGN_PER_SLOT_CHUNK = 4096
_ALIGN_TWO_LAUNCH_MAX_SLOTS = 64
_FILL = 1024  # sorted_ids entries the one-program offsets step sets to the sentinel per store
_PROGRAMS_PER_SM = 4  # persistent GEMM grid: this many programs per SM (fewer if there are fewer tiles)
# act_quant2's launch: elements of x per program (whole rows, at least one; rows up to
# _ACT_QUANT_ROW_MAX elements are kept in registers, longer ones read in three passes), warps.
# H200 (git show lab-archive:benchmarks/gpu_a8_probe.py, rounding to nearest even): 4096 / 4 warps took 15.7 us at qwen3
# T=4096 (8192 / 8 warps, the old default, 16.1-18.0), 24.2 at mixtral, 44.3 at H=7168 (one row of
# 8192 per program; the probe's copy without the three-pass branch took 40.1 there, not explained).
_ACT_QUANT_ELEMS = 4096
_ACT_QUANT_WARPS = 4
_ACT_QUANT_ROW_MAX = 8192
_INTERPRETER_PROGRAMS = 3  # under the interpreter: a few programs, so each loops over several tiles
# h between the GEMMs in sorted order (row blocks read by TMA) when the down's weights come by TMA;
# else by token-slot (gathered rows). None: by the config; tests force either (_forced_sorted_h).
_SORTED_H = None


def _kernels():
    # Imported at first launch, not with kt.gpu_ops: whether Triton interprets is fixed when the
    # @triton.jit decorators run, so TRITON_INTERPRET only has to be set before the first call.
    global _kernels_mod
    if _kernels_mod is None:
        try:
            from . import _kernels as k
        except ImportError as e:  # pragma: no cover - triton missing
            raise ImportError("kt.gpu_ops needs triton: pip install 'kt[gpu]'") from e
        _kernels_mod = k
    return _kernels_mod


@lru_cache(maxsize=None)
def _device_table(index: int) -> dict:
    # read once per GPU (KT_GPU_TABLE is looked at by the first call)
    return table_for_device(torch.cuda.get_device_name(index))[0]


@lru_cache(maxsize=4096)
def _default_config(t, k, s, h, inter, wname, index):
    # pick_config builds and validates a config from the table on every call (~15 us of Python on
    # the H200's host, a visible share of an eager decode step); it is pure, so remember it
    return pick_config(t, k, s, h, inter, wname, _device_table(index) if index >= 0 else {})


@lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def kernels_interpreted() -> bool:
    """True if the kernels run under Triton's interpreter (TRITON_INTERPRET=1 at their first use)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernels().gate_up_kernel, InterpretedFunction)


def align_by_slot(topk_ids: torch.Tensor, expert_to_slot: torch.Tensor, num_slots: int, block_m: int):
    """Sort token-slots by expert slot into blocks of block_m rows, on the device, no host sync.

    topk_ids [T, K] int; expert_to_slot [E] int32; S = num_slots.
    Returns (slot [N] int32, sorted_ids [P] int32, block_slot [P / block_m] int32, num_padded [1] int32):
    slot[n] is token-slot n's GPU slot or -1 (id -1 or out of [0, E), or slot outside [0, S));
    sorted_ids holds the token-slots of each slot together, each slot's group padded to a multiple of
    block_m with the sentinel N; P = N + S*(block_m - 1) rounded up to block_m is the worst case, and
    rows from num_padded[0] on are unused (not read by the GEMMs; their values are not defined).
    Paths, by measured speed (H200, docs/decisions.md): for N <= 4096 one launch
    of a program per slot, rows in token order inside each slot; beyond, up to 64 slots two launches
    without atomics, rows in token order; beyond that four launches with atomics (rows in no fixed
    order inside a slot). (The one-program path, slower than one program per slot at every decode
    size, is only taken when forced, `_forced_align`: tests check every path against the others.) The order changes no
    result: a row's dot products do not depend on the other rows of its tile.
    """
    kern = _kernels()
    n = topk_ids.numel()
    dev = topk_ids.device
    s = num_slots
    p = -(-(n + s * (block_m - 1)) // block_m) * block_m
    sp2 = max(16, 1 << max(s - 1, 0).bit_length())
    ids = topk_ids.reshape(n)
    e2s = expert_to_slot.to(torch.int32)
    slot = torch.empty(n, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(p, dtype=torch.int32, device=dev)
    block_slot = torch.empty(p // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    chunk = 64 if sp2 <= 256 else 16  # block_slot entries per step of the one-program offsets
    if n <= _ALIGN_PER_SLOT_MAX_N:
        # Up to a few thousand token-slots: one launch, a program per slot (each counts all slots,
        # writes its own rows).
        ch = min(_np2(n), _ALIGN_PER_SLOT_CHUNK)
        kern.align_per_slot_kernel[(max(s, 1),)](ids, e2s, slot, block_slot, num_padded, sorted_ids, n,
                                                 e2s.numel(), s, CHUNK=ch, SINGLE=n <= ch, SP2=sp2,
                                                 BLOCK_M=block_m, BCHUNK=16)
    elif n <= _ALIGN_ONE_PROGRAM_MAX_N:
        # One program for every step (the kernel zeroes its own counters): below the per-slot
        # path's limit, so taken only when forced (_forced_align).
        scratch = torch.empty(2 * sp2, dtype=torch.int32, device=dev)  # counts, cursor
        kern.align_small_kernel[(1,)](ids, e2s, slot, scratch[:sp2], scratch[sp2:], block_slot, num_padded,
                                      sorted_ids, n, e2s.numel(), s, p, SP2=sp2, BLOCK_M=block_m, BLOCK=1024,
                                      CHUNK=chunk, FILL=_FILL)
    elif sp2 <= _ALIGN_TWO_LAUNCH_MAX_SLOTS:
        # Each program takes nsub sub-chunks of `sub` token-slots, each against all slots at once
        # (one-hot tiles of 4096 elements); nsub grows with N up to 4 (so 32-128 programs up to
        # N = 256 * sub, more beyond).
        sub = max(8, min(256, 4096 // sp2))
        nsub = min(4, _np2(max(1, -(-n // (sub * 64)))))
        c = max(1, -(-n // (nsub * sub)))  # (program 0 writes num_padded: one program even for N = 0)
        hist = torch.empty((c, sp2), dtype=torch.int32, device=dev)
        kern.slot_hist_kernel[(c,)](ids, e2s, slot, hist, n, e2s.numel(), s, NSUB=nsub, SUB=sub, SP2=sp2)
        kern.slot_place_kernel[(c,)](slot, hist, block_slot, num_padded, sorted_ids, n, s, c, p, NSUB=nsub,
                                     SUB=sub, SP2=sp2, CB=max(1, 8192 // sp2), BLOCK_M=block_m,
                                     BCHUNK=max(16, 2048 // sp2), num_warps=8)
    else:
        counts_cursor = torch.zeros(2 * sp2, dtype=torch.int32, device=dev)
        counts, cursor = counts_cursor[:sp2], counts_cursor[sp2:]
        blk = 1024
        kern.slot_count_kernel[(-(-n // blk),)](ids, e2s, slot, counts, n, e2s.numel(), s, BLOCK=blk)
        kern.slot_offsets_kernel[(1,)](counts, cursor, block_slot, num_padded, sorted_ids, n, s, p,
                                       SP2=sp2, BLOCK_M=block_m, CHUNK=chunk, FILL=_FILL)
        kern.slot_scatter_kernel[(-(-n // blk),)](slot, cursor, sorted_ids, n, BLOCK=blk)
    return slot, sorted_ids, block_slot, num_padded


@contextlib.contextmanager
def _overriding(**values):
    """Within the block, the module's switches ``values`` (names of its globals) have these values
    (tests and probes; not thread-safe)."""
    g = globals()
    saved = {k: g[k] for k in values}
    g.update(values)
    try:
        yield
    finally:
        g.update(saved)


def _forced_sorted_h(on: bool):
    """fused_moe's sorted path keeps h in sorted order (True) or by token-slot (False) whatever the
    config, within the block."""
    return _overriding(_SORTED_H=on)


def _forced_align(path: str):
    """align_by_slot takes the given path ("per_slot", "one_program", "two_launch" or "atomics")
    whatever N and S are, within the block."""
    per, one, two = {"per_slot": (1 << 62, 0, 0), "one_program": (-1, 1 << 62, 0), "two_launch": (-1, -1, 1 << 62),
                     "atomics": (-1, -1, -1)}[path]
    return _overriding(_ALIGN_PER_SLOT_MAX_N=per, _ALIGN_ONE_PROGRAM_MAX_N=one, _ALIGN_TWO_LAUNCH_MAX_SLOTS=two)


def _check(x, topk_ids, topk_weights, expert_to_slot, w13, w2, w13_scale, w2_scale):
    def tensor(name, v):
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"fused_moe: {name} must be a torch.Tensor, got {type(v).__name__}")

    for name, v in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                    ("expert_to_slot", expert_to_slot), ("w13", w13), ("w2", w2)):
        tensor(name, v)
    if x.ndim != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"fused_moe: x must be [T, H] bf16/fp16/fp32, got shape {tuple(x.shape)} {x.dtype}")
    t, h = x.shape
    if topk_ids.ndim != 2 or topk_ids.shape[0] != t or topk_ids.dtype.is_floating_point \
            or topk_ids.dtype == torch.bool:
        raise ValueError(f"fused_moe: topk_ids must be an integer [T={t}, K] tensor, got "
                         f"shape {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.dtype.is_floating_point:
        raise ValueError(f"fused_moe: topk_weights must be a float tensor of topk_ids' shape "
                         f"{tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)} {topk_weights.dtype}")
    if expert_to_slot.ndim != 1 or expert_to_slot.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: expert_to_slot must be [E] int32/int64, got shape "
                         f"{tuple(expert_to_slot.shape)} {expert_to_slot.dtype}")
    if w13.ndim != 3 or w13.shape[2] != h or w13.shape[1] % 2:
        raise ValueError(f"fused_moe: w13 must be [S, 2I, H={h}], got {tuple(w13.shape)}")
    s, two_i, _ = w13.shape
    inter = two_i // 2
    if tuple(w2.shape) != (s, h, inter):
        raise ValueError(f"fused_moe: w2 must be [S={s}, H={h}, I={inter}] to match w13, got {tuple(w2.shape)}")
    if w13.dtype != w2.dtype:
        raise ValueError(f"fused_moe: w13 and w2 must share a dtype, got {w13.dtype} and {w2.dtype}")
    if w13.dtype == torch.int8:
        if w13_scale is None or w2_scale is None:
            raise ValueError("fused_moe: int8 weights need w13_scale [S, 2I] and w2_scale [S, H] (fp32)")
        tensor("w13_scale", w13_scale)
        tensor("w2_scale", w2_scale)
        if tuple(w13_scale.shape) != (s, two_i) or w13_scale.dtype != torch.float32:
            raise ValueError(f"fused_moe: w13_scale must be [S={s}, 2I={two_i}] fp32, got "
                             f"{tuple(w13_scale.shape)} {w13_scale.dtype}")
        if tuple(w2_scale.shape) != (s, h) or w2_scale.dtype != torch.float32:
            raise ValueError(f"fused_moe: w2_scale must be [S={s}, H={h}] fp32, got "
                             f"{tuple(w2_scale.shape)} {w2_scale.dtype}")
    elif w13.dtype in _FLOAT_DTYPES:
        if w13_scale is not None or w2_scale is not None:
            raise ValueError(f"fused_moe: scales are only for int8 weights, weights are {w13.dtype}")
    else:
        raise ValueError(f"fused_moe: weights must be bf16/fp16/fp32 or int8, got {w13.dtype}")
    for name, w in (("w13", w13), ("w2", w2)):
        # the kernels index inside one expert's weights with 32-bit offsets (64-bit across experts)
        span = sum((n - 1) * abs(st) for n, st in zip(w.shape[1:], w.stride()[1:]))
        if span >= 2 ** 31:
            raise ValueError(f"fused_moe: one expert of {name} spans {span + 1} elements (shape "
                             f"{tuple(w.shape)}, strides {w.stride()}); the kernels need fewer than 2**31")
    dev = x.device
    named = [("topk_ids", topk_ids), ("topk_weights", topk_weights), ("expert_to_slot", expert_to_slot),
             ("w13", w13), ("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale)]
    for name, v in named:
        if v is not None and v.device != dev:
            raise ValueError(f"fused_moe: {name} is on {v.device}, x is on {dev}; all must share a device")
    return t, h, s, inter


def _compute_dtype(x_dtype, w_dtype):
    if w_dtype != torch.int8:
        return w_dtype
    return x_dtype if x_dtype != torch.float32 else torch.bfloat16


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              expert_to_slot: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              config: MoEConfig | DirectConfig | None = None) -> torch.Tensor:
    """The MoE output of the GPU-resident experts, on the caller's current stream.

    x [T, H] bf16/fp16/fp32; topk_ids [T, K] int (-1 = skip); topk_weights [T, K] float;
    expert_to_slot [E] int32/int64 (slot of each expert in w13/w2, -1 = not on the GPU: skipped; ids
    outside [0, E) and slots outside [0, S) are skipped too, since checking them would need a host sync);
    w13 [S, 2I, H] (gate rows, then up rows) and w2 [S, H, I], bf16/fp16/fp32 or int8 with
    w13_scale [S, 2I] and w2_scale [S, H] fp32 (per output row).
    Returns out [T, H] in x's dtype:
    out[t] = sum over k with a GPU slot s of topk_weights[t, k] * w2[s] @ (silu(gate_s x_t) * up_s x_t),
    with fp32 accumulation; the SiLU*up intermediate is rounded to the compute dtype (the weights'
    float dtype, or x's for int8 weights) before the down GEMM. A token with no GPU expert gets zeros.
    With int8 weights a config may set ``a8`` (the tuned tables and the heuristic do for large T):
    the gate+up then takes x as two int8 levels per token (``act_quant2``, error at most amax/64516
    per element) and sums exactly in int32 on the int8 tensor cores.
    config: a MoEConfig (sorted path) or DirectConfig (direct path) to force; default from the tuned
    table for this GPU, else the heuristic. Both paths compute the same sums (in other orders).
    """
    t, h, s, inter = _check(x, topk_ids, topk_weights, expert_to_slot, w13, w2, w13_scale, w2_scale)
    k = topk_ids.shape[1]
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0:
        return out
    if config is not None and not isinstance(config, (MoEConfig, DirectConfig)):
        raise TypeError(f"fused_moe: config must be a MoEConfig or DirectConfig, got {type(config).__name__}")
    if isinstance(config, MoEConfig) and config.a8 and w13.dtype != torch.int8:
        raise ValueError(f"fused_moe: MoEConfig.a8 (two-level int8 activations) needs int8 weights, "
                         f"weights are {w13.dtype}")
    interp = kernels_interpreted()
    if x.device.type == "cpu" and not interp:
        raise RuntimeError("fused_moe: CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 "
                           "before the first kt.gpu_ops call (or pass CUDA tensors)")
    if x.device.type == "cuda" and interp:
        raise RuntimeError("fused_moe: kernels were set up under TRITON_INTERPRET=1 and cannot take CUDA "
                           "tensors in this process")
    if config is None:
        config = _default_config(t, k, s, h, inter, _WNAME[w13.dtype],
                                 _dev_index(x.device) if x.device.type == "cuda" else -1)
    if s == 0 or inter == 0 or k == 0:
        return out.zero_()
    cdt = _compute_dtype(x.dtype, w13.dtype)
    if isinstance(config, DirectConfig):
        ids = topk_ids.contiguous()
        e2s = expert_to_slot.to(torch.int32)
        hbuf = direct_gate_up(x, w13, w13_scale, ids, e2s, config, cdt)
        direct_down(hbuf, w2, w2_scale, topk_weights, ids, e2s, out, config)
        return out

    align = config.align_m
    slot32, sorted_ids, block_slot, num_padded = align_by_slot(topk_ids.contiguous(), expert_to_slot, s, align)
    programs = _INTERPRETER_PROGRAMS if interp else _PROGRAMS_PER_SM * _num_sms(_dev_index(x.device))
    dcfg = config.for_down()
    sh = sorted_h_for(dcfg)
    hbuf = gate_up(x, w13, w13_scale, sorted_ids, block_slot, num_padded, k, config, cdt, programs, align, sh)
    y = down(hbuf, w2, w2_scale, topk_weights, sorted_ids, block_slot, num_padded, dcfg, programs,
             y_dtype_for(out.dtype), align, sh)
    combine(y, slot32, out)
    return out


def sorted_h_for(down_config) -> bool:
    """Whether fused_moe keeps h in sorted order for this down config (MoEConfig.for_down()): where
    its weight tiles come by TMA, so that its h row blocks do too (H200, qwen3 T=4096: int8 down
    98.4 -> 88.2 us, bf16 72.2 -> 71.2; git show lab-archive:benchmarks/gpu_sorted_a_probe.py)."""
    return _SORTED_H if _SORTED_H is not None else bool(down_config.tma)


def _dev_index(device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _grid(block_slot, inter_or_h, config, programs, align_m):
    # Worst-case tiles (every row block in use) bound the persistent grid; a flattened tile loop
    # keeps one program per SM (its next tile's loads overlap this one's epilogue instead).
    if config.flatten:
        programs = max(1, programs // _PROGRAMS_PER_SM)
    row_blocks = block_slot.numel() * (align_m // config.block_m)
    return (max(1, min(programs, row_blocks * -(-inter_or_h // config.block_n))),)


def y_dtype_for(out_dtype):
    """The down GEMM's row dtype for an output dtype: bf16 for a bf16 output (its rounding, 2^-9, is
    the output's own, and the combine reads half: H200, qwen3 T=4096, 28 -> 19 us; output error vs
    the fp32 reference 2.3e-3 -> 2.8e-3), else fp32."""
    return torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32


def _tensor_descriptor():
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - a Triton without host-side TMA descriptors
        return None
    return TensorDescriptor


@lru_cache(maxsize=16)
def _tma_device(index: int) -> bool:
    return index < 0 or torch.cuda.get_device_capability(index)[0] >= 9


def _tma_desc(t, box):
    """A TMA descriptor of the row-major 2-D tensor t with boxes ``box`` [rows, cols], or None
    where TMA cannot take it: not contiguous, base or rows not 16-byte aligned, a box side over 256
    or narrower than 16 bytes, or a GPU before Hopper (the interpreter takes any)."""
    desc = _tensor_descriptor()
    esz = t.element_size()
    if (desc is None or not t.is_contiguous() or t.data_ptr() % 16 or (t.shape[1] * esz) % 16
            or max(box) > 256 or box[1] * esz < 16
            or not _tma_device(_dev_index(t.device) if t.device.type == "cuda" else -1)):
        return None
    return desc.from_tensor(t, list(box))


def _weight_desc(w, config):
    """(TMA descriptor of w [S, R, C] seen as [S*R, C] with [block_n, block_k] boxes, True) where
    config.tma asks for it and ``_tma_desc`` allows it; else (w, False): the kernels then load
    weight tiles through pointers."""
    ok = config.tma and w.is_contiguous()  # (a view of other layouts may not exist)
    d = _tma_desc(w.view(-1, w.shape[2]), (config.block_n, config.block_k)) if ok else None
    return (w, False) if d is None else (d, True)


def _act_desc(a, config):
    """(TMA descriptor of the activation rows a [P, C] with [block_m, block_k] boxes, True) where
    ``_tma_desc`` allows it, else (a, False)."""
    d = _tma_desc(a, (config.block_m, config.block_k))
    return (a, False) if d is None else (d, True)


def _align_of(config, align_m):
    align_m = config.block_m if align_m is None else align_m
    if align_m % config.block_m:
        raise ValueError(f"row blocks of {config.block_m} do not divide the alignment {align_m}")
    return align_m


def gate_up(x, w13, w13_scale, sorted_ids, block_slot, num_padded, top_k, config, compute_dtype, programs,
            align_m=None, sorted_h=False):
    """h [N, I] = silu(gate x) * up x per GPU token-slot (rows of CPU token-slots are left unwritten).
    align_m: the block size align_by_slot ran with (default config.block_m; a multiple of it).
    sorted_h: h [P, I] in sorted_ids' order instead (padding rows unwritten), for ``down(sorted_h=True)``."""
    kern = _kernels()
    t = x.shape[0]
    n = t * top_k
    inter = w13.shape[1] // 2
    int8w = w13.dtype == torch.int8
    a8 = int8w and config.a8
    if a8:
        xc, xs = act_quant2(x)
        xc_strides = (xc.stride(1), xc.stride(2), xc.stride(0))
    else:
        xc = x.contiguous()
        xs = xc  # any tensor: not read without A8
        xc_strides = (xc.stride(0), xc.stride(1), 0)
    hbuf = torch.empty((sorted_ids.numel() if sorted_h else n, inter), dtype=compute_dtype, device=x.device)
    s13 = w13_scale if int8w else w13  # any tensor: not read when INT8_W is off
    s13_strides = (s13.stride(0), s13.stride(1)) if int8w else (0, 0)
    wd, tma = _weight_desc(w13, config)
    align_m = _align_of(config, align_m)
    kern.gate_up_kernel[_grid(block_slot, inter, config, programs, align_m)](
        xc, w13, wd, s13, hbuf, sorted_ids, block_slot, num_padded, xs,
        n, x.shape[1], inter, top_k,
        *xc_strides, w13.stride(0), w13.stride(1), w13.stride(2),
        *s13_strides, hbuf.stride(0), hbuf.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        ALIGN_M=align_m, INT8_W=int8w, TMA_W=tma, FLATTEN=config.flatten, CT=_CT[compute_dtype],
        UPCAST=kernels_interpreted(), A8=a8, SORTED_H=sorted_h, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return hbuf


def act_quant2(x, elems: int = _ACT_QUANT_ELEMS, num_warps: int = _ACT_QUANT_WARPS):
    """Two-level per-token int8 of x [T, H] (kt.reference.quantize_act2): (q [2, T, H] int8,
    s [T, 2] fp32) with x ~ s[:, 0:1] * q[0] + s[:, 1:2] * q[1], which keeps about 15 bits of each
    row (error at most amax / 64516 per element, where bf16 keeps 8 bits of each value). One
    launch; each program takes whole rows, ``elems`` elements (a power of two) or one row if that is
    longer (rows longer than 8192 elements are read in three passes), with ``num_warps`` warps."""
    t, h = x.shape
    q = torch.empty((2, t, h), dtype=torch.int8, device=x.device)
    s = torch.empty((t, 2), dtype=torch.float32, device=x.device)
    if t:
        block_h = min(_np2(h), max(elems, _ACT_QUANT_ROW_MAX))
        rows = max(1, min(elems // block_h, _np2(t)))
        _kernels().act_quant2_kernel[(-(-t // rows),)](x, q, s, t, h, x.stride(0), x.stride(1), q.stride(0),
                                                       q.stride(1), ROWS=rows, BLOCK_H=block_h,
                                                       ONE_PASS=block_h >= h, num_warps=num_warps)
    return q, s


def down(hbuf, w2, w2_scale, topk_weights, sorted_ids, block_slot, num_padded, config, programs,
         y_dtype=torch.float32, align_m=None, sorted_h=False):
    """y [N, H] (y_dtype: fp32, or bf16 to halve the combine's reads) = topk_weight * (w2 @ h),
    summed in fp32, per GPU token-slot (other rows left unwritten).
    config: the down kernel's own (MoEConfig.for_down()); align_m as for gate_up; sorted_h: hbuf is
    gate_up(sorted_h=True)'s [P, I] (its row blocks are read by TMA where the config's weights are)."""
    kern = _kernels()
    n = topk_weights.numel()
    inter = hbuf.shape[1]
    h = w2.shape[1]
    int8w = w2.dtype == torch.int8
    rw = topk_weights.reshape(n).to(torch.float32).contiguous()
    y = torch.empty((n, h), dtype=y_dtype, device=hbuf.device)
    s2 = w2_scale if int8w else w2
    s2_strides = (s2.stride(0), s2.stride(1)) if int8w else (0, 0)
    wd, tma = _weight_desc(w2, config)
    hd, tma_h = _act_desc(hbuf, config) if sorted_h and tma else (hbuf, False)
    align_m = _align_of(config, align_m)
    kern.down_kernel[_grid(block_slot, h, config, programs, align_m)](
        hbuf, hd, w2, wd, s2, y, rw, sorted_ids, block_slot, num_padded,
        n, h, inter,
        hbuf.stride(0), hbuf.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        *s2_strides, y.stride(0), y.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        ALIGN_M=align_m, INT8_W=int8w, TMA_W=tma, FLATTEN=config.flatten, CT=_CT[hbuf.dtype],
        UPCAST=kernels_interpreted(), SORTED_H=sorted_h, TMA_H=tma_h, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return y


def combine(y, slot32, out, block_h: int = 1024, num_warps: int = 4):
    """out [T, H] = sum over k of y[t*K + k] where slot32[t*K + k] >= 0 (fp32, fixed order). A
    program takes one token x ``block_h`` columns (capped at H's next power of two). (H200, qwen3
    T=4096 with 25 % of the token-slots on the GPU: 19.3-19.5 us for 50 MB, 61 % of HBM; no launch
    shape of 512-4096 columns, 1-4 tokens and 2-8 warps per program did better:
    git show lab-archive:benchmarks/gpu_a8_probe.py.)"""
    kern = _kernels()
    t, h = out.shape
    k = slot32.numel() // max(t, 1)
    block_h = min(block_h, max(16, _np2(h)))
    kern.combine_kernel[(t, -(-h // block_h))](
        y, slot32, out, h, y.stride(0), y.stride(1), out.stride(0), out.stride(1),
        TOP_K=k, KP=_np2k(k), BLOCK_H=block_h, num_warps=num_warps)


def _np2k(k: int) -> int:
    """Next power of two >= k, at least 2 (a vector of a token's K slots)."""
    return max(2, 1 << max(k - 1, 0).bit_length())


def _np2(n: int) -> int:
    return max(16, 1 << max(n - 1, 0).bit_length())


def direct_gate_up(x, w13, w13_scale, topk_ids, e2s, config, compute_dtype):
    """Direct path: h [N, I] = silu(gate x) * up x per GPU token-slot (rows of CPU token-slots are left
    unwritten). config.gate_up "scan": one program per (slot, column block), each scanning all N ids
    (a tensor-core tile of the slot's rows); "pairs": one GEMV program per (token-slot, column block)."""
    kern = _kernels()
    t, top_k = topk_ids.shape
    n = t * top_k
    s, two_i, hid = w13.shape
    inter = two_i // 2
    int8w = w13.dtype == torch.int8
    xc = x.contiguous()
    hbuf = torch.empty((n, inter), dtype=compute_dtype, device=x.device)
    s13 = w13_scale if int8w else w13
    s13_strides = (s13.stride(0), s13.stride(1)) if int8w else (0, 0)
    if config.gate_up == "pairs":
        kern.gate_up_pairs_kernel[(n, -(-inter // config.block_n))](
            xc, w13, s13, hbuf, topk_ids, e2s,
            e2s.numel(), s, hid, inter, top_k,
            xc.stride(0), xc.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
            *s13_strides, hbuf.stride(0), hbuf.stride(1),
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, STAGES=config.num_stages,
            INT8_W=int8w, CT=_CT[compute_dtype], UPCAST=kernels_interpreted(),
            num_warps=config.num_warps, num_stages=config.num_stages)
        return hbuf
    kern.gate_up_scan_kernel[(s, -(-inter // config.block_n))](
        xc, w13, s13, hbuf, topk_ids, e2s,
        n, e2s.numel(), hid, inter, top_k,
        xc.stride(0), xc.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        *s13_strides, hbuf.stride(0), hbuf.stride(1),
        NP=_np2(n), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        INT8_W=int8w, CT=_CT[compute_dtype], UPCAST=kernels_interpreted(),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return hbuf


def direct_down(hbuf, w2, w2_scale, topk_weights, topk_ids, e2s, out, config):
    """Direct path: out [T, H] = sum over k of topk_weight * (w2 @ h) over the token's GPU experts, in k
    order (fp32); zeros for a token with no GPU expert. One program per (token, column block)."""
    kern = _kernels()
    t, top_k = topk_ids.shape
    s, hid, inter = w2.shape
    int8w = w2.dtype == torch.int8
    rw = topk_weights.reshape(t * top_k).to(torch.float32).contiguous()
    s2 = w2_scale if int8w else w2
    s2_strides = (s2.stride(0), s2.stride(1)) if int8w else (0, 0)
    kern.down_tokens_kernel[(t, -(-hid // config.down_block_n))](
        hbuf, w2, s2, out, rw, topk_ids, e2s,
        e2s.numel(), s, hid, inter,
        hbuf.stride(0), hbuf.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        *s2_strides, out.stride(0), out.stride(1),
        TOP_K=top_k, KP=_np2k(top_k), BLOCK_N=config.down_block_n, BLOCK_K=config.down_block_k,
        STAGES=config.down_num_stages, INT8_W=int8w, UPCAST=kernels_interpreted(), num_warps=config.down_num_warps)
    return out
