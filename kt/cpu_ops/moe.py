"""CPUMoE: the experts of one MoE layer computed on the CPU (check, allocate, launch).

Legend: T tokens, E experts, K top-k, H hidden size, I expert intermediate size, G group size.

    moe = kt.CPUMoE.from_tensors(gate, up, down, scheme="int8")   # gate/up [E, I, H], down [E, H, I]
    out = moe(x, topk_ids, topk_weights)                           # x [T, H] -> [T, H], x's dtype
    h = moe.submit(x, topk_ids, topk_weights); ...; out = h.wait()

The arithmetic lives in ``driver`` (written once for every ISA) and the GEMM micro-kernels of the
``registry.KernelSet`` of this host; the work runs on a ``CpuPool`` (the default pool unless one
is given). Scratch buffers belong to the pool and are shared by every layer on it. Tuning knobs:
``tuning.MoETuning``, at construction and per call.
"""
from __future__ import annotations

import sys
import warnings
from functools import partial

import numpy as np

from ..config import QuantScheme, check_activations
from . import _moe_desc, registry
from ._moe_handles import GatedHandle, GateResult, MoEHandle
from ._moe_io import (_as_stack, _at, _check_group_size, _direct_out, _f32, _is_torch, _out_init,
                      _pack_stack, _routing, _to_numpy_2d, _torch_cpu)
from .driver import layout as L
from .driver.job import moe_job
from .driver.profile import new_profile, profile_cycles
from .packing import PackedWeight, aligned_packed, int4_has_minus8, int4_ratio_table
from .runtime.atomics import tsc_hz
from .runtime.pool import CpuPool, default_pool
from .tuning import MoETuning

__all__ = ["CPUMoE", "MoEHandle", "GatedHandle", "GateResult", "MoETuning"]

_SCHEME_CODE = {QuantScheme.INT8: L.SCHEME_INT8, QuantScheme.INT4: L.SCHEME_INT4,
                QuantScheme.BF16: L.SCHEME_BF16}
MAX_CHUNKS_PER_JOB = 24


