"""CpuPool: persistent CPU worker threads that run one job at a time, with a fast hand-off.

Jobs are *joinable*: every participant (a background worker, or the calling thread inside
``wait()``) enters the same job and takes work from it until none is left, so a job never waits
for a particular thread. A native job is a jitted ``job(nthreads, jctrl, desc)`` (``desc``: an int64
descriptor the submitter wrote, ``jctrl``: zeroed per-job control words); it claims its own
participant id from ``jctrl[JOB_JOIN]`` and sets ``jctrl[JOB_COMPLETE]`` when its last task is done.
Background workers run native jobs from a nogil jitted loop, so no GIL is taken between jobs: idle
workers spin for ``spin_us`` on an atomic sequence number (``load atomic acquire`` + ``pause``) and
only then block on a ``threading.Condition``. A Python job ``fn(tid)`` runs once per tid in
[0, num_threads) on whichever participants claim the tids (tests, tools).

By default the caller joins its own jobs (``caller_joins=True``): a pool of ``num_threads`` owns
``num_threads - 1`` background threads, and the thread calling ``wait()`` is the last participant.
That keeps an n-core machine at n spinning threads. With ``caller_joins=False`` all
``num_threads`` are background threads (``submit`` then computes fully in the background).

The pool is an object the caller owns; ``default_pool()`` makes one lazily. Threads are grouped
per NUMA node (``/sys/devices/system/node``), and can be pinned to their node's CPUs. Pinning is
off unless the pool owns every CPU of the process affinity set (pinning onto cores that something
else uses hurts), or ``pin=True``.

An exception raised by a participant is re-raised by ``handle.wait()`` (after every participant
left the job); it sets ``jctrl[JOB_ABORT]`` so that the others stop early. The pool stays usable.
A native job that gives up a wait (its own watchdog) sets ``jctrl[JOB_WATCHDOG]`` and aborts:
``wait()`` then raises a TimeoutError-caused RuntimeError instead of hanging.
``shutdown()`` (also run at interpreter exit, and when the pool is garbage-collected) joins cleanly.

Threads may share a pool (a hybrid layer's stream service publishes and joins its jobs while the
caller's thread runs other layers on it): ``begin()`` makes its thread the one submitter until the
job is published, and a waiting caller joins a job only while it is open, counted as the workers
are, so a late joiner never enters the next job's descriptor while it is being written.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from llvmlite import ir

from .._sysinfo import numa_topology

from . import _align
from . import cache as _cache

_cache.install()

__all__ = ["CpuPool", "PoolHandle", "default_pool", "numa_nodes", "atomic_load", "atomic_store",
           "atomic_add", "cpu_pause", "spin_relax", "flag_load", "flag_store", "CTRL_STRIDE", "JOB_ABORT",
           "JOB_COMPLETE", "JOB_FREE", "JOB_WATCHDOG"]

# One control word per 128 bytes so that counters written by different threads never share a line.
CTRL_STRIDE = 16


# ----------------------------------------------------------------------------- jitted atomics

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


@njit(nogil=True, cache=True)
def spin_until_changed(ctrl, idx, old, max_spins):
    """Spin (pause) until ctrl[idx] != old or max_spins pauses have passed; returns ctrl[idx]."""
    for i in range(max_spins):
        v = atomic_load(ctrl, idx)
        if v != old:
            return v
        spin_relax(i, 1024)
    return atomic_load(ctrl, idx)


@njit(nogil=True, cache=True)
def spin_until_at_least(ctrl, idx, target, max_spins):
    """Spin until ctrl[idx] >= target or max_spins pauses passed; returns ctrl[idx]."""
    for i in range(max_spins):
        v = atomic_load(ctrl, idx)
        if v >= target:
            return v
        spin_relax(i, 1024)
    return atomic_load(ctrl, idx)


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


@njit(nogil=True, cache=True, inline="always")
def _enter(ctrl, seq):
    """Count this participant in _ACTIVE if the job ``seq`` is still open (it then leaves with
    ``_ACTIVE -= 1``); returns whether it entered. How every participant joins a job: the
    submitter closes the job (``begin()``) and then waits for _ACTIVE to reach 0."""
    atomic_add(ctrl, _ACTIVE, 1)
    if atomic_load(ctrl, _SEQ) != seq:
        atomic_add(ctrl, _ACTIVE, -1)
        return False
    return True


@njit(cache=True)
def _enter_gil(ctrl, seq):
    return _enter(ctrl, seq)




@njit(nogil=True, cache=True)
def _spin_for_job(ctrl, last, max_spins):
    """Spin until SEQ holds a published job other than ``last`` (SEQ > 0) or STOP is set."""
    for i in range(max_spins):
        v = atomic_load(ctrl, _SEQ)
        if (v > 0 and v != last) or atomic_load(ctrl, _STOP) != 0:
            return v
        spin_relax(i, 1024)
    return last


@njit(nogil=True, cache=True)
def _spin_done(jctrl, max_spins):
    """Spin until the job is complete or aborted; returns True if it is."""
    for i in range(max_spins):
        if atomic_load(jctrl, JOB_COMPLETE) != 0 or atomic_load(jctrl, JOB_ABORT) != 0:
            return True
        spin_relax(i, 256)
    return atomic_load(jctrl, JOB_COMPLETE) != 0 or atomic_load(jctrl, JOB_ABORT) != 0


@njit(nogil=True, cache=True)
def _spin_idle(ctrl, max_spins):
    """Spin until no participant is inside a job; returns True if so."""
    for i in range(max_spins):
        if atomic_load(ctrl, _ACTIVE) == 0:
            return True
        spin_relax(i, 256)
    return atomic_load(ctrl, _ACTIVE) == 0


# ----------------------------------------------------------------------------- job control

# per-job control words (jctrl); a job's own words start at JOB_FREE
JOB_ABORT = 0
JOB_COMPLETE = CTRL_STRIDE
JOB_JOIN = 2 * CTRL_STRIDE
_JOB_PYDONE = 3 * CTRL_STRIDE
JOB_WATCHDOG = 4 * CTRL_STRIDE  # set by a native job that gave up a wait and aborted itself
JOB_FREE = 5 * CTRL_STRIDE
JCTRL_SIZE = 8192  # int64 words

# pool control words (ctrl)
_SEQ = 0
_STOP = CTRL_STRIDE
_KIND = 2 * CTRL_STRIDE
_ACTIVE = 3 * CTRL_STRIDE

# return codes of a native worker loop
_TIMEOUT, _STOPPED, _OTHER_KIND = 0, 1, 2

DESC_SIZE = 1024  # int64 words of the job descriptor a native job reads


def icall_codegen(context, builder, sig, args):
    """Codegen of ``icallN(addr, *args)``: call the numba-compiled function at ``addr`` (its
    native entry point) with ``args``, propagating a raised exception."""
    argtys = sig.args[1:]
    fnty = context.call_conv.get_function_type(types.none, argtys)
    fn = builder.inttoptr(args[0], fnty.as_pointer())
    status, _ = context.call_conv.call_function(builder, fn, types.none, argtys, args[1:])
    with builder.if_then(status.is_error, likely=False):
        context.call_conv.return_status_propagate(builder, status)
    return context.get_dummy_value()


@intrinsic
def icall3(typingctx, addr, a0, a1, a2):
    if not isinstance(addr, types.Integer):
        return None
    return types.void(addr, a0, a1, a2), icall_codegen


def native_address(dispatcher, argtypes: tuple) -> int:
    """Compile ``dispatcher`` for ``argtypes`` (it must return None) and return the address of
    its native entry point, for an indirect call from jitted code. Calling through the address
    does not link (and code-generate again) the callee's IR into the caller."""
    dispatcher.compile(argtypes)
    cres = dispatcher.overloads[argtypes]
    if cres.signature.return_type != types.none:
        raise TypeError(f"{dispatcher} must return None, returns {cres.signature.return_type}")
    return int(cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name))


