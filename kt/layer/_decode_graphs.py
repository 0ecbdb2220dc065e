"""Eager decode-sized hybrid forwards, replayed from CUDA graphs that the layer captures itself.

An eager hybrid forward at T=1 spends 0.3-0.5 ms of host time (Triton launches, torch ops, and the
stream service thread waiting for the GIL to publish the CPU job) against ~0.2 ms of CPU expert work,
so an eager decode step is bound by Python, not by the experts (`benchmarks/bench_hybrid.py`).
For T <= ``max_tokens`` a ``HybridMoE`` therefore captures its own forward once per call shape and
replays it: three input copies, the captured CPU job handed to the service thread, one graph launch,
one copy of the output. The arithmetic is the eager path's, kernel for kernel, so the output is
bit-identical to it.

- A shape is captured at its second call; the first runs eagerly (compiling the kernels and sizing
  the bridge's pinned buffers, which a capture cannot allocate).
- A layer's graphs are dropped together when what they captured changes: the placement (new GPU
  weights and mask) or the bridge's pinned buffers (reallocated for a larger call). The check runs
  at each call, in the calling thread, so ``update_placement`` from another thread needs no lock
  here. Dropped graphs, and the state they read, are freed only after the streams that replayed
  them have passed the drop point, so no replay in flight loses its memory.
- Not used inside a caller's own capture (``GraphRunner``, SGLang's CUDA graphs: the caller's graph
  then holds the layer's kernels), with deferred experts (a deferral spans two layers' calls), for
  inputs that require grad, or when ``max_tokens`` is 0.
- The graphs of one layer and stream share one memory pool. Only the static output stays allocated
  in it; the intermediates of one graph may share memory with another's, which is safe because one
  stream replays them one after another.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from . import _stream_bridge as sb

__all__ = ["DecodeGraphs"]


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # static inputs, written before each replay
    ids: torch.Tensor
    w: torch.Tensor
    out: torch.Tensor  # static output (in the graph's pool), copied out after each replay
    jobs: list  # the stream-ordered CPU jobs the graph signals, in order
    stream: torch.cuda.Stream


class DecodeGraphs:
    """The captured decode-sized forwards of one layer.

    max_tokens: largest T replayed from a graph (0 = off).
    Counters: ``captures``, ``replays``; ``disabled``: why capturing was given up (None while on).
    """

    def __init__(self, max_tokens: int):
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise ValueError(f"graph_max_tokens must be an int >= 0, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.captures = 0
        self.replays = 0
        self.disabled: str | None = None
        self._entries: dict[tuple, _Entry] = {}
        self._seen: set[tuple] = set()
        self._state: tuple = ()
        self._pools: dict[int, tuple] = {}
        self._side: dict[int, torch.cuda.Stream] = {}
        self._retired: list[tuple] = []  # (events, entries, state) freed once the events pass

    def wanted(self, x: torch.Tensor, uses_chain: bool) -> bool:
        """Whether this call should go through a graph (given it takes the hybrid path)."""
        return (0 < x.shape[0] <= self.max_tokens and self.disabled is None and not uses_chain
                and not x.requires_grad and not torch.cuda.is_current_stream_capturing())

    def _set_state(self, state: tuple) -> None:
        """Drop every graph if ``state`` is not the one they were captured with (compared by
        identity); their memory and the old state are freed once their streams pass this point."""
        if len(state) == len(self._state) and all(a is b for a, b in zip(state, self._state)):
            return
        entries = list(self._entries.values())
        if entries:
            events = []
            for st in {id(e.stream): e.stream for e in entries}.values():
                ev = torch.cuda.Event()
                ev.record(st)
                events.append(ev)
            self._retired.append((events, entries, self._state))
        self._entries.clear()
        self._seen.clear()
        self._pools.clear()
        self._state = state

    def _purge(self) -> None:
        if self._retired:
            self._retired = [r for r in self._retired if not all(ev.query() for ev in r[0])]

    def run(self, state_fn, forward, x, topk_ids, topk_weights) -> torch.Tensor:
        """The layer's output for this call: ``forward(x, ids, w)`` eagerly the first time a shape
        is seen, then replayed from its graph. state_fn() -> the objects the captured forward
        reads (a change drops every graph)."""
        self._purge()
        self._set_state(state_fn())
        st = torch.cuda.current_stream(x.device)
        key = (tuple(x.shape), topk_ids.shape[1], x.dtype, topk_ids.dtype, topk_weights.dtype,
               x.device, st.cuda_stream)
        e = self._entries.get(key)
        if e is None:
            if key not in self._seen:  # first call of this shape: eager, and capture next time
                out = forward(x, topk_ids, topk_weights)
                self._set_state(state_fn())  # it may have sized the bridge's buffers
                self._seen.add(key)
                return out
            e = self._capture(forward, x, topk_ids, topk_weights, st)
            if e is None:
                return forward(x, topk_ids, topk_weights)
            self._entries[key] = e
        e.x.copy_(x)
        e.ids.copy_(topk_ids)
        e.w.copy_(topk_weights)
        sb.service.raise_pending()
        if e.jobs:
            sb.service.submit(list(e.jobs))
        e.graph.replay()
        self.replays += 1
        return e.out.clone()

    def _capture(self, forward, x, topk_ids, topk_weights, st) -> _Entry | None:
        """Capture ``forward`` on static copies of the inputs (on a side stream; nothing runs), or
        give up for good (None, a warning) if the capture fails: the eager path stays correct."""
        dev = x.device
        xs, ids_s, ws = (torch.empty(a.shape, dtype=a.dtype, device=dev) for a in (x, topk_ids, topk_weights))
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        if st.cuda_stream not in self._pools:
            self._pools[st.cuda_stream] = torch.cuda.graph_pool_handle()
        side = self._side.get(idx)
        if side is None:
            side = self._side[idx] = torch.cuda.Stream(dev)
        graph = torch.cuda.CUDAGraph()
        try:
            # no collection first (this runs inside a model's forward); none during the capture
            with sb.logging_jobs([], collect=False) as jobs, torch.cuda.stream(side):
                # thread_local: other threads of the program may use CUDA meanwhile
                graph.capture_begin(pool=self._pools[st.cuda_stream], capture_error_mode="thread_local")
                try:
                    out = forward(xs, ids_s, ws)
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - any failure: stay eager, say why once
            self.disabled = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"kt: capturing a decode-sized hybrid MoE forward failed ({self.disabled}); "
                          "this layer runs eagerly from now on", RuntimeWarning, stacklevel=4)
            return None
        self.captures += 1
        return _Entry(graph, xs, ids_s, ws, out, jobs, st)
