"""The stream service of HybridMoE's CPU part, on the CPU with stand-in flags.

On a GPU the "start" flag is written by the CUDA stream and "done" is waited for by it; here a
threading.Event stands in for each (the polled path), or plain int32 words written and polled by the
test (the gated path), so the service thread's ordering, its result buffers and its error handling
are tested without CUDA (the CUDA side ran on the H200: benchmarks/bench_hybrid.py).
"""
import threading
import time

import numpy as np
import pytest
import torch

from kt import reference as ref
from kt.layer._stream_bridge import _Channel, _Job, _Service
from kt.cpu_ops.moe import CPUMoE
from kt.gpu_ops import stream_sync as ss
from kt.testing import random_expert_weights

E, K, H, I = 8, 2, 64, 32


class FakeSignal:
    """start/done as events: start() plays the stream's write, done_wait() the stream's wait."""

    def __init__(self, log, name):
        self.started, self.done = threading.Event(), threading.Event()
        self.log, self.name = log, name

    def start(self):
        self.started.set()

    def wait_start(self):
        self.started.wait(10)
        self.started.clear()
        self.log.append(("start", self.name))

    def set_done(self):
        self.log.append(("done", self.name))
        self.done.set()


class Bridge:
    def __init__(self, cpu):
        self.cpu = cpu
        self.times = []
        self.on_cpu_time = lambda t, k, s: self.times.append((t, k, s))


def _channel(log, name, x, ids, w):
    t = x.shape[0]
    ch = _Channel(FakeSignal(log, name))
    ch.h_x, ch.h_ids, ch.h_w = x.clone(), ids.clone(), w.clone()
    ch.h_out = torch.full((t, H), float("nan"))
    return ch


@pytest.fixture(scope="module")
def cpu():
    g, u, d = random_expert_weights(E, H, I, seed=5)
    moe = CPUMoE.from_tensors(g, u, d, scheme="bf16")
    moe(*_inputs(2, 99))  # compile the layer here, not inside a test's timed waits (cold cache)
    return moe


def _inputs(t, seed):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((t, H), dtype=np.float32))
    ids = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(t)]))
    w = torch.from_numpy(rng.random((t, K), dtype=np.float32))
    return x, ids, w


def test_jobs_run_in_order_when_their_flag_is_set(cpu):
    service, log, bridge = _Service(), [], Bridge(cpu)
    chans, jobs = [], []
    for i, t in enumerate((3, 5)):
        x, ids, w = _inputs(t, i)
        ch = _channel(log, f"job{i}", x, ids, w)
        chans.append((ch, x, ids, w))
        mask = np.zeros(E, bool) if i == 0 else None
        jobs.append(_Job(bridge, ch, t, mask))
    service.submit(jobs)
    # nothing runs before the "stream" reaches the start point
    assert not chans[0][0].signal.done.wait(0.2) and log == []
    chans[1][0].signal.start()  # the second flag first: the service still takes job 0 first
    assert not chans[1][0].signal.done.wait(0.2)
    chans[0][0].signal.start()
    assert chans[0][0].signal.done.wait(10) and chans[1][0].signal.done.wait(10)
    assert log == [("start", "job0"), ("done", "job0"), ("start", "job1"), ("done", "job1")]
    for ch, x, ids, w in chans:
        exp = cpu(x, ids, w)
        assert ref.relative_error(ch.h_out, exp) == 0.0
    assert [(t, k) for t, k, _ in bridge.times] == [(3, K), (5, K)]
    service.raise_pending()  # no error


def test_a_failing_job_releases_the_stream_and_reports_at_the_next_call(cpu):
    service, log = _Service(), []
    x, ids, w = _inputs(4, 9)
    bad = ids.clone()
    bad[0, 0] = E + 3  # out of range: CPUMoE raises in the service thread
    ch = _channel(log, "bad", x, bad, w)
    ch.h_out.zero_()
    service.submit([_Job(Bridge(cpu), ch, 4, None)])
    ch.signal.start()
    assert ch.signal.done.wait(10), "the stream must never be left waiting"
    assert torch.isnan(ch.h_out).all()  # a visible poison value, not stale data
    with pytest.raises(RuntimeError, match="CPU part of a hybrid MoE layer failed"):
        service.raise_pending()
    service.raise_pending()  # reported once
    # the service thread is still alive and serves the next job
    x2, ids2, w2 = _inputs(2, 10)
    ch2 = _channel(log, "ok", x2, ids2, w2)
    service.submit([_Job(Bridge(cpu), ch2, 2, None)])
    ch2.signal.start()
    assert ch2.signal.done.wait(10)
    assert ref.relative_error(ch2.h_out, cpu(x2, ids2, w2)) == 0.0