_I64_1D = types.Array(types.int64, 1, "C")
JOB_SIGNATURE = (types.int64, _I64_1D, _I64_1D)


@njit(nogil=True, cache=True)
def _join_native(ctrl, seq, addr, nth, jctrl, desc):
    """Enter the native job ``seq`` (entry point ``addr``) if it is still open, run it, leave."""
    if not _enter(ctrl, seq):
        return
    icall3(addr, nth, jctrl, desc)
    atomic_add(ctrl, _ACTIVE, -1)


@njit(nogil=True, cache=True)
def _worker_loop(ctrl, jctrl, desc, nth, last, spin_iters):
    """Join every published native job (ctrl[KIND] = the job's address) without the GIL."""
    while True:
        seq = _spin_for_job(ctrl, last, spin_iters)
        if atomic_load(ctrl, _STOP) != 0:
            return seq, _STOPPED
        if seq == last:
            return last, _TIMEOUT
        addr = atomic_load(ctrl, _KIND)
        if addr == 0:
            return last, _OTHER_KIND
        if not _enter(ctrl, seq):  # the submitter closed it meanwhile
            continue
        icall3(addr, nth, jctrl, desc)
        atomic_add(ctrl, _ACTIVE, -1)
        last = seq


# ----------------------------------------------------------------------------- topology

