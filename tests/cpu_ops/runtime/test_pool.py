"""CpuPool: joinable jobs, native (nogil) jobs, errors surface at wait(), shutdown, no leaks."""
import gc
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from numba import njit

from kt.cpu_ops.driver.sync import _wait_at_least
from kt.cpu_ops.runtime.atomics import atomic_add, atomic_load, atomic_store, tsc_hz
from kt.cpu_ops.runtime.pool import CpuPool, default_pool, numa_nodes
from kt.cpu_ops.runtime.worker import JOB_ABORT, JOB_COMPLETE, JOB_JOIN, JOB_WATCHDOG


@njit(nogil=True)
def _count_job(nth, jctrl, desc):
    """Claims desc[0] tasks dynamically; task i adds i+1 into desc[1] (atomically)."""
    atomic_add(jctrl, JOB_JOIN, 1)
    n = desc[0]
    while True:
        i = atomic_add(jctrl, 128, 1)
        if i >= n:
            break
        atomic_add(desc, 1, i + 1)
        if atomic_add(jctrl, 256, 1) == n - 1:
            atomic_store(jctrl, JOB_COMPLETE, 1)


@njit(nogil=True)
def _failing_job(nth, jctrl, desc):
    if atomic_add(jctrl, JOB_JOIN, 1) == 0:
        raise ValueError("boom from a native job")
    # the others wait for the abort flag, as a job's barrier would
    while atomic_load(jctrl, JOB_ABORT) == 0:
        pass


@njit(nogil=True)
def _stuck_job(nth, jctrl, desc):
    """Every participant waits, through the MoE driver's own wait, for desc[0] to reach 1, which
    never happens: only the watchdog (desc[1] time-stamp ticks) ends the job."""
    atomic_add(jctrl, JOB_JOIN, 1)
    _wait_at_least(jctrl, desc, 0, 1, desc[1])


@pytest.fixture(scope="module")
def pool():
    p = CpuPool(2, spin_us=200)
    yield p
    p.shutdown()


def test_numa_nodes_cover_affinity():
    import os

    nodes = numa_nodes()
    cpus = sorted(c for cs in nodes.values() for c in cs)
    assert cpus == sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("caller_joins", [True, False])
def test_python_job_runs_every_tid_once(caller_joins):
    with CpuPool(3, caller_joins=caller_joins, spin_us=100) as p:
        for _ in range(20):
            seen = []
            lock = threading.Lock()

            def fn(tid):
                with lock:
                    seen.append(tid)

            p.run(fn)
            assert sorted(seen) == [0, 1, 2]
        assert p.num_workers == (2 if caller_joins else 3)


def test_native_job_dynamic_tasks(pool):
    for n in (0, 1, 7, 1000):
        desc, _ = pool.begin(512)
        desc[0] = n
        desc[1] = 0
        if n == 0:  # nothing to complete: a job with no task must still finish
            continue
        pool.submit_native(_count_job).wait()
        assert desc[1] == n * (n + 1) // 2


def test_submit_returns_before_done_and_finish_runs(pool):
    calls = []
    h = pool.submit(lambda tid: time.sleep(0.05), finish=lambda: calls.append(1) or "r")
    assert h.wait() == "r" and calls == [1]
    assert h.wait() == "r" and calls == [1]  # finish runs once


def test_python_exception_surfaces_and_pool_stays_usable(pool):
    def bad(tid):
        if tid == 1:
            raise KeyError("worker failure")

    with pytest.raises(RuntimeError, match="KeyError"):
        pool.run(bad)
    ok = []
    pool.run(lambda tid: ok.append(tid))
    assert sorted(ok) == [0, 1]


def test_native_exception_surfaces_and_pool_stays_usable(pool):
    pool.begin()
    with pytest.raises(RuntimeError, match="boom from a native job"):
        pool.submit_native(_failing_job).wait()
    desc, _ = pool.begin(512)
    desc[0], desc[1] = 10, 0
    pool.submit_native(_count_job).wait()
    assert desc[1] == 55


def test_watchdog_ends_a_wait_that_never_finishes(pool):
    desc, jctrl = pool.begin()
    desc[0], desc[1] = 0, int(0.05 * tsc_hz())
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="watchdog") as err:
        pool.submit_native(_stuck_job).wait()
    assert isinstance(err.value.__cause__, TimeoutError)
    assert time.perf_counter() - t0 < 30 and jctrl[JOB_WATCHDOG] == 1
    desc, jctrl = pool.begin(512)  # the pool is usable, and the next job starts unmarked
    assert jctrl[JOB_WATCHDOG] == 0
    desc[0], desc[1] = 10, 0
    pool.submit_native(_count_job).wait()
    assert desc[1] == 55


