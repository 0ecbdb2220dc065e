"""The CPU part of a hybrid MoE layer, ordered on a CUDA stream with no host synchronisation.

For each call the stream copies the inputs into pinned host buffers and then writes a "start" flag
(``kt.gpu_ops.stream_sync.CpuSignal``); one service thread per process takes the calls in stream
order and, for each, publishes the layer's job on the ``CPUMoE``'s pool *before* the flag is set
(``CPUMoE.submit_gated``): the pool threads wait for the flag inside the job, compute, and the first
one done clears "start" and sets "done", so no Python runs between the stream reaching the CPU part
and the stream going on. The stream waits for "done" before it copies the result back. The host
thread that enqueues a forward never blocks. A call too large for one job (or a stand-in signal
without flag addresses, in tests) takes the polled path: the service thread waits for the flag,
then calls the ``CPUMoE`` and sets "done" itself.

CUDA graphs: the GPU side is capturable (only memops / host functions and async copies), but a
replay runs no Python, so the service thread must be told which calls a replay will make. Calls made
while capturing are recorded; ``GraphRunner.replay()`` hands that log to the service thread and then
replays the graph.
"""
from __future__ import annotations

import contextlib
import gc
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["StreamBridge", "GraphRunner", "service"]


@dataclass
class _Channel:
    signal: object
    h_x: torch.Tensor | None = None
    h_ids: torch.Tensor | None = None
    h_w: torch.Tensor | None = None
    h_out: torch.Tensor | None = None
    d_out: torch.Tensor | None = None
    x_dtype: torch.dtype | None = None
    np_views: tuple | None = None  # (x, ids, w, out) numpy views of the pinned buffers


def _np_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bf16 as uint16 bit patterns)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


@dataclass
class _Job:
    bridge: "StreamBridge"
    channel: _Channel
    t: int
    gpu_mask: np.ndarray | None