# ----------------------------------------------------------------------------- the gated path
# With a signal that has flag addresses (as CpuSignal), the service publishes each job on the pool
# before the stream sets "start"; the pool threads wait for the flag inside the job and the first
# one done clears "start" and sets "done". Here plain int32 words play the pinned flags and the
# test plays the stream's memory operations.

class FlagSignal:
    def __init__(self):
        self.flags = np.zeros(32, np.int32)
        self.start_address = self.flags.ctypes.data
        self.done_address = self.start_address + 64

    def wait_start(self):
        ss.spin_wait_clear(self.start_address)

    def set_done(self):
        ss.store_flag(self.done_address, 1)

    # the stream's side
    def start(self):
        ss.store_flag(self.start_address, 1)

    def wait_done(self, timeout=10.0):
        t0 = time.monotonic()
        while ss.load_flag(self.done_address) != 1:
            if time.monotonic() - t0 > timeout:
                return False
            time.sleep(1e-4)
        ss.store_flag(self.done_address, 0)
        return True


def _gated_channel(x, ids, w, dtype=torch.float32):
    from kt.layer._stream_bridge import _np_view

    t = x.shape[0]
    ch = _Channel(FlagSignal())
    ch.h_x = x.to(dtype).contiguous()
    ch.h_ids = ids.to(torch.int64).contiguous()
    ch.h_w = w.to(torch.float32).contiguous()
    ch.h_out = torch.full((t, H), float("nan"), dtype=dtype)
    ch.np_views = tuple(_np_view(a) for a in (ch.h_x, ch.h_ids, ch.h_w, ch.h_out))
    return ch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_jobs_wait_for_their_flag_and_publish_done(cpu, dtype):
    from kt.layer._stream_bridge import _gated

    service, bridge = _Service(), Bridge(cpu)
    chans, jobs = [], []
    for i, t in enumerate((1, 6)):
        x, ids, w = _inputs(t, 20 + i)
        ch = _gated_channel(x, ids, w, dtype)
        mask = np.zeros(E, bool)
        mask[1] = True  # expert 1 is "on the GPU"
        chans.append((ch, x, ids, w, mask))
        jobs.append(_Job(bridge, ch, t, mask))
        assert _gated(jobs[-1])
    service.submit(jobs)
    sig0, sig1 = chans[0][0].signal, chans[1][0].signal
    try:
        assert not sig0.wait_done(0.3)  # armed, but the "stream" has not reached its start
        assert torch.isnan(chans[0][0].h_out.float()).all()
        sig0.start()
        assert sig0.wait_done()
        assert sig0.flags[0] == 0  # "start" consumed by the job itself
        sig1.start()
        assert sig1.wait_done()
    finally:  # never leave the shared pool waiting for a flag
        sig0.start()
        sig1.start()
    for ch, x, ids, w, mask in chans:
        exp = cpu(ch.h_x, ids, w, gpu_mask=mask)  # the same inputs through the plain call
        assert torch.equal(ch.h_out.view(torch.int16) if dtype == torch.bfloat16 else ch.h_out,
                           exp.view(torch.int16) if dtype == torch.bfloat16 else exp)
    t0 = time.monotonic()  # the service thread books a job's time after it raised "done"
    while len(bridge.times) < 2 and time.monotonic() - t0 < 10:
        time.sleep(1e-3)
    assert [(t, k) for t, k, _ in bridge.times] == [(1, K), (6, K)]
    assert all(s > 0 for _, _, s in bridge.times)
    service.raise_pending()  # no error


def test_gated_job_skips_and_reports_out_of_range_ids(cpu):
    service = _Service()
    x, ids, w = _inputs(3, 30)
    bad = ids.clone()
    bad[1, 0] = E + 5
    bad[2, 1] = -7
    ch = _gated_channel(x, bad, w)
    service.submit([_Job(Bridge(cpu), ch, 3, None)])
    ch.signal.start()
    assert ch.signal.wait_done()
    skip = bad.clone()
    skip[1, 0] = -1
    skip[2, 1] = -1
    assert torch.equal(ch.h_out, cpu(x, skip, w))  # the bad slots skipped, nothing else touched
    # the service thread books the count after "done" (a layer reports it at its next call): on
    # 2 busy cores it may not have done so yet (2 of 20 runs read "DID NOT RAISE")
    t0 = time.monotonic()
    while not service.errors and time.monotonic() - t0 < 10:
        time.sleep(1e-3)
    with pytest.raises(RuntimeError, match=r"2 values outside \[-1, 8\)"):
        service.raise_pending()


def test_gated_job_that_cannot_be_published_still_answers_the_stream(cpu):
    service = _Service()
    x, ids, w = _inputs(2, 31)
    ch = _gated_channel(x, ids, w)
    job = _Job(Bridge(cpu), ch, 2, np.zeros(E + 1, bool))  # a wrong mask: submit_gated raises
    service.submit([job])
    ch.signal.start()
    assert ch.signal.wait_done()
    assert torch.isnan(ch.h_out).all()
    with pytest.raises(RuntimeError, match="gpu_mask must be"):
        service.raise_pending()