def numa_nodes(allowed: set[int] | None = None) -> dict[int, list[int]]:
    """NUMA node -> CPUs of this process's affinity set on it (one node 0 when sysfs is absent)."""
    if allowed is None:
        allowed = set(os.sched_getaffinity(0))
    nodes: dict[int, list[int]] = {}
    for n in numa_topology():
        cpus = [c for c in n["cpus"] if c in allowed]
        if cpus:
            nodes[n["node"]] = cpus
    if not nodes:
        nodes = {0: sorted(allowed)}
    return nodes


class _Job:
    __slots__ = ("fn", "native", "errors", "complete", "keep", "lock", "finishing", "seq", "kind")

    def __init__(self, fn, native, keep=None):
        self.fn = fn
        self.native = native
        self.errors: list[tuple[int, BaseException]] = []
        self.complete = False
        self.keep = keep  # arrays the descriptor points into, alive until the job completes
        self.lock = threading.Lock()  # guards errors
        self.finishing = threading.Lock()  # one waiter marks the job complete
        self.seq = 0  # ctrl[_SEQ] while the job is open to joiners (set when published)
        self.kind = 0  # a native job's entry point (set when published)


class _State:
    """Everything the worker threads share (workers hold no reference to the CpuPool itself)."""

    def __init__(self, nthreads, spin_iters):
        self.nthreads = nthreads
        self.spin_iters = spin_iters
        self.ctrl = np.zeros(8 * CTRL_STRIDE, np.int64)
        self.jctrl = np.zeros(JCTRL_SIZE, np.int64)
        self.desc = np.zeros(DESC_SIZE, np.int64)
        self.cond = threading.Condition()
        self.sleepers = 0
        self.job: _Job | None = None
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()  # guards publication and shutdown
        # one submitter from begin() to its publication: (lock, the holder's thread ident)
        self.submit_lock = threading.Lock()
        self.submitter: int | None = None
        self.closed = False


def _fail(state: _State, job: _Job, who: int, exc: BaseException) -> None:
    with job.lock:
        job.errors.append((who, exc))
    _store_gil(state.jctrl, JOB_ABORT, 1)


def _participate_python(state: _State, job: _Job) -> None:
    """Claim tids of a Python job until none is left."""
    n = state.nthreads
    while True:
        tid = int(_add_gil(state.jctrl, JOB_JOIN, 1))
        if tid >= n:
            return
        try:
            job.fn(tid)
        except BaseException as exc:  # noqa: BLE001 - re-raised at wait()
            _fail(state, job, tid, exc)
        if _add_gil(state.jctrl, _JOB_PYDONE, 1) == n - 1:
            _store_gil(state.jctrl, JOB_COMPLETE, 1)


def _join(state: _State, job: _Job) -> None:
    """The caller's part in ``job`` (inside ``wait()``): it enters as the workers do, counted in
    _ACTIVE and only while the job's sequence number is open, so it never runs a job that is
    complete and whose descriptor another thread may be writing. A native job is entered,
    run and left in one jitted call."""
    if job.native:
        try:
            _join_native(state.ctrl, job.seq, job.kind, state.nthreads, state.jctrl, state.desc)
        except BaseException as exc:  # noqa: BLE001 - raised inside the job, which it had entered
            _add_gil(state.ctrl, _ACTIVE, -1)
            _fail(state, job, -1, exc)
    elif _enter_gil(state.ctrl, job.seq):
        try:
            _participate_python(state, job)
        finally:
            _add_gil(state.ctrl, _ACTIVE, -1)