class _Service:
    """One thread that runs stream-ordered CPU jobs in the order they were enqueued."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()
        self.errors: list[BaseException] = []

    def submit(self, jobs) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="kt-stream-cpu", daemon=True)
                self._thread.start()
        for j in jobs:
            self._q.put(j)

    def _run(self):
        while True:
            job = self._q.get()
            if job is None:
                return
            if _gated(job):
                self._run_gated(job)
            else:
                self._run_polled(job)

    def _run_polled(self, job):
        ch = job.channel
        try:
            ch.signal.wait_start()
            t = job.t
            t0 = time.perf_counter()
            job.bridge.cpu(ch.h_x[:t], ch.h_ids[:t], ch.h_w[:t], gpu_mask=job.gpu_mask,
                           out=ch.h_out[:t])
            if job.bridge.on_cpu_time is not None:
                job.bridge.on_cpu_time(t, ch.h_ids.shape[1], time.perf_counter() - t0)
        except BaseException as exc:  # keep the stream from hanging; report at the next call
            self._poison(job, exc)
        finally:
            ch.signal.set_done()

    def _run_gated(self, job):
        """Publish the job before the stream sets "start"; this thread then joins it (and waits
        for the flag inside it, as the pool threads do)."""
        ch, t = job.channel, job.t
        sig = ch.signal
        x, ids, w, out = (a[:t] for a in ch.np_views)
        try:
            h = job.bridge.cpu.submit_gated(x, ids, w, out, sig.start_address, sig.done_address,
                                            gpu_mask=job.gpu_mask)
        except BaseException as exc:  # nothing was published: answer the stream from here
            self._run_failed(job, exc, opened=False)
            return
        res = h.wait()
        if not res.finished:
            self._run_failed(job, res.error or RuntimeError("the CPU job was aborted"), res.opened)
            return
        if res.bad_ids:
            E = job.bridge.cpu.num_experts
            self.errors.append(ValueError(f"topk_ids had {res.bad_ids} values outside [-1, {E}) "
                                          f"(skipped)"))
        if job.bridge.on_cpu_time is not None:
            job.bridge.on_cpu_time(t, ids.shape[1], res.seconds)

    def _run_failed(self, job, exc, opened: bool):
        """A gated job that did not publish its result: consume its "start" (waiting for it if
        no participant saw it yet), poison the output and set "done", so the stream goes on."""
        from ..gpu_ops.stream_sync import store_flag

        sig = job.channel.signal
        if opened:
            store_flag(sig.start_address, 0)
        else:
            sig.wait_start()
        self._poison(job, exc)
        sig.set_done()

    def _poison(self, job, exc):
        self.errors.append(exc)
        try:
            job.channel.h_out[: job.t].fill_(float("nan"))
        except Exception:
            pass

    def raise_pending(self) -> None:
        if self.errors:
            exc = self.errors.pop(0)
            self.errors.clear()
            raise RuntimeError(f"kt: the CPU part of a hybrid MoE layer failed: {exc!r}") from exc


GATED = True  # benchmarks set False to time the polled path against the gated one


def _gated(job: _Job) -> bool:
    """Whether ``job`` can run as a stream-gated pool job (see the module docstring)."""
    ch = job.channel
    cpu = job.bridge.cpu
    return (GATED and ch.np_views is not None and getattr(ch.signal, "start_address", None) is not None
            and hasattr(cpu, "submit_gated") and job.t <= cpu.max_gated_tokens)


service = _Service()
_capture = threading.local()


@contextlib.contextmanager
def logging_jobs(log: list, collect: bool = True):
    """While a CUDA graph captures in this thread: the stream-ordered CPU jobs its hybrid layers
    start go to ``log`` (to be handed to the service thread at each replay) instead of running,
    and Python's cyclic garbage collector is held off (run first if ``collect``). Collecting an
    object that owns pinned host memory (an old layer's buffers) makes torch record a CUDA event on
    the stream that last used that memory, and an event recorded on the legacy default stream while
    another stream captures invalidates the capture (seen as ``cudaErrorStreamCaptureInvalidated``
    in 2 of ~30 captures)."""
    if collect:
        gc.collect()
    gc_was_on = gc.isenabled()
    gc.disable()
    prev = getattr(_capture, "log", None)
    _capture.log = log
    try:
        yield log
    finally:
        _capture.log = prev
        if gc_was_on:
            gc.enable()


class StreamBridge:
    """Stream-ordered CPU calls of one layer; channels "now" and "deferred" run independently."""

    def __init__(self, cpu_moe, device, mode: str = "auto"):
        from ..gpu_ops.stream_sync import CpuSignal

        self.cpu = cpu_moe
        self.on_cpu_time = None  # callable(t, k, seconds), called from the service thread
        self.device = torch.device(device)
        self.channels = {name: _Channel(CpuSignal(mode, self.device)) for name in ("now", "deferred")}

    def _buffers(self, ch: _Channel, t: int, k: int, x_dtype) -> None:
        """Pinned host buffers in the driver's own dtypes (x and out bf16 or fp32, ids int64,
        weights fp32; the copies convert), so the CPU side reads them in place."""
        h = self.cpu.hidden
        if ch.h_x is None or ch.h_x.shape[0] < t or ch.h_ids.shape[1] != k or ch.x_dtype != x_dtype:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("HybridMoE: run one eager forward of the same shape before capturing")
            cap = max(t, 16)
            host = x_dtype if x_dtype in (torch.bfloat16, torch.float32) else torch.float32
            ch.h_x = torch.empty((cap, h), dtype=host, pin_memory=True)
            ch.h_ids = torch.empty((cap, k), dtype=torch.int64, pin_memory=True)
            ch.h_w = torch.empty((cap, k), dtype=torch.float32, pin_memory=True)
            ch.h_out = torch.empty((cap, h), dtype=host, pin_memory=True)
            ch.d_out = torch.empty((cap, h), dtype=x_dtype, device=self.device)
            ch.x_dtype = x_dtype
            ch.np_views = tuple(_np_view(a) for a in (ch.h_x, ch.h_ids, ch.h_w, ch.h_out))

    def start(self, x, topk_ids, topk_weights, gpu_mask, slot: str = "now") -> _Job:
        service.raise_pending()
        ch = self.channels[slot]
        t, k = topk_ids.shape
        self._buffers(ch, t, k, x.dtype)
        stream = torch.cuda.current_stream(self.device)
        ch.h_x[:t].copy_(x, non_blocking=True)
        ch.h_ids[:t].copy_(topk_ids, non_blocking=True)
        ch.h_w[:t].copy_(topk_weights, non_blocking=True)
        ch.signal.signal_start(stream)
        job = _Job(self, ch, t, None if gpu_mask is None else gpu_mask.copy())
        log = getattr(_capture, "log", None)
        if torch.cuda.is_current_stream_capturing():
            if log is None:
                raise RuntimeError("capture hybrid MoE layers with kt.layer.GraphRunner (the CPU part "
                                   "needs its calls replayed)")
            log.append(job)
        else:
            service.submit([job])
        return job

    def finish(self, job: _Job) -> torch.Tensor:
        ch, t = job.channel, job.t
        stream = torch.cuda.current_stream(self.device)
        ch.signal.wait_done(stream)
        out = ch.d_out[:t]
        out.copy_(ch.h_out[:t], non_blocking=True)
        return out


class GraphRunner:
    """Capture a step that calls hybrid MoE layers into a CUDA graph, and replay it.

        runner = GraphRunner()
        with runner.capture():
            y = step(x)            # eager-warm the same shapes first
        runner.replay()            # re-runs the step (CPU parts included) on new contents of x
    """

    def __init__(self, pool=None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.log: list[_Job] = []

    @contextlib.contextmanager
    def capture(self, stream=None):
        """Capture context: the step's CPU jobs are logged for replay and the garbage collector is
        run first and held off meanwhile (``logging_jobs``)."""
        with logging_jobs(self.log), torch.cuda.graph(self.graph, pool=self.pool, stream=stream) as g:
            yield g

    def replay(self) -> None:
        service.raise_pending()
        service.submit(list(self.log))
        self.graph.replay()
