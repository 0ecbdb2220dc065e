"""Atomics, flags, spin waits and the time-stamp counter for nogil jitted code (any x86-64).

Every cross-thread word of the runtime is an int64 in a numpy array, read and written through
these (acquire loads, release stores, sequentially consistent fetch-and-add); flags that another
agent writes (a CUDA stream's memory operation) are int32 at a raw host address. ``*_gil``
variants are the same operations compiled for callers that hold the GIL (the pool's Python side).
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import cache as _cache

_cache.install()

__all__ = ["atomic_load", "atomic_store", "atomic_add", "flag_load", "flag_store", "cpu_pause",
           "spin_relax", "cycles", "read_cycles", "tsc_hz"]


def _elem_ptr(context, builder, aryty, ary_val, idx_val, idxty):
    ary = context.make_array(aryty)(context, builder, ary_val)
    idx = context.cast(builder, idx_val, idxty, types.intp)
    return cgutils.get_item_pointer(context, builder, aryty, ary, [idx], wraparound=False)


@intrinsic
def atomic_load(typingctx, arr, idx):
    """arr[idx] with acquire ordering (arr: 1-D int64 array)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(arr, idx), codegen


@intrinsic
def atomic_store(typingctx, arr, idx, val):
    """arr[idx] = val with release ordering."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(v, ptr, "release", 8)
        return context.get_dummy_value()

    return types.void(arr, idx, val), codegen


@intrinsic
def atomic_add(typingctx, arr, idx, val):
    """Sequentially consistent fetch-and-add; returns the old value."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, v, "seq_cst")

    return types.int64(arr, idx, val), codegen


@intrinsic
def flag_load(typingctx, addr):
    """The int32 at host address ``addr`` (an int), acquire load, as int64: a flag that another
    agent (a CUDA stream's memory operation, another thread) writes."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        return builder.sext(builder.load_atomic(ptr, "acquire", 4), ir.IntType(64))

    return types.int64(addr), codegen


@intrinsic
def flag_store(typingctx, addr, val):
    """Release store of the int32 ``val`` at host address ``addr``: earlier writes of this thread
    are visible to whoever sees the new flag value."""
    if not isinstance(addr, types.Integer) or not isinstance(val, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        v = builder.trunc(context.cast(builder, args[1], sig.args[1], types.int64), ir.IntType(32))
        builder.store_atomic(v, ptr, "release", 4)
        return context.get_dummy_value()

    return types.void(addr, val), codegen


@intrinsic
def cpu_pause(typingctx):
    """The x86 ``pause`` hint for spin loops."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                            "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _sched_yield(typingctx):
    """libc ``sched_yield()``, declared by name (resolved in-process; keeps callers cacheable)."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []),
                                            "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(nogil=True, cache=True, inline="always")
def spin_relax(i, every):
    """One step of a spin-wait: ``pause``, and every ``every`` steps (a power of two) a
    ``sched_yield`` so a waiter never starves another runnable thread of its core."""
    cpu_pause()
    if (i & (every - 1)) == every - 1:
        _sched_yield()


# Locked (GIL-held) variants: used where Python-level ordering with the GIL matters.
@njit(cache=True)
def _load_gil(ctrl, idx):
    return atomic_load(ctrl, idx)


@njit(cache=True)
def _store_gil(ctrl, idx, val):
    atomic_store(ctrl, idx, val)


@njit(cache=True)
def _add_gil(ctrl, idx, val):
    return atomic_add(ctrl, idx, val)


# ----------------------------------------------------------------------------- time-stamp counter

@intrinsic
def cycles(typingctx):
    """The CPU's time-stamp counter (``llvm.readcyclecounter``: rdtsc on x86), for profiles."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@njit(cache=True)
def read_cycles():
    return cycles()


_TSC_HZ: list[float] = []


def tsc_hz() -> float:
    """The time-stamp counter's rate, measured once against ``time.perf_counter`` over 5 ms
    (perf_counter's resolution makes that good to ~1e-5). Every process's first layer call needs
    it (the watchdog's limit is in ticks), so it is kept short."""
    if not _TSC_HZ:
        import time

        c0, t0 = read_cycles(), time.perf_counter()
        while time.perf_counter() - t0 < 0.005:
            pass
        c1, t1 = read_cycles(), time.perf_counter()
        _TSC_HZ.append((c1 - c0) / (t1 - t0))
    return _TSC_HZ[0]
