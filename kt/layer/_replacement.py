"""Dynamic re-placement: hot experts swapped into GPU slots from routing statistics, while serving."""
from __future__ import annotations

import threading

__all__ = ["DynamicReplacement"]


class DynamicReplacement:
    """Re-places experts while serving (decode included), driven by a ``kt.placement.DynamicPlacer``.

    Every layer reports its routing to the placer (``placer.observe``, a bincount on the device, no
    host sync); after each forward of the last layer the placer is polled (it reads its statistics
    once every ``every_n_tokens`` tokens). When it returns a new placement, the newly hot experts are
    copied into GPU slots in a background thread and each layer switches atomically
    (``HybridMoE.update_placement``); forwards go on meanwhile with the old placement.

    layers: the model's HybridMoE layers; layer i uses row ``layers[i].layer_idx`` of the placement.
    """

    def __init__(self, layers, placer, *, background: bool = True):
        if not layers:
            raise ValueError("DynamicReplacement needs at least one layer")
        self.layers = list(layers)
        self.placer = placer
        self.background = background
        self._thread: threading.Thread | None = None
        self.updates = 0
        self.errors: list[BaseException] = []
        for layer in self.layers:
            layer.observer = placer
        self.layers[-1].after_forward = self.step

    def step(self) -> bool:
        """Poll the policy; start an update if one is due. True when an update started."""
        if self._thread is not None and self._thread.is_alive():
            return False  # one update at a time; the policy keeps observing meanwhile
        new = self.placer.poll()
        if new is None:
            return False
        if self.background:
            self._thread = threading.Thread(target=self._apply, args=(new,), daemon=True,
                                            name="kt-replace")
            self._thread.start()
        else:
            self._apply(new)
        return True

    def _apply(self, placement) -> None:
        try:
            for layer in self.layers:
                layer.update_placement(placement.gpu_slot[layer.layer_idx])
            self.updates += 1
        except BaseException as exc:  # surfaced by wait()
            self.errors.append(exc)

    def wait(self) -> None:
        """Block until a running update has finished; re-raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
        if self.errors:
            raise RuntimeError(f"expert re-placement failed: {self.errors[0]!r}") from self.errors[0]

    def detach(self) -> None:
        self.wait()
        for layer in self.layers:
            layer.observer = None
            layer.after_forward = None