def test_gated_job_is_complete_only_once_published():
    """A gated job's waiter sees it complete only after its result is published: with the
    publisher held between claiming the publication and writing the result (a test knob, 2 ms),
    every job still reports finished. (When any participant could mark the job complete, the
    waiter read "not finished" whenever another participant left first: the H200 saw it three
    times in ~30k decode jobs.)"""
    from kt.cpu_ops.driver import layout as drv
    from kt.cpu_ops.runtime.atomics import tsc_hz
    from kt.cpu_ops.runtime.pool import CpuPool

    pool = CpuPool(3)
    try:
        m = CPUMoE.from_tensors(*random_expert_weights(E, H, I, seed=5), scheme="int8", pool=pool)
        m._wdesc[drv.S_PUBWAIT] = int(2e-3 * tsc_hz())
        m._tmpl.clear()
        x, ids, w = _inputs(1, 33)
        xn, idn, wn = x.numpy(), ids.to(torch.int64).numpy(), w.numpy()
        want = m(x, ids, w).numpy()
        for _ in range(8):
            sig = FlagSignal()
            out = np.zeros((1, H), np.float32)
            h = m.submit_gated(xn, idn, wn, out, sig.start_address, sig.done_address)
            sig.start()
            res = h.wait()
            assert res.opened and res.finished and res.error is None
            assert sig.wait_done() and np.array_equal(out, want)
    finally:
        pool.shutdown()


def test_submit_gated_abort_and_checks(cpu):
    sig = FlagSignal()
    x, ids, w = _inputs(2, 32)
    xn, idn, wn = x.numpy(), ids.to(torch.int64).numpy(), w.numpy()
    out = np.zeros((2, H), np.float32)
    h = cpu.submit_gated(xn, idn, wn, out, sig.start_address, sig.done_address)
    h.abort()  # the flag never comes: the pool threads leave the job
    res = h.wait()
    assert not res.opened and not res.finished and res.error is None
    assert not out.any() and sig.flags[16] == 0
    assert torch.equal(cpu(x, ids, w), cpu(x, ids, w))  # the pool is usable again
    with pytest.raises(TypeError, match="topk_ids must be one of"):
        cpu.submit_gated(xn, ids.to(torch.int32).numpy(), wn, out, sig.start_address, sig.done_address)
    with pytest.raises(ValueError, match="must be \\[T, H"):
        cpu.submit_gated(xn, idn, wn, out[:1], sig.start_address, sig.done_address)
    with pytest.raises(ValueError, match="4-byte aligned"):
        cpu.submit_gated(xn, idn, wn, out, sig.start_address + 1, sig.done_address)
    big = cpu.max_gated_tokens + 1
    with pytest.raises(ValueError, match="must be in"):
        cpu.submit_gated(np.zeros((big, H), np.float32), np.zeros((big, K), np.int64),
                         np.zeros((big, K), np.float32), np.zeros((big, H), np.float32),
                         sig.start_address, sig.done_address)


def test_gated_result_survives_the_next_job(cpu):
    """A gated job's result (finished, skipped ids) is its own: another job begun on the same pool
    before the handle is read (the pool's control words are zeroed then) does not change it."""
    sig = FlagSignal()
    x, ids, w = _inputs(3, 33)
    bad = ids.to(torch.int64).clone()
    bad[0, 1] = E  # out of range: skipped and counted
    out = np.zeros((3, H), np.float32)
    h = cpu.submit_gated(x.numpy(), bad.numpy(), w.numpy(), out, sig.start_address, sig.done_address)
    sig.start()
    assert sig.wait_done()
    x2, ids2, w2 = _inputs(2, 34)
    cpu(x2, ids2, w2)  # a plain call on the same pool: begins (and finishes) the next job first
    res = h.wait()
    assert res.opened and res.finished and res.bad_ids == 1 and res.error is None and res.seconds > 0


def test_logging_jobs_routes_jobs_and_restores_the_collector():
    # GraphRunner.capture and a layer's own decode graphs both capture through this context: while
    # it is open, started jobs go to its log and the cyclic collector is off; both come back after
    # it, also when the capture raises, and an enclosing log is restored.
    import gc

    from kt.layer import _stream_bridge as sb

    assert gc.isenabled() and getattr(sb._capture, "log", None) is None
    outer, inner = [], []
    with sb.logging_jobs(outer, collect=False) as got:
        assert got is outer and sb._capture.log is outer and not gc.isenabled()
        with pytest.raises(RuntimeError, match="capture failed"):
            with sb.logging_jobs(inner):
                assert sb._capture.log is inner
                raise RuntimeError("capture failed")
        assert sb._capture.log is outer and not gc.isenabled()
    assert getattr(sb._capture, "log", None) is None and gc.isenabled()