def _worker_main(state: _State, wid: int, cpus: list[int] | None):
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass
    ctrl = state.ctrl
    n = state.nthreads
    last = 0
    loop_kind = 0
    while True:
        if loop_kind:
            try:
                last, code = _worker_loop(ctrl, state.jctrl, state.desc, n, last,
                                          state.spin_iters)
            except BaseException as exc:  # noqa: BLE001 - the job raised: re-raised at wait()
                last = _load_gil(ctrl, _SEQ)
                _fail(state, state.job, wid, exc)
                _add_gil(ctrl, _ACTIVE, -1)
                continue
        else:
            seq = _spin_for_job(ctrl, last, state.spin_iters)
            code = _STOPPED if _load_gil(ctrl, _STOP) else (_TIMEOUT if seq == last else _OTHER_KIND)
        if code == _STOPPED:
            return
        if code == _TIMEOUT:
            with state.cond:
                state.sleepers += 1
                while True:
                    v = _load_gil(ctrl, _SEQ)
                    if (v > 0 and v != last) or _load_gil(ctrl, _STOP):
                        break
                    state.cond.wait(0.5)
                state.sleepers -= 1
            continue
        kind = int(_load_gil(ctrl, _KIND))
        if kind:
            loop_kind = 1
            continue
        loop_kind = 0
        # a Python job
        seq = _load_gil(ctrl, _SEQ)
        if seq > 0 and _enter_gil(ctrl, seq):
            _participate_python(state, state.job)
            _add_gil(ctrl, _ACTIVE, -1)
        last = seq


def _shutdown_state(state: _State, timeout: float = 10.0) -> None:
    with state.lock:
        if state.closed:
            return
        state.closed = True
        _store_gil(state.ctrl, _STOP, 1)
        with state.cond:
            state.cond.notify_all()
    me = threading.current_thread()
    for t in state.threads:
        if t is not me:
            t.join(timeout)


class PoolHandle:
    """The result of ``CpuPool.submit``: ``wait()`` joins the job (when the pool lets the caller
    join), blocks until it is complete, re-raises the first participant's exception (if any),
    then returns ``finish()``'s value."""

    def __init__(self, pool: "CpuPool", job: _Job, finish=None):
        self._pool = pool
        self._job = job
        self._finish = finish
        self._result = None
        self._waited = False

    def done(self) -> bool:
        st = self._pool._state
        return self._job.complete or (st.job is self._job and (
            _load_gil(st.jctrl, JOB_COMPLETE) != 0 or _load_gil(st.jctrl, JOB_ABORT) != 0))

    def wait(self):
        if not self._waited:
            self._pool._wait_job(self._job)
            self._waited = True
            if self._job.errors:
                who, exc = self._job.errors[0]
                raise RuntimeError(
                    f"kt CpuPool: a job participant ({who}) raised {type(exc).__name__}: {exc}"
                ) from exc
            if self._finish is not None:
                self._result = self._finish()
                self._finish = None
        return self._result


@dataclass(frozen=True)
class _Placement:
    node: int
    cpus: list[int] | None


