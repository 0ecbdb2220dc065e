"""CpuPool: persistent CPU worker threads that run one job at a time, with a fast hand-off.

Jobs are *joinable*: every participant (a background worker, or the calling thread inside
``wait()``) enters the same job and takes work from it until none is left, so a job never waits
for a particular thread. A native job is a jitted ``job(nthreads, jctrl, desc)`` (``worker``
explains the protocol, ``job`` the descriptor). Background workers run native jobs from the nogil
jitted loop of ``worker``, so no GIL is taken between jobs: idle workers spin for ``spin_us`` on
an atomic sequence number and only then block on a ``threading.Condition``. A Python job
``fn(tid)`` runs once per tid in [0, num_threads) on whichever participants claim the tids
(tests, tools).

By default the caller joins its own jobs (``caller_joins=True``): a pool of ``num_threads`` owns
``num_threads - 1`` background threads, and the thread calling ``wait()`` is the last participant.
That keeps an n-core machine at n spinning threads. With ``caller_joins=False`` all
``num_threads`` are background threads (``submit`` then computes fully in the background).

The pool is an object the caller owns; ``default_pool()`` hands out one per (thread count, CPU
set) per process, made at first use. Threads are grouped per NUMA node
(``/sys/devices/system/node``), and can be pinned to their node's CPUs. Pinning is off unless the
pool owns every CPU of the process affinity set (pinning onto cores that something else uses
hurts), or ``pin=True``.

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

from ..._sysinfo import numa_topology
from .. import _align
from .atomics import _add_gil, _load_gil, _store_gil
from .native import native_address
from .worker import (_ACTIVE, _JOB_PYDONE, _KIND, _OTHER_KIND, _SEQ, _STOP, _STOPPED, _TIMEOUT,
                     CTRL_STRIDE, DESC_SIZE, JCTRL_SIZE, JOB_ABORT, JOB_COMPLETE, JOB_FREE, JOB_JOIN,
                     JOB_SIGNATURE, JOB_WATCHDOG, _enter_gil, _join_native, _native_noop, _spin_done,
                     _spin_for_job, _spin_idle, _worker_loop)

__all__ = ["CpuPool", "PoolHandle", "default_pool", "numa_nodes"]


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
        from ...config import get_config

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
                    "watchdog (MoETuning.watchdog_s) this is a scheduling bug in kt; report it "
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


_defaults: dict[tuple[int, tuple[int, ...]], CpuPool] = {}
# default_pool() with no arguments: KT_NUM_THREADS (as set) -> (affinity set, pool)
_fast_defaults: dict[str | None, tuple[set[int], CpuPool]] = {}
_default_lock = threading.Lock()


def default_pool(threads: int | None = None, *, cpus=None) -> CpuPool:
    """The process's pool of ``threads`` threads on the CPU set ``cpus``: one per (thread count,
    CPU set), created at first use (and again if it was shut down).

    threads: default ``KT_NUM_THREADS`` (``kt.config``), else the CPUs of ``cpus``, else of the
    process affinity set. cpus: the CPUs its threads may run on (default, or all of them: the
    process's affinity set, the threads placed as ``CpuPool(threads)`` places them)."""
    from ...config import get_config

    if threads is None and cpus is None:  # the per-call path of every layer: no config parsing
        fast_key = (os.environ.get("KT_NUM_THREADS"), os.sched_getaffinity(0))
        pool = _fast_defaults.get(fast_key[0])
        if pool is not None and pool[0] == fast_key[1] and not pool[1].closed:
            return pool[1]
    if cpus is not None:
        cpu_set = tuple(sorted({int(c) for c in cpus}))
        if not cpu_set or not set(cpu_set) <= set(os.sched_getaffinity(0)):
            raise ValueError(f"cpus must be a non-empty subset of this process's CPUs "
                             f"{sorted(os.sched_getaffinity(0))}, got {list(cpus)!r}")
    else:
        cpu_set = tuple(sorted(os.sched_getaffinity(0)))
    threads_arg = threads
    if threads is None:
        threads = get_config().num_threads or len(cpu_set)
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads <= 0:
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    key = (int(threads), cpu_set)
    whole = cpu_set == tuple(sorted(os.sched_getaffinity(0)))
    with _default_lock:
        pool = _defaults.get(key)
        if pool is None or pool.closed:
            pool = CpuPool(int(threads), cpus=None if whole else cpu_set)
            _defaults[key] = pool
        if threads_arg is None and cpus is None:
            _fast_defaults[fast_key[0]] = (fast_key[1], pool)
        return pool