def test_graph_runner_capture_logs_inside_the_graph_context(monkeypatch):
    # GraphRunner.capture = logging_jobs around torch.cuda.graph (faked here: no GPU needed): the log
    # is in place before the graph context opens and until after it closes, also on an error.
    import gc

    from kt.layer import _stream_bridge as sb

    seen = []

    class FakeGraph:
        def __init__(self, graph, pool=None, stream=None):
            seen.append(("init", graph, pool, stream))

        def __enter__(self):
            seen.append(("enter", sb._capture.log, gc.isenabled()))
            return "ctx"

        def __exit__(self, *exc):
            seen.append(("exit", sb._capture.log, exc[0]))
            return False

    monkeypatch.setattr(torch.cuda, "graph", FakeGraph)
    runner = sb.GraphRunner.__new__(sb.GraphRunner)
    runner.graph, runner.pool, runner.log = "G", "P", []
    with runner.capture(stream="S") as got:
        assert got == "ctx" and sb._capture.log is runner.log
    with pytest.raises(ValueError):
        with runner.capture():
            raise ValueError("in the step")
    assert seen[0] == ("init", "G", "P", "S") and seen[1] == ("enter", runner.log, False)
    assert seen[2] == ("exit", runner.log, None) and seen[-1] == ("exit", runner.log, ValueError)
    assert getattr(sb._capture, "log", None) is None and gc.isenabled()


_SHARED_POOL_SCRIPT = r"""
import sys, threading, time
import numpy as np, torch
from kt.cpu_ops.moe import CPUMoE, MoETuning
from kt.gpu_ops import stream_sync as ss
from kt.testing import random_expert_weights

E, K, H, I = 8, 2, 64, 32
cpu = CPUMoE.from_tensors(*random_expert_weights(E, H, I, seed=5), scheme="bf16")
rng = np.random.default_rng(0)

def inputs(t):
    x = rng.standard_normal((t, H), dtype=np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int64)
    return x, ids, rng.random((t, K), dtype=np.float32)

xg, ig, wg = inputs(3)
want_g = cpu(torch.from_numpy(xg), torch.from_numpy(ig), torch.from_numpy(wg)).numpy()
xp, ip, wp = (torch.from_numpy(a) for a in inputs(2))
want_p = cpu(xp, ip, wp)
chunked = CPUMoE.from_tensors(*random_expert_weights(E, H, I, seed=6), scheme="int8",
                              tuning=MoETuning(chunk_tokens=16), pool=cpu.pool)
xc, ic, wc = (torch.from_numpy(a) for a in inputs(400))  # 25 chunks: two pool jobs
want_c = chunked(xc, ic, wc)
stop = time.monotonic() + float(sys.argv[1])
bad, counts = [], {}

def gated():  # what the stream service does: publish, let the "stream" start it, join it
    n = 0
    while time.monotonic() < stop:
        flags = np.zeros(32, np.int32)
        out = np.zeros((3, H), np.float32)
        h = cpu.submit_gated(xg, ig, wg, out, flags.ctypes.data, flags.ctypes.data + 64)
        ss.store_flag(flags.ctypes.data, 1)
        r = h.wait()
        if not (r.finished and np.array_equal(out, want_g)):
            bad.append("gated")
        n += 1
    counts["gated"] = n

t = threading.Thread(target=gated)
t.start()
n = 0
while time.monotonic() < stop:  # the caller's own thread: plain calls on the same pool
    if not torch.equal(cpu(xp, ip, wp), want_p):
        bad.append("plain")
    if n % 8 == 0 and not torch.equal(chunked.submit(xc, ic, wc).wait(), want_c):
        bad.append("chunked")
    n += 1
t.join()
print("ok" if not bad and n and counts["gated"] else f"BAD {bad[:3]} plain={n} {counts}")
"""


def test_a_gated_waiter_and_another_threads_calls_share_one_pool(tmp_path):
    """The stream service waits for (joins) its gated jobs while another thread calls layers on
    the same pool: the waiter joins only while its job is open and counted as a participant, and
    one thread at a time writes the pool's descriptor. (Before, a waiter that joined late ran
    the next job's half-written descriptor: CI died of a SIGSEGV in this file, and this loop
    crashed within 1.5 s every time.) In a child process, so a regression is a failure here."""
    import subprocess
    import sys

    script = tmp_path / "shared_pool.py"
    script.write_text(_SHARED_POOL_SCRIPT)
    r = subprocess.run([sys.executable, str(script), "1.5"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout[-2000:],
                                                                    r.stderr[-2000:])