class CpuPool:
    """Persistent worker threads, grouped per NUMA node.

    num_threads: threads that compute a job (default ``KT_NUM_THREADS`` or the CPUs of the process
        affinity set), the caller included when ``caller_joins``.
    pin: pin each background thread to a CPU of its NUMA node (one CPU each when there are at
        most as many threads as CPUs); None = only when the pool owns every CPU of the affinity set.
    spin_us: how long idle workers (and a waiting caller) spin before they block.
    caller_joins: the thread in ``wait()`` takes part in the job (see the module docstring).
    cpus: the CPUs the pool's threads may run on (default: the process's affinity set), e.g. one
        NUMA node's for a per-node pool.
    """

    def __init__(self, num_threads: int | None = None, *, pin: bool | None = None,
                 spin_us: float = 2000.0, caller_joins: bool = True, cpus=None):
        from ..config import get_config

        allowed = sorted(os.sched_getaffinity(0))
        if cpus is not None:
            want = sorted({int(c) for c in cpus})
            if not want or not set(want) <= set(allowed):
                raise ValueError(f"cpus must be a non-empty subset of this process's CPUs "
                                 f"{allowed}, got {list(cpus)!r}")
            allowed = want
        if num_threads is None:
            num_threads = get_config().num_threads or len(allowed)
        if (not isinstance(num_threads, (int, np.integer)) or isinstance(num_threads, bool)
                or num_threads <= 0):
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        num_threads = int(num_threads)
        if not spin_us >= 0:
            raise ValueError(f"spin_us must be >= 0, got {spin_us}")
        nodes = numa_nodes(set(allowed))
        if pin is None:
            pin = num_threads == len(allowed)
        self.num_threads = num_threads
        self.caller_joins = bool(caller_joins)
        self.num_workers = num_threads - 1 if caller_joins else num_threads
        self.pinned = bool(pin)
        self.nodes = nodes
        self.spin_us = float(spin_us)
        # the caller's own CPU is the last of the list: background threads take the others
        self.placements = self._place(num_threads, nodes, self.pinned)[: self.num_workers]
        if cpus is not None:  # unpinned threads still stay on the given CPUs (their node's)
            self.placements = [pl if pl.cpus else _Placement(pl.node, list(nodes[pl.node]))
                               for pl in self.placements]
        self._spin_iters = max(1, int(spin_us * 1000 / _PAUSE_NS))
        self._state = _State(num_threads, self._spin_iters)
        self._kinds: dict[int, int] = {}
        self._kind_keep: list = []
        self._last: _Job | None = None
        self._scratch: dict[str, np.ndarray] = {}
        self.scratch_version = 0  # bumped whenever a scratch buffer is reallocated
        self._start()
        self._finalizer = weakref.finalize(self, _shutdown_state, self._state)
        _register_atexit(self._state)

    @staticmethod
    def _place(n, nodes, pin) -> list[_Placement]:
        """Spread n threads over the nodes in proportion to their CPUs."""
        total = sum(len(c) for c in nodes.values())
        keys = sorted(nodes)
        counts = {k: (n * len(nodes[k])) // total for k in keys}
        i = 0
        while sum(counts.values()) < n:
            counts[keys[i % len(keys)]] += 1
            i += 1
        out: list[_Placement] = []
        for k in keys:
            cpus = nodes[k]
            for j in range(counts[k]):
                if not pin:
                    out.append(_Placement(k, None))
                elif counts[k] <= len(cpus):
                    out.append(_Placement(k, [cpus[j * len(cpus) // counts[k]]]))
                else:
                    out.append(_Placement(k, list(cpus)))
        return out

    def _start(self):
        st = self._state
        for wid, pl in enumerate(self.placements):
            t = threading.Thread(target=_worker_main, args=(st, wid, pl.cpus),
                                 name=f"kt-cpu-{wid}", daemon=True)
            st.threads.append(t)
            t.start()

    # -- jobs

    @property
    def closed(self) -> bool:
        return self._state.closed

    def scratch(self, name: str, size: int, dtype) -> np.ndarray:
        """A pool-owned 1-D buffer of at least ``size`` elements, grown on demand and shared by
        every job of this pool (one job runs at a time). Contents are undefined."""
        dtype = np.dtype(dtype)
        key = f"{name}:{dtype.str}"
        buf = self._scratch.get(key)
        if buf is None or buf.size < size:
            buf = _align.empty(max(int(size), 1), dtype)
            self._scratch[key] = buf
            self.scratch_version += 1
        return buf[:size]

    def _kind(self, job) -> int:
        """A native job's kind: the address of its compiled entry point."""
        k = self._kinds.get(id(job))
        if k is None:
            k = native_address(job, JOB_SIGNATURE)
            self._kinds[id(job)] = k
            self._kind_keep.append(job)
        return k

    def begin(self, jctrl_words: int = JOB_FREE) -> tuple[np.ndarray, np.ndarray]:
        """Finish the job in flight, close the pool to late joiners, and hand out (desc, jctrl)
        for the next native job: write ``desc``, then ``submit_native``. ``jctrl[:jctrl_words]``
        is zeroed. Until the submit (or ``unbegin()``) another thread's ``begin()`` waits."""
        st = self._state
        if st.closed:
            raise RuntimeError("kt CpuPool: used after shutdown()")
        if not JOB_FREE <= jctrl_words <= JCTRL_SIZE:
            raise ValueError(f"jctrl_words must be in [{JOB_FREE}, {JCTRL_SIZE}], got {jctrl_words}")
        self._claim()
        try:
            if self._last is not None and not self._last.complete:
                self._wait_job(self._last)
            seq = _load_gil(st.ctrl, _SEQ)
            if seq > 0:
                # closed: participants that see the job now must leave it. A locked add, not a
                # plain store: the store is then ordered before the _ACTIVE loads below, so no
                # joiner can count itself after those loads and still read the open number.
                _add_gil(st.ctrl, _SEQ, -2 * seq)
            if not _spin_idle(st.ctrl, self._spin_iters):
                while not _spin_idle(st.ctrl, 1000):
                    time.sleep(0.0002)
        except BaseException:  # e.g. KeyboardInterrupt in the waits: other threads may go on
            self.unbegin()
            raise
        st.jctrl[:jctrl_words] = 0
        return st.desc, st.jctrl

    def _publish(self, job: _Job, kind: int, finish) -> PoolHandle:
        st = self._state
        with st.lock:
            if st.closed:
                raise RuntimeError("kt CpuPool: submit() after shutdown()")
            st.job = job
            job.kind = kind
            _store_gil(st.ctrl, _KIND, kind)
            job.seq = abs(int(_load_gil(st.ctrl, _SEQ))) + 1
            _store_gil(st.ctrl, _SEQ, job.seq)
            if st.sleepers:
                with st.cond:
                    st.cond.notify_all()
        self._last = job
        self.unbegin()
        return PoolHandle(self, job, finish)

    def _claim(self) -> None:
        """Make this thread the pool's one submitter until its job is published (or
        ``unbegin()``): another thread's ``begin()`` waits here, so two threads that share a
        pool (a hybrid layer's stream service and the caller's own thread) never write the one
        descriptor at once. A thread that calls ``begin()`` again holds it already."""
        st = self._state
        me = threading.get_ident()
        if st.submitter != me:
            st.submit_lock.acquire()
            st.submitter = me

    def unbegin(self) -> None:
        """Give up a ``begin()`` that will not be followed by a submit (nothing was published:
        the descriptor is rewritten by the next ``begin()``). No effect unless this thread
        holds it."""
        st = self._state
        if st.submitter == threading.get_ident():
            st.submitter = None
            st.submit_lock.release()

    def submit(self, fn, finish=None) -> PoolHandle:
        """Run the Python callable ``fn(tid)`` once for each tid in [0, num_threads);
        ``finish()`` runs in ``wait()``. One job runs at a time: a submit while a job is in
        flight first finishes that one (its result and error stay with its own handle)."""
        self.begin()
        return self._publish(_Job(fn, False), 0, finish)

    def submit_native(self, job, finish=None, keep=None) -> PoolHandle:
        """Run the jitted ``job(nthreads, jctrl, desc)`` (see the module docstring). Call
        ``begin()`` first and write ``desc``; ``keep`` holds the arrays ``desc`` points into."""
        if self._state.closed:
            raise RuntimeError("kt CpuPool: submit() after shutdown()")
        kind = self._kind(job)
        return self._publish(_Job(job, True, keep), kind, finish)

    def run(self, fn, finish=None):
        """Synchronous ``submit(fn, finish).wait()``."""
        return self.submit(fn, finish).wait()

    def abort(self, handle: PoolHandle) -> None:
        """Ask the participants of ``handle``'s job to leave it (sets its abort word; a native
        job checks it between tasks and while it waits). ``wait()`` then returns without the
        job's result. No effect on a job that is already complete or no longer current."""
        st, job = self._state, handle._job
        with job.finishing:  # the job cannot be marked complete (and the next one begun) meanwhile
            if st.job is job and not job.complete:
                _store_gil(st.jctrl, JOB_ABORT, 1)

    def _wait_job(self, job: _Job) -> None:
        """Join ``job`` (when the caller joins) and return once it is complete. Two threads may
        wait for one job (a hybrid layer's stream service, and another thread's ``begin()``):
        the caller joins as the workers do (counted in _ACTIVE, and only while the job's
        sequence number is open), and whichever waiter finishes the job first marks it
        complete; the other then stops looking at the control words, which the next job owns
        as soon as the job is complete."""
        if job.complete:
            return
        st = self._state
        if self.caller_joins and st.job is job:
            _join(st, job)
        if not (job.complete or _spin_done(st.jctrl, self._spin_iters)):
            while not (job.complete or _spin_done(st.jctrl, 100)):
                time.sleep(0.0002)
        with job.finishing:
            if not job.complete:
                self._finish_job(job)

    def _finish_job(self, job: _Job) -> None:
        """Mark ``job`` (complete or aborted, and still the current job) complete: after an
        abort, first wait for its participants to leave it."""
        st = self._state
        if _load_gil(st.jctrl, JOB_ABORT):
            # a participant failed: the others may still be inside the job
            while not _spin_idle(st.ctrl, 1000):
                time.sleep(0.0002)
            if _load_gil(st.jctrl, JOB_WATCHDOG) and job.native:
                job.errors.append(("watchdog", TimeoutError(
                    "a participant waited longer than the job's watchdog allows for work that never "
                    "finished, and aborted the job (the output is incomplete). With the default "
                    "watchdog (CPUMoE.watchdog_s) this is a scheduling bug in kt: please report it "
                    "with the call's shapes")))
        job.complete = True
        job.keep = None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop and join the workers (idempotent). A job in flight is finished first."""
        if not self._state.closed and self._last is not None and not self._last.complete:
            self._wait_job(self._last)
        _shutdown_state(self._state, timeout)

    def threads_alive(self) -> int:
        return sum(t.is_alive() for t in self._state.threads)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __repr__(self):
        return (f"CpuPool(num_threads={self.num_threads}, workers={self.num_workers}, "
                f"nodes={sorted(self.nodes)}, pinned={self.pinned}, closed={self.closed})")

    # -- measurement

    def handoff_overhead_us(self, repeats: int = 200, native: bool = True) -> dict:
        """Round trip of an (almost) empty job, submit + wait, in µs: min / median / p90."""
        if native:
            def once():
                self.begin()
                self.submit_native(_native_noop).wait()
        else:
            def once():
                self.run(_noop)
        for _ in range(20):
            once()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            once()
            ts.append((time.perf_counter_ns() - t0) / 1e3)
        ts.sort()
        return {"min": ts[0], "median": ts[len(ts) // 2], "p90": ts[int(len(ts) * 0.9)]}


_PAUSE_NS = 30.0  # measured pause + atomic load here (Zen 4); Intel's longer pause only spins less


def _noop(tid):
    return None


@njit(nogil=True, cache=True)
def _native_noop(nth, jctrl, desc):
    # every participant that joins counts itself; the last of nth completes the job, so the
    # measurement includes waking every worker
    if atomic_add(jctrl, JOB_JOIN, 1) == nth - 1:
        atomic_store(jctrl, JOB_COMPLETE, 1)


_live_states: "weakref.WeakSet[_State]" = weakref.WeakSet()
_atexit_registered = False


def _register_atexit(state: _State) -> None:
    global _atexit_registered
    _live_states.add(state)
    if not _atexit_registered:
        atexit.register(_shutdown_all)
        _atexit_registered = True


def _shutdown_all() -> None:
    for st in list(_live_states):
        _shutdown_state(st, timeout=2.0)


_defaults: dict = {}
_default_lock = threading.Lock()


def default_pool(threads: int | None = None) -> CpuPool:
    """The process's pool of ``threads`` threads (default: KT_NUM_THREADS or all allowed CPUs),
    created at first use and shared by every caller asking for that count."""
    with _default_lock:
        p = _defaults.get(threads)
        if p is None or p.closed:
            p = _defaults[threads] = CpuPool(threads) if threads is not None else CpuPool()
        return p
