"""Dense linears on the pool: y [M, N] = x [M, D] @ W^T for a packed W [N, D], its 16-row blocks
split over the pool's threads in one native job.

The dense part of a model that runs on the CPU (attention projections, shared experts, dense MLP
layers, the LM head) reads every weight once per decode step, as the experts do; run on the same
pool as the experts, no second thread pool competes with kt's for the cores. The activations are
rounded as the scheme's kernels round them (int8 per token, or bf16), so a ``DenseLinear`` equals
``kt.cpu_ops.linear`` (and ``reference.linear`` of the rounded operands) on any thread count.
"""
from __future__ import annotations

import sys

import numpy as np
from numba import carray, njit, types
from numba.extending import overload

from ..config import QuantScheme
from . import cache as _cache
from . import registry
from .driver.layout import SCHEME_BF16, SCHEME_INT4, SCHEME_INT8, kernel_address
from .kernels.actquant import bf16_bits_to_f32, bf16_row, f32_to_bf16_bits, quant_row_i8
from .packing import PackedWeight, aligned_packed, int4_has_minus8, pack
from .runtime.atomics import atomic_add, atomic_load, atomic_store
from .runtime.job import SLOT, JobLayout, array1, array2, array4, put_array, put_words
from .runtime.native import icall5, icall8, ptr
from .runtime.pool import CpuPool, default_pool
from .runtime.worker import CTRL_STRIDE, JOB_ABORT, JOB_COMPLETE, JOB_FREE
from .tiling import choose

_cache.install()

__all__ = ["DenseLinear", "LINEAR_JOB"]

LINEAR_JOB = JobLayout("linear_job", arrays=("xq", "xs", "data", "scale", "wsum", "out"),
                       words=("kernel", "scheme", "group_size", "blocks", "per_task", "tasks"))
_S, _W = LINEAR_JOB.slot, LINEAR_JOB.word
A_XQ, A_XS, A_DATA, A_SCALE, A_WSUM, A_OUT = (_S(n) for n in LINEAR_JOB.arrays)
W_KERNEL, W_SCHEME, W_GS, W_BLOCKS, W_PER, W_TASKS = (_W(n) for n in LINEAR_JOB.words)
_CLAIM, _DONE = JOB_FREE, JOB_FREE + CTRL_STRIDE  # task counters, one line each
_JCTRL_WORDS = JOB_FREE + 2 * CTRL_STRIDE


def _as_f32(v):
    """A value of x as fp32 (uint16: bf16 bits)."""


@overload(_as_f32, inline="always")
def _as_f32_impl(v):
    if v == types.uint16:
        return lambda v: bf16_bits_to_f32(v)
    return lambda v: np.float32(v)


def _from_f32(v, like):
    """fp32 v in the kind of ``like`` (uint16: bf16 bits, rounded to nearest even)."""


@overload(_from_f32, inline="always")
def _from_f32_impl(v, like):
    if like == types.uint16:
        return lambda v, like: f32_to_bf16_bits(v)
    return lambda v, like: np.float32(v)


_SCHEME_CODE = {QuantScheme.INT8: SCHEME_INT8, QuantScheme.INT4: SCHEME_INT4,
                QuantScheme.BF16: SCHEME_BF16}


@njit(nogil=True, cache=True)
def linear_job(nth, jctrl, desc):
    """Every participant claims tasks (``per_task`` blocks each) until none is left; the one
    that finishes the last task completes the job."""
    addr, scheme = desc[W_KERNEL], desc[W_SCHEME]
    nb, per, tasks = desc[W_BLOCKS], desc[W_PER], desc[W_TASKS]
    out = array2(desc, A_OUT, np.float32)
    done = 0
    while atomic_load(jctrl, JOB_ABORT) == 0:
        t = atomic_add(jctrl, _CLAIM, 1)
        if t >= tasks:
            break
        nb0 = t * per
        nb1 = min(nb, nb0 + per)
        if scheme == SCHEME_INT8:
            icall8(addr, array2(desc, A_XQ, np.int8), array1(desc, A_XS, np.float32),
                   array4(desc, A_DATA, np.int8), array1(desc, A_SCALE, np.float32),
                   array1(desc, A_WSUM, np.int32), out, nb0, nb1)
        elif scheme == SCHEME_INT4:
            o = A_SCALE * SLOT
            scale = carray(ptr(desc[o], np.float32), (desc[o + 1], desc[o + 2], desc[o + 3]))
            icall8(addr, array2(desc, A_XQ, np.int8), array1(desc, A_XS, np.float32),
                   array4(desc, A_DATA, np.uint8), scale, desc[W_GS], out, nb0, nb1)
        else:
            icall5(addr, array2(desc, A_XQ, np.uint16), array4(desc, A_DATA, np.uint16), out,
                   nb0, nb1)
        done += 1
    if done and atomic_add(jctrl, _DONE, done) + done == tasks:
        atomic_store(jctrl, JOB_COMPLETE, 1)


