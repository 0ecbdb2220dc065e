"""The stream service of HybridMoE's CPU part, on the CPU with stand-in flags.

On a GPU the "start" flag is written by the CUDA stream and "done" is waited for by it; here a
threading.Event stands in for each, so the service thread's ordering, its result buffers and its
error handling are tested without CUDA (the CUDA side ran on the H200: benchmarks/bench_hybrid.py).
"""
import threading

import numpy as np
import pytest
import torch

from kt import reference as ref
from kt._stream_bridge import _Channel, _Job, _Service
from kt.cpu_ops.moe import CPUMoE
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
    return CPUMoE.from_tensors(g, u, d, scheme="bf16")


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
