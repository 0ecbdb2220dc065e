"""kt-kernel's deferred experts: layer l's deferred part is added to layer l+1's result.

``KTMoEWrapper`` layers are separate objects that only know their ``layer_idx``, so their deferred
work is keyed by layer: layer l takes what layer l-1 left, and work that no next layer took (the
last layer was given d > 0) is finished and dropped when that layer runs again, as kt-kernel does.
"""
from __future__ import annotations

import threading

__all__ = ["LayerKeyedChain"]

_pending: dict[int, object] = {}
_lock = threading.Lock()


class LayerKeyedChain:
    """The ``DeferredChain`` interface (``take``/``put``) for the wrapper layer ``layer_idx``."""

    def __init__(self, layer_idx: int):
        self.layer_idx = layer_idx

    def take(self):
        with _lock:
            return _pending.pop(self.layer_idx - 1, None)

    def put(self, pending) -> None:
        with _lock:
            stale = _pending.pop(self.layer_idx, None)
            _pending[self.layer_idx] = pending
        if stale is not None:
            stale.wait()  # never taken (no next layer ran): finish it, drop it

    def reset(self) -> None:
        with _lock:
            p = _pending.pop(self.layer_idx, None)
        if p is not None:
            p.wait()