@njit(cache=True)
def _put(desc, template, xq, xs, out, per, tasks, first):
    desc[:template.size] = template
    put_array(desc, A_XQ, xq)
    put_array(desc, A_XS, xs)
    put_array(desc, A_OUT, out)
    put_words(desc, first, (per, tasks))


_PER_RUN = LINEAR_JOB.run(("per_task", "tasks"))


@njit(nogil=True, cache=True)
def _prepare_int8(x, xq, xs, row):
    """int8 activation rows xq [M, d_pad] (zero beyond D) and per-token scales xs [M] of x
    [M, D] (fp32, or uint16 bf16 bits), as ``actquant.quantize_rows``. row: fp32 scratch [D]."""
    d = x.shape[1]
    for m in range(x.shape[0]):
        for j in range(d):
            row[j] = _as_f32(x[m, j])
        xs[m] = quant_row_i8(row, xq[m], d)


@njit(nogil=True, cache=True)
def _prepare_bf16(x, xq, row):
    """bf16 activation rows xq uint16 [M, d_pad] (zero beyond D) of x, as ``actquant.bf16_rows``."""
    d = x.shape[1]
    for m in range(x.shape[0]):
        for j in range(d):
            row[j] = _as_f32(x[m, j])
        bf16_row(row, xq[m], d)


@njit(nogil=True, cache=True)
def _store(out, y):
    """y [M, N] <- out[:, :N] (fp32 [M, n_pad]): copied, or rounded to bf16 bits for uint16 y."""
    for m in range(y.shape[0]):
        for j in range(y.shape[1]):
            y[m, j] = _from_f32(out[m, j], y[m, j])