def test_back_to_back_submits_keep_order(pool):
    # a second submit while the first is in flight finishes the first one first
    out = []
    h1 = pool.submit(lambda tid: (time.sleep(0.02), out.append(("a", tid))))
    h2 = pool.submit(lambda tid: out.append(("b", tid)))
    h2.wait()
    h1.wait()
    assert [o[0] for o in out] == ["a", "a", "b", "b"]


def test_workers_block_after_spinning_and_wake_up():
    with CpuPool(2, spin_us=50) as p:
        p.run(lambda tid: None)
        time.sleep(0.05)  # well past spin_us: the worker now blocks on the condition
        got = []
        p.run(lambda tid: got.append(tid))
        assert sorted(got) == [0, 1]


def test_shutdown_joins_and_no_thread_leak():
    before = threading.active_count()
    for _ in range(5):
        p = CpuPool(2, spin_us=50)
        p.run(lambda tid: None)
        p.shutdown()
        assert p.threads_alive() == 0
        p.shutdown()  # idempotent
        with pytest.raises(RuntimeError, match="after shutdown"):
            p.submit(lambda tid: None)
    # a pool dropped without shutdown() is joined by its finalizer
    p = CpuPool(2, spin_us=50)
    threads = list(p._state.threads)
    del p
    gc.collect()
    for t in threads:
        t.join(5)
        assert not t.is_alive()
    assert threading.active_count() == before


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_threads"):
        CpuPool(0)
    with pytest.raises(ValueError, match="num_threads"):
        CpuPool(1.5)
    with pytest.raises(ValueError, match="spin_us"):
        CpuPool(1, spin_us=-1)


def test_default_pool_is_one_per_thread_count_and_cpu_set(monkeypatch):
    """default_pool: one pool per (threads, CPU set) per process, made at first use and again
    after a shutdown; threads default to KT_NUM_THREADS, else the CPUs of the set."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.delenv("KT_NUM_THREADS", raising=False)
    p = default_pool()
    assert p is default_pool() and p.num_threads == len(cpus)
    assert default_pool(len(cpus)) is p and default_pool(cpus=cpus) is p  # the same key
    one = default_pool(1)
    assert one.num_threads == 1 and default_pool(1) is one and (one is not p) == (len(cpus) > 1)
    monkeypatch.setenv("KT_NUM_THREADS", "1")
    assert default_pool() is one
    mine = default_pool(cpus=cpus[:1])
    assert mine.num_threads == 1 and default_pool(1, cpus=cpus[:1]) is mine
    if len(cpus) > 1:  # a CPU subset is its own pool, its threads kept on those CPUs
        assert mine is not one and all(set(pl.cpus) <= {cpus[0]} for pl in mine.placements)
    mine.shutdown()
    again = default_pool(cpus=cpus[:1])
    assert again is not mine and not again.closed
    with pytest.raises(ValueError, match="threads must be a positive int"):
        default_pool(0)
    with pytest.raises(ValueError, match="subset"):
        default_pool(cpus=[max(cpus) + 1000])


def test_interpreter_exit_does_not_hang():
    code = ("from kt.cpu_ops.runtime.pool import CpuPool\n"
            "p = CpuPool(2, spin_us=10**6)\n"  # workers spinning at exit
            "p.run(lambda tid: None)\n"
            "q = CpuPool(2)\n")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert time.time() - t0 < 60


def test_handoff_overhead_is_measured(pool):
    # the figure is reported by benchmarks/bench_moe.py; here only that it is sane (the shared
    # 2-core CI machine gives no timing guarantee)
    st = pool.handoff_overhead_us(repeats=50)
    assert 0 < st["min"] <= st["median"] <= st["p90"]
    print(f"\nCpuPool(2) native hand-off: {st}")


def test_begin_holds_the_pool_for_its_thread_until_the_submit():
    # a second thread's begin() waits while the first thread writes its descriptor, and goes on
    # once that job is published (or the begin given up with unbegin())
    with CpuPool(2, spin_us=100) as p:
        for give_up in (False, True):
            desc, _ = p.begin(512)
            desc[0], desc[1] = 10, 0
            began = threading.Event()
            th = threading.Thread(target=lambda: (p.begin(), began.set(), p.unbegin()))
            th.start()
            assert not began.wait(0.2), "another thread began while the descriptor was written"
            desc2, _ = p.begin(512)  # the holder itself may begin again
            assert desc2 is desc
            if give_up:
                p.unbegin()
            else:
                h = p.submit_native(_count_job)
            assert began.wait(10)
            th.join()
            if not give_up:
                h.wait()
                assert desc[1] == 55
