"""CPUMoE: the experts of one MoE layer computed on the CPU (check, allocate, launch).

Legend: T tokens, E experts, K top-k, H hidden size, I expert intermediate size, G group size.

    moe = kt.CPUMoE.from_tensors(gate, up, down, scheme="int8")   # gate/up [E, I, H], down [E, H, I]
    out = moe(x, topk_ids, topk_weights)                           # x [T, H] -> [T, H], x's dtype
    h = moe.submit(x, topk_ids, topk_weights); ...; out = h.wait()

The arithmetic lives in ``_moe_driver`` (written once for every ISA) and the GEMM micro-kernels
of the ``registry.KernelSet`` of this host; the work runs on a ``CpuPool`` (the default pool
unless one is given). Scratch buffers belong to the pool and are shared by every layer on it.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..config import QuantScheme, check_activations
from . import _moe_driver as drv
from . import _align
from .packing import BLOCK_N, PackedWeight, aligned_packed, int4_has_minus8, int4_ratio_table, pack
from .pool import CpuPool, default_pool

__all__ = ["CPUMoE", "MoEHandle", "GatedHandle", "GateResult"]

_SCHEME_CODE = {QuantScheme.INT8: drv.SCHEME_INT8, QuantScheme.INT4: drv.SCHEME_INT4,
                QuantScheme.BF16: drv.SCHEME_BF16}
MAX_CHUNKS_PER_JOB = 24
DEFAULT_WATCHDOG_S = 600.0  # CPUMoE.watchdog_s


# ----------------------------------------------------------------------------- input handling

def _is_torch(a) -> bool:
    return type(a).__module__.startswith("torch") and hasattr(a, "detach")


def _torch_cpu(name: str, a):
    """A torch tensor's data on the CPU without autograd (no copy if it is there already), or a
    clear error for a meta tensor. Written with the cheap attribute reads (``is_cpu``,
    ``requires_grad``): a decode call does this for four tensors, and ``.device.type`` and an
    unneeded ``detach()`` cost ~0.5 us each."""
    if a.is_meta:
        raise ValueError(f"{name} is a meta tensor (it has no data)")
    if a.requires_grad:
        a = a.detach()
    return a if a.is_cpu else a.cpu()


def _to_numpy_2d(name: str, a, dtypes: tuple[str, ...]):
    """-> (numpy array, kind) with kind 'f32' or 'bf16' (uint16 bit patterns)."""
    if _is_torch(a):
        import torch

        if a.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(a.shape)}")
        t = _torch_cpu(name, a)
        if t.dtype is torch.bfloat16:
            if not t.is_contiguous():
                t = t.contiguous()
            return t.view(torch.int16).numpy().view(np.uint16), "bf16"
        if t.dtype is torch.float32 and t.is_contiguous():
            return t.numpy(), "f32"
        if t.dtype in (torch.float16, torch.float32, torch.float64):
            return np.ascontiguousarray(t.to(torch.float32).numpy()), "f32"
        raise TypeError(f"{name} must be bf16, fp16 or fp32, got {t.dtype}")
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(a).__name__}")
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {a.shape}")
    if a.dtype not in (np.float32, np.float16, np.float64):
        raise TypeError(f"{name} must be float32/float16 (numpy), got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32), "f32"


def _routing_np(name: str, a) -> np.ndarray:
    """A routing argument (torch or numpy) as numpy, without a copy where it can."""
    if type(a) is np.ndarray:
        return a
    if _is_torch(a):
        import torch

        t = _torch_cpu(name, a)
        return t.float().numpy() if t.dtype is torch.bfloat16 else t.numpy()
    if isinstance(a, np.ndarray):
        return a
    raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(a).__name__}")


def _routing(name_ids, ids, name_w, w, T, E):
    ids_np = _routing_np(name_ids, ids)
    w_np = _routing_np(name_w, w)
    if ids_np.ndim != 2 or ids_np.shape[0] != T:
        raise ValueError(f"{name_ids} must be [T={T}, K], got shape {ids_np.shape}")
    if ids_np.dtype.kind not in "iu":
        raise TypeError(f"{name_ids} must hold integers, got {ids_np.dtype}")
    if w_np.shape != ids_np.shape:
        raise ValueError(f"{name_w} must have the shape of {name_ids} {ids_np.shape}, got {w_np.shape}")
    if w_np.dtype.kind != "f":
        raise TypeError(f"{name_w} must be floating point, got {w_np.dtype}")
    ids64 = np.ascontiguousarray(ids_np, dtype=np.int64)
    if ids64.size:
        lo, hi = drv.id_range(ids64)
        if lo < -1 or hi >= E:
            raise ValueError(f"{name_ids} must be in [-1, {E}) (-1 = skip), got values in [{lo}, {hi}]")
    return ids64, np.ascontiguousarray(w_np, dtype=np.float32)


def _as_stack(name: str, a, ndim: int = 3) -> np.ndarray | object:
    if _is_torch(a):
        if a.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(a.shape)}")
        if str(a.dtype) not in ("torch.bfloat16", "torch.float16", "torch.float32"):
            raise TypeError(f"{name} must be bf16, fp16 or fp32, got {a.dtype}")
        return a
    if isinstance(a, np.ndarray):
        if a.ndim != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
        if a.dtype not in (np.float32, np.float16, np.float64):
            raise TypeError(f"{name} must be float32/float16, got {a.dtype}")
        return a
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(a).__name__}")


def _f32(a) -> np.ndarray:
    if _is_torch(a):
        return a.detach().cpu().float().numpy()
    return np.asarray(a, dtype=np.float32)


def _pack_stack(mats, e_count, scheme, group_size) -> PackedWeight:
    """Pack expert matrices one by one into preallocated stacks (no [E, N, D] fp32 copy)."""
    first = None
    for e in range(e_count):
        p = pack(mats(e), scheme, group_size)
        if first is None:
            first = p
            data = _align.empty((e_count,) + p.data.shape, p.data.dtype)
            scale = _align.empty((e_count,) + p.scale.shape, p.scale.dtype)
            wsum = _align.empty((e_count,) + p.wsum.shape, p.wsum.dtype)
        data[e] = p.data
        scale[e] = p.scale
        wsum[e] = p.wsum
    return PackedWeight(scheme, first.n, first.d, first.n_pad, first.d_pad, first.group_size,
                        data, scale, wsum)


# ----------------------------------------------------------------------------- the layer

class MoEHandle:
    """An in-flight ``CPUMoE.submit``; ``wait()`` returns the [T, H] output."""

    def __init__(self, first, rest, finish):
        self._first = first
        self._rest = rest
        self._finish = finish  # the arguments of _finish_out
        self._result = None
        self._done = False

    def done(self) -> bool:
        return self._done or (self._first is not None and self._first.done() and not self._rest)

    def wait(self):
        if not self._done:
            try:
                if self._first is not None:
                    self._first.wait()
                for launch in self._rest:
                    launch().wait()
            finally:
                self._done = True
                self._rest = ()
            self._result = _finish_out(*self._finish)
        return self._result


@dataclass(frozen=True)
class GateResult:
    """How a stream-gated job ended (``GatedHandle.wait``).

    opened: its start flag was seen; finished: it published its result ("start" cleared, "done"
    set); bad_ids: routing ids outside [-1, E) that it skipped; seconds: from the start flag to
    the result (time-stamp counter); error: a participant's exception (then not finished)."""
    opened: bool
    finished: bool
    bad_ids: int
    seconds: float
    error: BaseException | None = None