class DenseLinear:
    """A linear layer's weight, packed for kt's CPU kernels, run on a ``CpuPool``.

    ``y = lin(x)``: x [M, D] (torch tensor of any float dtype, or numpy) -> y [M, N] in x's
    dtype (numpy: fp32). Bias, if any, is the caller's (add it to y). ``pool``: the pool the
    job runs on (default ``default_pool()``, the one the model's experts use by default).
    """

    def __init__(self, packed: PackedWeight, *, pool: CpuPool | None = None, variant: str | None = None):
        if not isinstance(packed, PackedWeight) or packed.data.ndim != 4:
            raise TypeError("DenseLinear needs a single packed matrix (kt.cpu_ops.pack)")
        if pool is not None and not isinstance(pool, CpuPool):
            raise TypeError(f"pool must be a CpuPool, got {type(pool).__name__}")
        self.w = aligned_packed(packed)
        self.scheme = packed.scheme
        self.n, self.d = packed.n, packed.d
        self._pool = pool
        self.kernels = registry.kernel_set(self.scheme, variant)
        minus8 = self.kernels.gemm_exact is not None and int4_has_minus8(self.w)
        code = _SCHEME_CODE[self.scheme]
        self._kaddr = {op: kernel_address(self.kernels.linear_kernel(op, minus8), code)
                       for op in ("gemv", "gemm")}
        d = LINEAR_JOB.descriptor()
        d.put_array("data", self.w.data)
        d.put_array("scale", self.w.scale)  # INT4: [NB, groups, 16]
        d.put_array("wsum", self.w.wsum)
        d["scheme"] = code
        d["group_size"] = self.w.group_size
        d["blocks"] = self.w.num_blocks
        self._tmpl = {op: self._with_kernel(d, op) for op in ("gemv", "gemm")}
        self._plans: dict[tuple[int, int], tuple] = {}  # (M, threads) -> (template, per, tasks)
        self._default: CpuPool | None = None

    def _with_kernel(self, d, op):
        c = d.copy()
        c["kernel"] = self._kaddr[op]
        return c.words

    @classmethod
    def from_tensor(cls, w, scheme: QuantScheme | str = "int8", group_size: int = 64, **kw) -> "DenseLinear":
        """Quantise and pack w [N, D] (torch or numpy, any float dtype)."""
        return cls(pack(w, scheme, group_size), **kw)

    @property
    def pool(self) -> CpuPool:
        p = self._pool
        if p is None:
            p = self._default
            if p is None or p.closed:
                p = self._default = default_pool()
            return p
        if p.closed:
            raise RuntimeError("DenseLinear: its CpuPool was shut down")
        return p

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def __call__(self, x):
        """y [M, N] = x [M, D] @ W^T in x's dtype (a torch tensor for a tensor, fp32 numpy for
        an array)."""
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(x, torch.Tensor):
            dtype = x.dtype
            if not dtype.is_floating_point:
                raise TypeError(f"x must be a floating-point tensor, got {dtype}")
            self._check_shape(x.shape)
            if dtype is torch.bfloat16 and x.is_cpu and x.is_contiguous():
                a = x.view(torch.int16).numpy().view(np.uint16)  # bf16 bits, read as they are
            else:
                a = x.detach().to("cpu", torch.float32).contiguous().numpy()
            if dtype is torch.bfloat16:
                y = torch.empty((x.shape[0], self.n), dtype=dtype)
                self._run(a, y.view(torch.int16).numpy().view(np.uint16))
                return y
            y = torch.empty((x.shape[0], self.n), dtype=torch.float32)
            self._run(a, y.numpy())
            return y if dtype is torch.float32 else y.to(dtype)
        a = np.ascontiguousarray(x, dtype=np.float32)
        self._check_shape(a.shape)
        y = np.empty((a.shape[0], self.n), np.float32)
        self._run(a, y)
        return y

    def _check_shape(self, shape) -> None:
        if len(shape) != 2 or shape[1] != self.d:
            raise ValueError(f"x must be [M, D={self.d}], got shape {tuple(shape)}")

    def _run(self, x: np.ndarray, y: np.ndarray) -> None:
        """y [M, N] (fp32, or uint16 bf16 bits) <- x [M, D] (fp32, or uint16 bf16 bits) @ W^T."""
        m = x.shape[0]
        if m == 0:
            return
        w = self.w
        pool = self.pool
        plan = self._plans.get((m, pool.num_threads))
        if plan is None:
            tile = choose(m, self.n, self.d, self.kernels, threads=pool.num_threads)
            plan = (self._tmpl[tile.op], tile.n_blocks_per_task,
                    -(-w.num_blocks // tile.n_blocks_per_task))
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[(m, pool.num_threads)] = plan
        tmpl, per, tasks = plan
        desc, _ = pool.begin(_JCTRL_WORDS)
        try:  # the pool's scratch is this job's once begin() returned (one job at a time)
            out = pool.scratch("dense.out", m * w.n_pad, np.float32).reshape(m, w.n_pad)
            bf16 = self.scheme is QuantScheme.BF16
            xq = pool.scratch("dense.xq", m * w.d_pad, np.uint16 if bf16 else np.int8).reshape(m, w.d_pad)
            xs = pool.scratch("dense.xs", m, np.float32)
            row = pool.scratch("dense.row", w.d_pad, np.float32)
            if bf16:
                _prepare_bf16(x, xq, row)
            else:
                _prepare_int8(x, xq, xs, row)
            _put(desc, tmpl, xq, xs, out, per, tasks, _PER_RUN)
        except BaseException:
            pool.unbegin()
            raise
        pool.submit_native(linear_job, keep=(xq, xs, out, self)).wait()
        _store(out, y)

    def __repr__(self):
        return f"DenseLinear(N={self.n}, D={self.d}, scheme={self.scheme.value})"