class CPUMoE:
    """The CPU experts of one MoE layer.

    w13: stacked PackedWeight [E, 2I, H] (gate rows [0, I), up rows [up_offset, up_offset + I)).
    w2: stacked PackedWeight [E, H, I].
    pool: the CpuPool to run on (default: ``default_pool()``, looked up at each call).
    max_tokens: optional upper bound on T per call (a larger T is a ValueError).
    kernels: optional (gemv, gemm) pair of jitted kernels of the README contract (tests);
        default: the registry's kernel set for this host (or ``variant``).
    activations: how the integer schemes quantise activations: "int8" (per token, the default)
        or "int8x2" (two int8 levels per token, ``reference.quantize_act2``: the same int8
        kernels run on twice the rows, so about 2x the prefill compute and the same decode
        weight traffic; the layer error is then the weight error alone: INT8 0.014 instead of
        0.025 relative on Gaussian weights). BF16 takes bf16 activations either way.
    tuning: the layer's ``MoETuning`` (default ``MoETuning()``); each call may pass another.
    """

    def __init__(self, w13: PackedWeight, w2: PackedWeight, *, up_offset: int | None = None,
                 pool: CpuPool | None = None, max_tokens: int | None = None, kernels=None,
                 variant: str | None = None, activations: str = "int8",
                 tuning: MoETuning | None = None):
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
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
        if tuning is not None and not isinstance(tuning, MoETuning):
            raise TypeError(f"tuning must be a MoETuning, got {type(tuning).__name__}")
        if pool is not None and not isinstance(pool, CpuPool):
            raise TypeError(f"pool must be a CpuPool, got {type(pool).__name__}")
        self.scheme = w13.scheme
        self.activations = activations
        # kernels read 64-byte rows: weights from elsewhere are copied once if they straddle lines
        self.w13, self.w2 = aligned_packed(w13), aligned_packed(w2)
        self.num_experts, self.hidden, self.intermediate = E, H, I
        self.up_offset = int(up_offset)
        self.group_size = w13.group_size
        self.max_tokens = max_tokens
        self._pool = pool
        self._tuning = tuning or MoETuning()
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
        self._scheme_code = code = _SCHEME_CODE[self.scheme]
        self._kaddr = (L.kernel_address(forms.decode, code), L.kernel_address(forms.prefill, code))
        # the down GEMM of chunks whose outputs (y) take at least tuning.y_stream_bytes: the form
        # with non-temporal stores, where the set has one. Such a y (qwen3 T=2048: 134 MB) leaves
        # the caches before the combine reads it, so reading each line before writing it is
        # wasted traffic. Device, 16 threads, interleaved (benchmarks/profile_moe.py): INT8
        # T=2048 14.38 vs 15.64 ms, INT4 18.44 vs 18.85; at T=512 (34 MB) level or slower on the
        # device, hence the default threshold of 64 MiB.
        self._kaddr_ys = (L.kernel_address(forms.prefill_stream, code)
                          if forms.prefill_stream is not None else 0)
        self._no_gpu = np.zeros(E, np.uint8)
        self._no_gpu_at = self._no_gpu.ctypes.data
        self._act = np.uint16 if self.scheme is QuantScheme.BF16 else np.int8  # activation rows
        self._words: dict[MoETuning, tuple] = {}  # tuning -> its call words (_tuning_words)
        self._wdesc = _moe_desc.weight_template(self)
        self._tmpl: dict = {}

    # -- constructors

    @classmethod
    def from_tensors(cls, gate, up, down, scheme: QuantScheme | str = "int8", group_size: int = 64,
                     pool: CpuPool | None = None, **kw) -> "CPUMoE":
        """Quantise and pack gate/up [E, I, H] and down [E, H, I] (torch or numpy; bf16/fp16/fp32);
        ``kw`` goes to the constructor."""
        scheme = QuantScheme.parse(scheme)
        group_size = _check_group_size(group_size, scheme)
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
    def tuning(self) -> MoETuning:
        """The layer's ``MoETuning`` (fixed at construction; a call may pass another)."""
        return self._tuning

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
    def max_gated_tokens(self) -> int:
        """The largest T one job (a ``submit_gated`` call) takes under the layer's tuning."""
        return self.tuning.chunk_tokens * MAX_CHUNKS_PER_JOB

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
        per-row weight sums where a kernel of the set reads them. The bytes a bandwidth floor
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
        form, made once here instead of at every call by the prefill kernel), or None if the
        scales are not of the quantiser's form (then the contract kernels run, on the scales).
        The kernel set's table forms read them (AVX-512 and AMX hosts decode on them, AMX hosts
        prefill on them too). A block of 16 rows and a group of 64 k hold 512 bytes of values and
        64 of scales; the table adds 16 bytes of ratios (2.8 % more memory), and the kernels read
        those instead of the scales (8 % fewer bytes)."""
        tabs = (int4_ratio_table(self.w13.scale), int4_ratio_table(self.w2.scale))
        return None if tabs[0] is None or tabs[1] is None else tabs

    # -- calls

    def __call__(self, x, topk_ids, topk_weights, gpu_mask=None, out=None, incremental=False,
                 tuning: MoETuning | None = None):
        """out [T, H] (x's dtype, torch in -> torch out) = sum over CPU experts; see submit."""
        return self.submit(x, topk_ids, topk_weights, gpu_mask=gpu_mask, out=out,
                           incremental=incremental, tuning=tuning).wait()

    forward = __call__

    def submit(self, x, topk_ids, topk_weights, gpu_mask=None, out=None, incremental=False,
               tuning: MoETuning | None = None) -> MoEHandle:
        """Start the layer on the pool; ``.wait()`` on the handle returns the output.

        x: [T, H] bf16/fp16/fp32 (torch or numpy). topk_ids: [T, K] int (-1 = skip this slot).
        topk_weights: [T, K] float. gpu_mask: [E] bool, True = the expert is computed elsewhere
        (skipped here). out: optional [T, H] output to write (or, with ``incremental``, to add
        into). tuning: this call's ``MoETuning`` (default: the layer's). Inputs (gpu_mask too)
        must stay unchanged until ``wait()`` returns.
        """
        return self._submit(x, topk_ids, topk_weights, gpu_mask, out, incremental, tuning, None)

    def _submit(self, x, topk_ids, topk_weights, gpu_mask, out, incremental, tuning, prof):
        if out is None and incremental is False:
            h = self._submit_tensors(x, topk_ids, topk_weights, gpu_mask, tuning, prof)
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
        tun, _ = self._tuning_words(tuning)

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
        step = tun.chunk_tokens * MAX_CHUNKS_PER_JOB
        # jobs of at most `step` tokens: the first starts now, the others from wait()
        rest = tuple(partial(self._launch, pool, xa, ob, ids, tw, mask, j0, min(T, j0 + step), K,
                             incremental, xkind, okind, None, tuning, prof)
                     for j0 in range(step, T, step))
        first = self._launch(pool, xa, ob, ids, tw, mask, 0, min(T, step), K, incremental, xkind,
                             okind, None, tuning, prof)
        return MoEHandle(first, rest, finish)

    def _submit_tensors(self, x, topk_ids, topk_weights, gpu_mask, tuning, prof):
        """``submit`` for what a model passes in decode, with less Python than the general
        path (a masked T=1 call on the dev machine 27 vs 42 us, interleaved; on the H200 host
        2-9 us less per T=1 call): x a CPU torch tensor, bf16 or fp32 [T, H] with T within one
        job; ids int64 (or int32 tensors) and weights fp32 (or bf16 tensors) [T, K]; gpu_mask
        None or bool [E]; all contiguous, on the CPU, torch or numpy. The driver gets their
        addresses (no numpy views) and writes a new tensor of x's dtype. None when an argument
        is off this path: the general path then converts it, or says what is wrong."""
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
        tun = self.tuning if tuning is None else tuning
        if not (isinstance(tun, MoETuning) and 0 < T <= tun.chunk_tokens * MAX_CHUNKS_PER_JOB
                and T <= (self.max_tokens or T) and K > 0):
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
            desc, words = self._call_words(pool, T, K, False, kind, kind, None, tuning, prof)
            lo, hi = L.put_call_at(desc, x.data_ptr(), ob.data_ptr(), ia, wa, ma, self.hidden, K,
                                   E, words)
        except BaseException:
            pool.unbegin()
            raise
        if lo < -1 or hi >= E:  # begun but not published: the general path says what is wrong
            pool.unbegin()
            return None
        h = pool.submit_native(moe_job, keep=(x, ob, topk_ids, topk_weights, gpu_mask, self, prof))
        # _finish_out's "written in place" case: the result is ob itself
        return MoEHandle(h, (), (None, ob, True, x, True, kind, kind))

    def submit_gated(self, x: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray,
                     out: np.ndarray, start_flag: int, done_flag: int,
                     gpu_mask=None, tuning: MoETuning | None = None) -> GatedHandle:
        """Publish the layer on the pool now, to run once the int32 flag at host address
        ``start_flag`` is non-zero; the first thread to finish clears that flag and stores 1 at
        ``done_flag``. This is the decode path of a hybrid layer: a CUDA stream copies the inputs
        into these (pinned) arrays, sets the start flag and waits for "done" with stream memory
        operations, and no Python runs in between (``kt.layer._stream_bridge``).

        x [T, H] float32 or uint16 (bf16 bits), topk_ids [T, K] int64, topk_weights [T, K]
        float32, out [T, H] of x's kind: C-contiguous numpy arrays that stay valid until
        ``wait()`` returns; only their shapes are checked here, their contents are read after the
        flag is set (ids outside [-1, E) are then skipped, and counted in the ``GateResult``).
        gpu_mask and tuning as in ``submit``. T must fit one job (``max_gated_tokens``).
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
        tun, _ = self._tuning_words(tuning)
        most = tun.chunk_tokens * MAX_CHUNKS_PER_JOB
        if not 0 < T <= most:
            raise ValueError(f"submit_gated: T={T} must be in [1, {most}]")
        if not (isinstance(start_flag, int) and isinstance(done_flag, int) and start_flag > 0
                and done_flag > 0 and start_flag % 4 == 0 and done_flag % 4 == 0):
            raise ValueError("submit_gated: start_flag and done_flag must be 4-byte aligned host "
                             "addresses")
        mask = self._mask_arg(gpu_mask)
        kind = "bf16" if x.dtype == np.uint16 else "f32"
        pool = self.pool
        words = np.zeros(L.RESULT_WORDS, np.int64)
        h = self._launch(pool, x, out, topk_ids, topk_weights, mask, 0, T, K, False, kind, kind,
                         (start_flag, done_flag, words), tuning, None)
        return GatedHandle(pool, h, words)

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

    def profile(self, x, topk_ids, topk_weights, gpu_mask=None, repeats: int = 1,
                tuning: MoETuning | None = None) -> dict:
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
        t0 = time.perf_counter()
        for _ in range(repeats):
            self._submit(x, topk_ids, topk_weights, gpu_mask, None, False, tuning, prof).wait()
        wall = (time.perf_counter() - t0) / repeats
        tot = profile_cycles(prof).sum(axis=0) / tsc_hz() / repeats * 1e3
        busy_all = max(float(tot[:, 0].sum()), 1e-12)
        phases = {name: {"busy_ms": float(tot[i, 0]), "wait_ms": float(tot[i, 1]),
                         "share": float(tot[i, 0]) / busy_all}
                  for i, name in enumerate(L.PHASE_NAMES)}
        return {"wall_ms": wall * 1e3, "threads": pool.num_threads, "phases": phases}

    def _launch(self, pool, xa, ob, ids, tw, mask, j0, j1, K, incremental, xkind, okind, gate,
                tuning, prof):
        """Start the job for tokens [j0, j1) on the pool (at most MAX_CHUNKS_PER_JOB chunks);
        returns its pool handle. gate: (start flag, done flag, result words) of a stream-gated
        job, or None."""
        xs, os_, is_, ws = xa[j0:j1], ob[j0:j1], ids[j0:j1], tw[j0:j1]
        try:
            desc, words = self._call_words(pool, j1 - j0, K, incremental, xkind, okind, gate,
                                           tuning, prof)
            L.put_call(desc, xs, os_, is_, ws, mask, words)
        except BaseException:  # begun, not published: free the pool for other submitters
            pool.unbegin()
            raise
        return pool.submit_native(moe_job, keep=(xs, os_, is_, ws, mask, self, prof,
                                                None if gate is None else gate[2]))

    def _tuning_words(self, tuning):
        """(the call's MoETuning, its words of the TUNING run of driver.layout), worked out once
        per tuning (the watchdog's ticks need the time-stamp counter's rate)."""
        if tuning is None:
            tun, w = self._tuning, self._words.get(None)
        elif isinstance(tuning, MoETuning):
            tun, w = tuning, self._words.get(tuning)
        else:
            raise TypeError(f"tuning must be a MoETuning, got {type(tuning).__name__}")
        if w is None:
            bpt13, bpt2 = tun.blocks_per_task
            w = (self.kernels.gemv_max if tun.gemv_max is None else tun.gemv_max, bpt13, bpt2,
                 int(tun.pipelined_decode), tun.tail_parts,
                 int(tun.watchdog_s * tsc_hz()) if tun.watchdog_s else 0)
            if len(self._words) > 16:
                self._words.clear()
            self._words[None if tuning is None else tun] = w
        return tun, w

    def _call_words(self, pool, T, K, incremental, xkind, okind, gate, tuning, prof):
        """Begin a job of T tokens on the pool: its descriptor, with this layer's scratch
        template written in, and the call's words (PER_CALL + TUNING of driver.layout)."""
        tun, tw = self._tuning_words(tuning)
        C = min(tun.chunk_tokens, T)
        nch = -(-T // C)
        desc, _ = pool.begin(L.jctrl_words(nch))
        rows = C * K * self.levels
        tmpl = _moe_desc.scratch_template(self, pool, _moe_desc.capacity(rows),
                                          _moe_desc.capacity(C), K, self._act)
        desc[: tmpl.size] = tmpl
        km2 = (self._kaddr_ys if self._kaddr_ys and rows * self.w2.n_pad * 4 >= tun.y_stream_bytes
               else self._kaddr[1])
        if prof is not None and prof.shape[0] < pool.num_threads:
            raise ValueError("CPUMoE.profile: the pool has more threads than the profile")
        start, done, res = gate if gate is not None else (0, 0, None)
        tail = pool.num_threads if tun.tail_experts is None else tun.tail_experts
        return desc, (T, C, nch, int(bool(incremental)), int(xkind == "bf16"), int(okind == "bf16"),
                      km2, self.levels, tail, 0 if prof is None else prof.ctypes.data, start, done,
                      0 if res is None else res.ctypes.data) + tw