class GatedHandle:
    """A job published by ``CPUMoE.submit_gated``: ``wait()`` joins it (the caller takes part
    from the start flag on) and returns a ``GateResult``; ``abort()`` releases the participants
    of a job whose start flag will never come."""

    def __init__(self, pool: CpuPool, handle, words: np.ndarray):
        self._pool = pool
        self._handle = handle
        self._words = words  # the job's own result words (_moe_driver.R_*)
        self._result: GateResult | None = None

    def abort(self) -> None:
        self._pool.abort(self._handle)

    def wait(self) -> GateResult:
        if self._result is None:
            err = None
            try:
                self._handle.wait()
            except RuntimeError as exc:  # a participant raised: re-raised by PoolHandle.wait
                err = exc.__cause__ or exc
            r = self._words
            finished = bool(r[drv.R_FINISHED]) and err is None
            cyc = int(r[drv.R_END_CYCLES] - r[drv.R_OPEN_CYCLES]) if finished else 0
            self._result = GateResult(bool(r[drv.R_OPENED]), finished, int(r[drv.R_BAD_IDS]),
                                      max(cyc, 0) / tsc_hz(), err)
        return self._result


class CPUMoE:
    """The CPU experts of one MoE layer.

    w13: stacked PackedWeight [E, 2I, H] (gate rows [0, I), up rows [up_offset, up_offset + I)).
    w2: stacked PackedWeight [E, H, I].
    pool: the CpuPool to run on (default: ``default_pool()``, looked up at each call).
    chunk_tokens: tokens per internal chunk (bounds scratch memory: about
        chunk_tokens * K * (2I + H) * 4 bytes plus activations, allocated only as large as the
        calls need). Each chunk reads every hit expert's weights once, so larger chunks read less:
        2048 was 5 % faster than 1024 at T=2048 on the 2-core dev machine (212 vs 225 ms).
    max_tokens: optional upper bound on T per call (a larger T is a ValueError).
    kernels: optional (gemv, gemm) pair of jitted kernels of the README contract (tests);
        default: the registry's best for this host (or ``variant``).
    activations: how the integer schemes quantise activations: "int8" (per token, the default)
        or "int8x2" (two int8 levels per token, ``reference.quantize_act2``: the same int8
        kernels run on twice the rows, so about 2x the prefill compute and the same decode
        weight traffic; the layer error is then the weight error alone: INT8 0.014 instead of
        0.025 relative on Gaussian weights). BF16 takes bf16 activations either way.
    """

    def __init__(self, w13: PackedWeight, w2: PackedWeight, *, up_offset: int | None = None,
                 pool: CpuPool | None = None, chunk_tokens: int = 2048,
                 max_tokens: int | None = None, kernels=None, variant: str | None = None,
                 gemv_max: int | None = None, activations: str = "int8"):
        if not isinstance(w13, PackedWeight) or not isinstance(w2, PackedWeight):
            raise TypeError("w13 and w2 must be stacked PackedWeight (from pack_experts)")
        if w13.data.ndim != 5 or w2.data.ndim != 5:
            raise ValueError("w13 and w2 must be stacked (leading E axis), see packing.pack_experts")
        if w13.scheme is not w2.scheme:
            raise ValueError(f"w13 scheme {w13.scheme} != w2 scheme {w2.scheme}")
        E = w13.data.shape[0]
        if w2.data.shape[0] != E:
            raise ValueError(f"w13 has {E} experts but w2 has {w2.data.shape[0]}")
        H = w13.d
        I = w2.d
        if w2.n != H:
            raise ValueError(f"w2 must be [E, H={H}, I], got N={w2.n}")
        if up_offset is None:
            up_offset = I
        if w13.n < up_offset + I or up_offset < I:
            raise ValueError(f"w13 must hold gate rows [0, {I}) and up rows "
                             f"[{up_offset}, {up_offset + I}); it has {w13.n} rows")
        if not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
        self.scheme = w13.scheme
        self.activations = activations
        # kernels read 64-byte rows: weights from elsewhere are copied once if they straddle lines
        self.w13, self.w2 = aligned_packed(w13), aligned_packed(w2)
        self.num_experts, self.hidden, self.intermediate = E, H, I
        self.up_offset = int(up_offset)
        self.group_size = w13.group_size
        self.chunk_tokens = chunk_tokens
        self.max_tokens = max_tokens
        self._pool = pool
        from . import registry

        if kernels is not None:
            kv, km = kernels
            ks = registry.custom_kernel_set(self.scheme, kv, km, variant)
        else:
            ks = registry.kernel_set(self.scheme, variant)
        self.kernels = ks
        self.variant = ks.family
        self._kv, self._km = ks.decode(), ks.prefill()  # (contract kernels: another layer may be built with them)
        # INT4 ratio tables where the set has a kernel that reads them and the scales have the form
        self._tabs = self._int4_tables() if ks.gemv_tab is not None else None
        minus8 = ks.gemm_exact is not None and (int4_has_minus8(self.w13) or int4_has_minus8(self.w2))
        forms = ks.layer_forms(self._tabs is not None, minus8)
        if forms.warn_exact:
            warnings.warn("CPUMoE: these INT4 weights hold the value -8, which kt's quantiser never "
                          "writes ([-7, 7]); the fast INT4 prefill GEMM on ratio tables cannot "
                          "multiply it by its group ratio in int8, so this layer's prefill runs the "
                          "per-group kernel instead (exact, slower)", UserWarning, stacklevel=2)
        self._tab_m = forms.prefill_tables
        code = _SCHEME_CODE[self.scheme]
        self._kaddr = (drv.kernel_address(forms.decode, code), drv.kernel_address(forms.prefill, code))
        # the down GEMM of chunks whose outputs (y) take at least y_stream_bytes: the form with
        # non-temporal stores, where the set has one. Such a y (qwen3 T=2048: 134 MB) leaves
        # the caches before the combine reads it, so reading each line before writing it is
        # wasted traffic. Device, 16 threads, interleaved (benchmarks/profile_moe.py): INT8
        # T=2048 14.38 vs 15.64 ms, INT4 18.44 vs 18.85; at T=512 (34 MB) level or slower on the
        # device, hence the threshold.
        self._kaddr_ys = (drv.kernel_address(forms.prefill_stream, code)
                          if forms.prefill_stream is not None else 0)
        self.y_stream_bytes = 64 << 20
        self.gemv_max = gemv_max if gemv_max is not None else ks.gemv_max
        # 16-row blocks per (expert, rows) task of the gate+up and down phases; 0 = the driver's
        # heuristic (_moe_driver._blocks_per_task). A tuning knob, not needed for correctness.
        self.blocks_per_task = (0, 0)
        # Decode's down tasks wait per expert instead of behind all-thread barriers
        # (_moe_driver's "pipelined decode"). A tuning knob, not needed for correctness.
        self.pipelined_decode = True
        self.tail_experts = None
        self.tail_parts = 4
        self.watchdog_s = DEFAULT_WATCHDOG_S
        self._no_gpu = np.zeros(E, np.uint8)
        self._no_gpu_at = self._no_gpu.ctypes.data
        self._act = np.uint16 if self.scheme is QuantScheme.BF16 else np.int8  # activation rows
        self._prof: np.ndarray | None = None  # set by profile(): new_profile's array
        self._wdesc = self._weight_desc()
        self._tmpl: dict = {}

    # -- constructors

    @classmethod
    def from_tensors(cls, gate, up, down, scheme: QuantScheme | str = "int8", group_size: int = 64,
                     pool: CpuPool | None = None, **kw) -> "CPUMoE":
        """Quantise and pack gate/up [E, I, H] and down [E, H, I] (torch or numpy; bf16/fp16/fp32)."""
        scheme = QuantScheme.parse(scheme)
        gate = _as_stack("gate", gate)
        up = _as_stack("up", up)
        down = _as_stack("down", down)
        E, I, H = tuple(gate.shape)
        if tuple(up.shape) != (E, I, H):
            raise ValueError(f"up must have gate's shape [E, I, H] = {(E, I, H)}, got {tuple(up.shape)}")
        if tuple(down.shape) != (E, H, I):
            raise ValueError(f"down must be [E, H, I] = {(E, H, I)}, got {tuple(down.shape)}")
        if min(E, I, H) <= 0:
            raise ValueError(f"empty expert weights: gate shape {(E, I, H)}")
        w13 = _pack_stack(lambda e: np.concatenate([_f32(gate[e]), _f32(up[e])], axis=0),
                          E, scheme, group_size)
        w2 = _pack_stack(lambda e: _f32(down[e]), E, scheme, group_size)
        return cls(w13, w2, up_offset=I, pool=pool, **kw)

    @classmethod
    def from_kt(cls, path, layer: int, pool: CpuPool | None = None,
                physical_to_logical_map=None, **kw) -> "CPUMoE":
        """Load layer ``layer`` of a kt weight-format directory (``kt.weights.load_experts``)."""
        try:
            from ..weights import load_experts
        except ImportError as exc:
            raise NotImplementedError(
                "CPUMoE.from_kt needs kt.weights.load_experts, which this kt build lacks") from exc
        lw = load_experts(path, layer, physical_to_logical_map=physical_to_logical_map)
        return cls(lw.w13, lw.w2, pool=pool, **kw)

    # -- properties

    @property
    def activations(self) -> str:
        """"int8" or "int8x2" (see the class doc); settable between calls."""
        return self._activations

    @activations.setter
    def activations(self, mode: str) -> None:
        self._activations = check_activations(mode, self.scheme)
        self.levels = 2 if mode == "int8x2" else 1

    @property
    def tail_experts(self) -> int | None:
        """Prefill with whole-expert tasks: the last ``tail_experts`` experts of a chunk (the
        smallest; None: as many as the pool has threads, 0: none) are split into about
        ``tail_parts`` gate+up tasks and half as many down tasks, so the threads run out of work
        together (_moe_driver's fused chunks). Tuning knobs, not needed for correctness."""
        return self._tail_experts

    @tail_experts.setter
    def tail_experts(self, n: int | None) -> None:
        self._tail_experts = None if n is None else _count("tail_experts", n)

    @property
    def tail_parts(self) -> int:
        """See ``tail_experts``; 0 or 1: no split."""
        return self._tail_parts

    @tail_parts.setter
    def tail_parts(self, n: int) -> None:
        self._tail_parts = _count("tail_parts", n)

    @property
    def watchdog_s(self) -> float | None:
        """Seconds a pool thread waits inside a call for another thread's work before it gives
        up: the call then ends with a RuntimeError (caused by a TimeoutError) at ``wait()``
        instead of hanging, and the pool stays usable. Legitimate waits inside one call last at
        most one expert's GEMM; the default (600 s) only catches a task that never completes (a
        bug). None or 0: wait forever. Waiting for a CUDA stream's start flag is not covered."""
        return self._watchdog_s

    @watchdog_s.setter
    def watchdog_s(self, s: float | None) -> None:
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float, np.integer, np.floating))
                              or not np.isfinite(s) or s < 0):
            raise ValueError(f"CPUMoE.watchdog_s must be a non-negative number of seconds or None, got {s!r}")
        self._watchdog_s = float(s) if s else None
        self._watch = None  # its ticks, from the next call on (_watch_ticks)

    @property
    def pool(self) -> CpuPool:
        p = self._pool
        if p is None or p.closed:
            if p is not None and p.closed:
                raise RuntimeError("CPUMoE: its CpuPool was shut down")
            return default_pool()
        return p

    @property
    def owns_default_pool(self) -> bool:
        """True when no pool was given: calls run on ``default_pool()``."""
        return self._pool is None

    def use_pool(self, pool: CpuPool) -> None:
        """Run later calls on ``pool`` (scratch buffers belong to the pool, so no state moves)."""
        if not isinstance(pool, CpuPool):
            raise TypeError(f"pool must be a CpuPool, got {type(pool).__name__}")
        self._pool = pool

    @property
    def nbytes(self) -> int:
        return (self.w13.nbytes + self.w2.nbytes
                + (sum(t.nbytes for t in self._tabs) if self._tabs is not None else 0))

    def expert_bytes(self) -> int:
        """Bytes of packed weights one expert holds (w13 + w2, with their scales, sums and tables)."""
        return self.nbytes // self.num_experts

    def expert_read_bytes(self) -> int:
        """Bytes one expert's kernels read in a call (w13 + w2): the packed values and the scale form
        the kernels take (the INT4 ratio tables where the layer has them, else the scales), and the
        per-row weight sums where the kernels use them (INT8 off AMX). The bytes a bandwidth floor
        counts; ``expert_bytes`` also counts what the kernels never read."""
        return sum(a.nbytes for a in self.read_arrays()) // self.num_experts

    def read_arrays(self) -> list[np.ndarray]:
        """The stacked [E, ...] arrays the layer's kernels read (see ``expert_read_bytes``)."""
        out = []
        for i, w in enumerate((self.w13, self.w2)):
            out.append(w.data)
            if self.scheme is not QuantScheme.BF16:  # (BF16 kernels take no scales)
                out.append(self._tabs[i] if self._tabs is not None else w.scale)
            if self.kernels.reads_wsum:  # (vpdpbusd's +128 offset)
                out.append(w.wsum)
        return out

    def __repr__(self):
        return (f"CPUMoE(E={self.num_experts}, H={self.hidden}, I={self.intermediate}, "
                f"scheme={self.scheme.value}, variant={self.variant}, "
                f"{'activations=int8x2, ' if self.levels == 2 else ''}"
                f"weights={self.nbytes / 2**20:.1f} MiB)")

    def _int4_tables(self):
        """(w13, w2) INT4 ratio tables (``packing.int4_ratio_table``: the group scales' ratio
        form, made once here instead of at every call by the AMX prefill kernel), or None if the
        scales are not of the quantiser's form (then the contract kernels run, on the scales).
        The decode GEMV reads them on AVX-512 and AMX hosts (``kernels.avx512.gemv_int4_tab``),
        and on AMX the prefill GEMM too (``kernels.amx.int4.gemm_int4_tab``). A block of 16 rows and a
        group of 64 k hold 512 bytes of values and 64 of scales; the table adds 16 bytes of
        ratios (2.8 % more memory), and the kernels read those instead of the scales (8 % fewer
        bytes)."""
        tabs = (int4_ratio_table(self.w13.scale), int4_ratio_table(self.w2.scale))
        return None if tabs[0] is None or tabs[1] is None else tabs

    # -- descriptor pieces

    def _weight_desc(self) -> np.ndarray:
        """The descriptor words that never change for this layer: weight slots, shapes, kernels."""
        d = np.zeros(drv.DESC_WORDS, np.int64)
        for slot, a in ((drv.A_W13D, self.w13.data), (drv.A_W13S, self.w13.scale),
                        (drv.A_W13W, self.w13.wsum), (drv.A_W2D, self.w2.data),
                        (drv.A_W2S, self.w2.scale), (drv.A_W2W, self.w2.wsum)):
            _put(d, slot, a)
        if self._tabs is not None:
            _put(d, drv.A_W13R, self._tabs[0])
            _put(d, drv.A_W2R, self._tabs[1])
            d[drv.S_TABM] = int(self._tab_m)
        d[drv.S_E] = self.num_experts
        d[drv.S_H] = self.hidden
        d[drv.S_I] = self.intermediate
        d[drv.S_UPOFF] = self.up_offset
        d[drv.S_GS13] = self.w13.group_size
        d[drv.S_GS2] = self.w2.group_size
        d[drv.D_KV13] = d[drv.D_KV2] = self._kaddr[0]
        d[drv.D_KM13] = d[drv.D_KM2] = self._kaddr[1]
        d[drv.S_SCHEME] = _SCHEME_CODE[self.scheme]
        return d

    def _scratch_desc(self, pool: CpuPool, rows_cap: int, tok_cap: int, K: int, act_dtype) -> np.ndarray:
        key = (id(pool), pool.scratch_version, rows_cap, tok_cap, K, act_dtype)
        d = self._tmpl.get(key)
        if d is not None:
            return d
        E = self.num_experts
        R = self.levels
        hp = self.w13.d_pad
        ip = self.w2.d_pad
        n13 = self.w13.n_pad
        n2 = self.w2.n_pad
        nb13 = n13 // BLOCK_N
        nb2 = n2 // BLOCK_N
        hacc = -(-max(self.hidden, self.intermediate) // 16) * 16 + 16
        bufs = {
            drv.A_POS: pool.scratch("moe.pos", tok_cap * K, np.int32).reshape(tok_cap, K),
            drv.A_OFFS: pool.scratch("moe.offs", E + 1, np.int32),
            drv.A_ORDER: pool.scratch("moe.order", E, np.int32),
            drv.A_T13: pool.scratch("moe.t13", E * nb13 * 3, np.int32).reshape(E * nb13, 3),
            drv.A_T2: pool.scratch("moe.t2", E * nb2 * 3, np.int32).reshape(E * nb2, 3),
            drv.A_XG: pool.scratch("moe.xg", tok_cap * R * hp, act_dtype).reshape(tok_cap * R, hp),
            drv.A_XS: pool.scratch("moe.xs", tok_cap * R, np.float32),
            drv.A_RSLOT: pool.scratch("moe.rslot", rows_cap, np.int32),
            drv.A_GU: pool.scratch("moe.gu", rows_cap * n13, np.float32).reshape(rows_cap, n13),
            drv.A_HQ: pool.scratch("moe.hq", rows_cap * ip, act_dtype).reshape(rows_cap, ip),
            drv.A_HS: pool.scratch("moe.hs", rows_cap, np.float32),
            drv.A_Y: pool.scratch("moe.y", rows_cap * n2, np.float32).reshape(rows_cap, n2),
            drv.A_ACC: pool.scratch("moe.acc", pool.num_threads * hacc,
                                    np.float32).reshape(pool.num_threads, hacc),
            drv.A_DEP: pool.scratch("moe.dep", E * drv.DEP_STRIDE, np.int64),
        }
        # per-participant scratch (rows per kernel call, see _call_rows): gathered activations
        # and their scales, a whole-expert task's gate+up outputs
        nth = pool.num_threads
        xb = hp * np.dtype(act_dtype).itemsize
        gch, gus = _call_rows(xb, n13)
        for slot, name, nbytes in ((drv.A_XGS, "moe.xgs", gch * xb), (drv.A_XSS, "moe.xss", gch * 4),
                                   (drv.A_GUS, "moe.gus", max(gus * n13 * 4, 64))):
            nbytes = -(-nbytes // 64) * 64
            bufs[slot] = pool.scratch(name, nth * nbytes, np.int8).reshape(nth, nbytes)
        d = self._wdesc.copy()
        d[drv.S_K] = K
        d[drv.S_GCH], d[drv.S_GUS] = gch, gus
        for slot, a in bufs.items():
            _put(d, slot, a.view(np.int8) if slot in (drv.A_XG, drv.A_HQ) else a)
        if len(self._tmpl) > 16:
            self._tmpl.clear()
        self._tmpl[key] = d
        # the scratch templates may have bumped the version while allocating: key on the final one
        self._tmpl[(id(pool), pool.scratch_version, rows_cap, tok_cap, K, act_dtype)] = d
        return d

    # -- calls

    def __call__(self, x, topk_ids, topk_weights, gpu_mask=None, out=None, incremental=False):
        """out [T, H] (x's dtype, torch in -> torch out) = sum over CPU experts; see submit."""
        return self.submit(x, topk_ids, topk_weights, gpu_mask=gpu_mask, out=out,
                           incremental=incremental).wait()

    forward = __call__

    def submit(self, x, topk_ids, topk_weights, gpu_mask=None, out=None,
               incremental=False) -> MoEHandle:
        """Start the layer on the pool; ``.wait()`` on the handle returns the output.

        x: [T, H] bf16/fp16/fp32 (torch or numpy). topk_ids: [T, K] int (-1 = skip this slot).
        topk_weights: [T, K] float. gpu_mask: [E] bool, True = the expert is computed elsewhere
        (skipped here). out: optional [T, H] output to write (or, with ``incremental``, to add
        into). Inputs (gpu_mask too) must stay unchanged until ``wait()`` returns.
        """
        if out is None and incremental is False:
            h = self._submit_tensors(x, topk_ids, topk_weights, gpu_mask)
            if h is not None:
                return h
        E, H = self.num_experts, self.hidden
        xa, xkind = _to_numpy_2d("x", x, ())
        T = xa.shape[0]
        if xa.shape[1] != H:
            raise ValueError(f"x must be [T, H={H}], got shape {tuple(xa.shape)}")
        if self.max_tokens is not None and T > self.max_tokens:
            raise ValueError(f"x has T={T} tokens, more than max_tokens={self.max_tokens}")
        ids, tw = _routing("topk_ids", topk_ids, "topk_weights", topk_weights, T, E)
        K = ids.shape[1]
        mask = self._mask_arg(gpu_mask)
        if not isinstance(incremental, (bool, np.bool_)):
            raise TypeError(f"incremental must be a bool, got {type(incremental).__name__}")
        if incremental and out is None:
            raise ValueError("incremental=True needs out= (the output to add into)")

        # output: the driver writes fp32 or bf16 bits; anything else goes through a temporary
        torch_in = not isinstance(x, np.ndarray)  # (_to_numpy_2d took anything else as torch)
        okind = "bf16" if xkind == "bf16" else "f32"
        direct = None
        if out is not None:
            direct = _direct_out(out, T, H, okind)
        if direct is not None:
            ob = direct
        else:
            ob = np.empty((T, H), np.uint16 if okind == "bf16" else np.float32)
            if incremental:
                ob[...] = _out_init(out, T, H, okind)

        finish = (ob, out, direct is not None, x, torch_in, xkind, okind)
        if T == 0:
            return MoEHandle(None, (), finish)
        pool = self.pool
        step = self.chunk_tokens * MAX_CHUNKS_PER_JOB
        # jobs of at most `step` tokens: the first starts now, the others from wait()
        rest = tuple(partial(self._launch, pool, xa, ob, ids, tw, mask, j0, min(T, j0 + step), K,
                             incremental, xkind, okind) for j0 in range(step, T, step))
        first = self._launch(pool, xa, ob, ids, tw, mask, 0, min(T, step), K, incremental, xkind, okind)
        return MoEHandle(first, rest, finish)

    def _submit_tensors(self, x, topk_ids, topk_weights, gpu_mask):
        """``submit`` for what a model passes in decode, with less Python than the general
        path (a masked T=1 call on the dev machine 27 vs 42 us, interleaved; on the H200 host
        2-9 us less per T=1 call, session 24): x a CPU torch tensor, bf16 or fp32 [T, H] with T
        within one job; ids int64 (or int32 tensors) and weights fp32 (or bf16 tensors) [T, K];
        gpu_mask None or bool [E]; all contiguous, on the CPU, torch or numpy. The driver gets
        their addresses (no numpy views) and writes a new tensor of x's dtype. None when an
        argument is off this path: the general path then converts it, or says what is wrong."""
        torch = sys.modules.get("torch")
        if torch is None or type(x) is not torch.Tensor:
            return None
        tensor = torch.Tensor
        dt = x.dtype
        if dt is torch.bfloat16:
            kind = "bf16"
        elif dt is torch.float32:
            kind = "f32"
        else:
            return None
        shape = x.shape
        if len(shape) != 2 or shape[1] != self.hidden or not (x.is_cpu and x.is_contiguous()):
            return None
        ks = getattr(topk_ids, "shape", ())
        if len(ks) != 2 or ks[0] != shape[0]:
            return None
        T, K = ks
        if not (0 < T <= self.max_gated_tokens and T <= (self.max_tokens or T) and K > 0):
            return None
        # what routers and servers hand over as often as not: int32 ids, bf16 weights
        if type(topk_ids) is tensor and topk_ids.dtype is torch.int32:
            topk_ids = topk_ids.long()
        if type(topk_weights) is tensor and topk_weights.dtype is torch.bfloat16:
            topk_weights = topk_weights.float()
        E = self.num_experts
        ia = _at(topk_ids, tensor, torch.int64, np.int64, ks)
        wa = _at(topk_weights, tensor, torch.float32, np.float32, ks)
        ma = self._no_gpu_at if gpu_mask is None else _at(gpu_mask, tensor, torch.bool, np.bool_, (E,))
        if not (ia and wa and ma):
            return None
        ob = torch.empty(shape, dtype=dt)
        pool = self.pool
        try:
            desc, words = self._call_words(pool, T, K, False, kind, kind, None)
            lo, hi = drv.put_call_at(desc, x.data_ptr(), ob.data_ptr(), ia, wa, ma, self.hidden, K,
                                     E, *words)
        except BaseException:
            pool.unbegin()
            raise
        if lo < -1 or hi >= E:  # begun but not published: the general path says what is wrong
            pool.unbegin()
            return None
        h = pool.submit_native(drv.moe_job, keep=(x, ob, topk_ids, topk_weights, gpu_mask, self))
        # _finish_out's "written in place" case: the result is ob itself
        return MoEHandle(h, (), (None, ob, True, x, True, kind, kind))

    def submit_gated(self, x: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray,
                     out: np.ndarray, start_flag: int, done_flag: int,
                     gpu_mask=None) -> GatedHandle:
        """Publish the layer on the pool now, to run once the int32 flag at host address
        ``start_flag`` is non-zero; the first thread to finish clears that flag and stores 1 at
        ``done_flag``. This is the decode path of a hybrid layer: a CUDA stream copies the inputs
        into these (pinned) arrays, sets the start flag and waits for "done" with stream memory
        operations, and no Python runs in between (``kt._stream_bridge``).

        x [T, H] float32 or uint16 (bf16 bits), topk_ids [T, K] int64, topk_weights [T, K]
        float32, out [T, H] of x's kind: C-contiguous numpy arrays that stay valid until
        ``wait()`` returns; only their shapes are checked here, their contents are read after the
        flag is set (ids outside [-1, E) are then skipped, and counted in the ``GateResult``).
        gpu_mask as in ``submit``. T must fit one job (``max_gated_tokens``).
        """
        H = self.hidden
        for name, a, dts in (("x", x, (np.float32, np.uint16)), ("topk_ids", topk_ids, (np.int64,)),
                             ("topk_weights", topk_weights, (np.float32,)),
                             ("out", out, (x.dtype,) if isinstance(x, np.ndarray) else ())):
            if not isinstance(a, np.ndarray) or a.ndim != 2 or not a.flags.c_contiguous:
                raise TypeError(f"submit_gated: {name} must be a C-contiguous 2-D numpy array")
            if a.dtype not in dts:
                raise TypeError(f"submit_gated: {name} must be one of {[np.dtype(d).name for d in dts]}, "
                                f"got {a.dtype}")
        T, K = topk_ids.shape
        if x.shape != (T, H) or out.shape != (T, H) or topk_weights.shape != (T, K):
            raise ValueError(f"submit_gated: x and out must be [T, H={H}] and topk_weights [T, K] "
                             f"for topk_ids [T={T}, K={K}]; got x {x.shape}, out {out.shape}, "
                             f"topk_weights {topk_weights.shape}")
        if not 0 < T <= self.max_gated_tokens:
            raise ValueError(f"submit_gated: T={T} must be in [1, {self.max_gated_tokens}]")
        if not (isinstance(start_flag, int) and isinstance(done_flag, int) and start_flag > 0
                and done_flag > 0 and start_flag % 4 == 0 and done_flag % 4 == 0):
            raise ValueError("submit_gated: start_flag and done_flag must be 4-byte aligned host "
                             "addresses")
        mask = self._mask_arg(gpu_mask)
        kind = "bf16" if x.dtype == np.uint16 else "f32"
        pool = self.pool
        words = np.zeros(drv.RESULT_WORDS, np.int64)
        h = self._launch(pool, x, out, topk_ids, topk_weights, mask, 0, T, K, False, kind, kind,
                         gate=(start_flag, done_flag, words))
        return GatedHandle(pool, h, words)

    @property
    def max_gated_tokens(self) -> int:
        """The largest T one ``submit_gated`` job takes."""
        return self.chunk_tokens * MAX_CHUNKS_PER_JOB

    def _mask_arg(self, gpu_mask) -> np.ndarray:
        """gpu_mask ([E] bool, True = skip here, or None) -> the driver's uint8 row (non-zero = skip),
        a view of the caller's mask when it is contiguous (no copy: a decode call's mask costs a
        view, not two new arrays), so it must stay unchanged until the call's wait() returns."""
        E = self.num_experts
        if gpu_mask is None:
            return self._no_gpu
        gm = _torch_cpu("gpu_mask", gpu_mask).numpy() if _is_torch(gpu_mask) else np.asarray(gpu_mask)
        if gm.shape != (E,):
            raise ValueError(f"gpu_mask must be [E={E}] bool, got shape {gm.shape}")
        if gm.dtype != np.bool_:
            raise TypeError(f"gpu_mask must be bool, got {gm.dtype}")
        return (gm if gm.flags.c_contiguous else np.ascontiguousarray(gm)).view(np.uint8)

    def profile(self, x, topk_ids, topk_weights, gpu_mask=None, repeats: int = 1) -> dict:
        """Run the layer ``repeats`` times and report where the time went, per phase.

        Returns {"wall_ms", "threads", "phases": {name: {"busy_ms", "wait_ms", "share"}}}: busy is
        the time participants spent inside the phase's tasks and wait the time they spent at its
        closing barrier, both summed over participants and averaged over repeats; share is the
        phase's part of all busy time. When prefill tasks are whole experts, their activations
        and down GEMM are booked under "act" and "down" (those phases then have no barrier wait of
        their own). A diagnostic (it times with the CPU's time-stamp counter; a profiled T=1 call
        took ~5 % longer than a plain one on 16 threads); the plain call path never does.
        """
        import time

        if not isinstance(repeats, int) or repeats <= 0:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        pool = self.pool
        prof = new_profile(pool.num_threads)
        self._prof = prof
        try:
            t0 = time.perf_counter()
            for _ in range(repeats):
                self(x, topk_ids, topk_weights, gpu_mask=gpu_mask)
            wall = (time.perf_counter() - t0) / repeats
        finally:
            self._prof = None
        hz = tsc_hz()
        tot = profile_cycles(prof).sum(axis=0) / hz / repeats * 1e3
        busy_all = max(float(tot[:, 0].sum()), 1e-12)
        phases = {name: {"busy_ms": float(tot[i, 0]), "wait_ms": float(tot[i, 1]),
                         "share": float(tot[i, 0]) / busy_all}
                  for i, name in enumerate(PHASE_NAMES)}
        return {"wall_ms": wall * 1e3, "threads": pool.num_threads, "phases": phases}

    def _launch(self, pool, xa, ob, ids, tw, mask, j0, j1, K, incremental, xkind, okind, gate=None):
        """Start the job for tokens [j0, j1) on the pool (at most MAX_CHUNKS_PER_JOB chunks);
        returns its pool handle. gate: (start flag, done flag, result words) of a stream-gated job."""
        xs, os_, is_, ws = xa[j0:j1], ob[j0:j1], ids[j0:j1], tw[j0:j1]
        try:
            desc, words = self._call_words(pool, j1 - j0, K, incremental, xkind, okind, gate)
            drv.put_call(desc, xs, os_, is_, ws, mask, *words)
        except BaseException:  # begun, not published: free the pool for other submitters
            pool.unbegin()
            raise
        return pool.submit_native(drv.moe_job, keep=(xs, os_, is_, ws, mask, self,
                                                     None if gate is None else gate[2]))

    def _call_words(self, pool, T, K, incremental, xkind, okind, gate):
        """Begin a job of T tokens on the pool: its descriptor, with this layer's scratch
        template written in, and the call's scalar words (put_call's arguments after the
        arrays)."""
        C = min(self.chunk_tokens, T)
        nch = -(-T // C)
        desc, _ = pool.begin(drv.jctrl_words(nch))
        tmpl = self._scratch_desc(pool, _cap(C * K * self.levels), _cap(C), K, self._act)
        desc[: tmpl.size] = tmpl
        if self._kaddr_ys and C * K * self.levels * self.w2.n_pad * 4 >= self.y_stream_bytes:
            desc[drv.D_KM2] = self._kaddr_ys
        prof = self._prof
        if prof is not None and prof.shape[0] < pool.num_threads:
            raise ValueError("CPUMoE.profile: the pool has more threads than the profile")
        bpt13, bpt2 = self.blocks_per_task
        start, done, words = gate if gate is not None else (0, 0, None)
        tail = self._tail_experts
        return desc, (T, C, nch, int(bool(incremental)), int(xkind == "bf16"), int(okind == "bf16"),
                      self.gemv_max, bpt13, bpt2, self.levels, 0 if prof is None else prof.ctypes.data,
                      start, done, 0 if words is None else words.ctypes.data, int(self.pipelined_decode),
                      pool.num_threads if tail is None else tail, self._tail_parts, self._watch_ticks())

    def _watch_ticks(self) -> int:
        """watchdog_s in time-stamp-counter ticks (0: none), worked out once per setting."""
        w = self._watch
        if w is None:
            w = self._watch = int(self._watchdog_s * tsc_hz()) if self._watchdog_s else 0
        return w


PHASE_NAMES = ("plan", "quantise", "gate_up", "act", "down", "combine")


def new_profile(nthreads: int) -> np.ndarray:
    """A zeroed per-participant phase profile for ``CPUMoE._prof`` (each participant's words on
    their own cache lines: a shared line would be written by every participant at every phase,
    and the profiled call then ran ~20 % slower at T=1 on 16 threads)."""
    return _align.zeros((nthreads, drv.PROF_WORDS), np.int64)


def profile_cycles(prof: np.ndarray) -> np.ndarray:
    """[threads, PHASES, 2] (busy, waiting) time-stamp-counter ticks of a ``new_profile`` array."""
    return prof[:, : drv.PHASES * 2].reshape(prof.shape[0], drv.PHASES, 2)


_TSC_HZ: list[float] = []


def tsc_hz() -> float:
    """The time-stamp counter's rate, measured once against ``time.perf_counter`` over 5 ms
    (perf_counter's resolution makes that good to ~1e-5). Every process's first layer call needs
    it (the watchdog's limit is in ticks), so it is kept short."""
    if not _TSC_HZ:
        import time

        c0, t0 = drv.read_cycles(), time.perf_counter()
        while time.perf_counter() - t0 < 0.005:
            pass
        c1, t1 = drv.read_cycles(), time.perf_counter()
        _TSC_HZ.append((c1 - c0) / (t1 - t0))
    return _TSC_HZ[0]


def _call_rows(xbytes: int, n13: int) -> tuple[int, int]:
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


def _count(name: str, n) -> int:
    """n as a non-negative int (a bool or a float is refused), for the tuning knobs."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"CPUMoE.{name} must be a non-negative int, got {n!r}")
    return int(n)


def _cap(n: int) -> int:
    """Capacity bucket (powers of two, at least 16) so scratch templates are reused."""
    c = 16
    while c < n:
        c *= 2
    return c


def _at(a, tensor, tdt, ndt, shape) -> int:
    """The data address of ``a`` if it is a contiguous CPU torch tensor of dtype ``tdt`` or a
    C-contiguous numpy array of dtype ``ndt``, of this (non-empty) shape; else 0."""
    if type(a) is tensor:
        ok = a.dtype is tdt and a.shape == shape and a.is_cpu and a.is_contiguous()
        return a.data_ptr() if ok else 0
    if type(a) is np.ndarray:
        return a.ctypes.data if a.dtype == ndt and a.shape == shape and a.flags.c_contiguous else 0
    return 0


def _put(d: np.ndarray, slot: int, a: np.ndarray) -> None:
    if not a.flags.c_contiguous:
        raise ValueError("internal: descriptor arrays must be C-contiguous")
    o = slot * drv.SLOT
    d[o] = a.ctypes.data if a.size else 0
    d[o + 1: o + 1 + a.ndim] = a.shape


def _direct_out(out, T, H, okind):
    """The numpy array the driver can write into directly for ``out``, or None."""
    if _is_torch(out):
        if tuple(out.shape) != (T, H):
            raise ValueError(f"out must be [T, H] = {(T, H)}, got {tuple(out.shape)}")
        if out.device.type != "cpu" or not out.is_contiguous():
            return None
        import torch

        if okind == "bf16" and out.dtype == torch.bfloat16:
            return out.view(torch.int16).numpy().view(np.uint16)
        if okind == "f32" and out.dtype == torch.float32:
            return out.numpy()
        return None
    if isinstance(out, np.ndarray):
        if out.shape != (T, H):
            raise ValueError(f"out must be [T, H] = {(T, H)}, got {out.shape}")
        if okind == "f32" and out.dtype == np.float32 and out.flags.c_contiguous and out.flags.writeable:
            return out
        return None
    raise TypeError(f"out must be a torch.Tensor or numpy.ndarray, got {type(out).__name__}")


def _out_init(out, T, H, okind):
    if _is_torch(out):
        import torch

        t = out.detach().cpu()
        if okind == "bf16":
            return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
        return t.float().numpy()
    if okind == "bf16":
        from ..reference import f32_to_bf16_bits

        return f32_to_bf16_bits(np.asarray(out, np.float32))
    return np.asarray(out, np.float32)


def _finish_out(ob, out, direct, x, torch_in, xkind, okind):
    if direct:
        return out
    if torch_in:
        import torch

        if okind == "bf16":
            res = torch.from_numpy(ob.view(np.int16)).view(torch.bfloat16)
        else:
            res = torch.from_numpy(ob).to(x.dtype)
        if not x.is_cpu:
            res = res.to(x.device)
    else:
        res = ob if x.dtype == np.float32 else ob.astype(x.dtype)
    if out is not None:
        if _is_torch(out):
            import torch

            out.copy_(res if _is_torch(res) else torch.from_numpy(np.asarray(res)))
        else:
            out[...] = res
        return out
    return res
