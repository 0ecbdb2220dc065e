"""What the kt MoE layers of one SGLang process share: the CPU pool, the placement, the deferral
chain, the routing-statistics recorder, the dynamic placer, the one start-up log line."""
from __future__ import annotations

import atexit
import logging
import threading

from ._flags import KTOptions, ModelInfo, resolve_placement

logger = logging.getLogger("kt.sglang_hook")

__all__ = ["proc"]


class _Process:
    def __init__(self):
        self.lock = threading.Lock()
        self.pool = None
        self.placement = None
        self.placement_key = None
        self.chain = None
        self.stats = None
        self.logged = False
        self.placer = None
        self.methods: dict = {}  # layer id -> KTMoEMethod, for dynamic updates
        self.replacements = 0

    def get_pool(self, opts: KTOptions):
        with self.lock:
            if self.pool is None:
                from ._cpu import make_pool

                self.pool = make_pool(opts)
            return self.pool

    def get_placement(self, opts: KTOptions, model: ModelInfo, expert_bytes: int):
        key = (tuple(sorted(opts.to_dict().items(), key=lambda kv: kv[0])).__repr__(), model, expert_bytes)
        with self.lock:
            if self.placement is None or self.placement_key != key:
                self.placement = resolve_placement(opts, model, expert_bytes)
                self.placement_key = key
            return self.placement

    def get_chain(self):
        from ..layer import DeferredChain

        with self.lock:
            if self.chain is None:
                self.chain = DeferredChain()
            return self.chain

    def get_placer(self, placement):
        from ..placement import DynamicPlacer

        with self.lock:
            if self.placer is None:
                self.placer = DynamicPlacer(placement.shape, initial=placement)
            return self.placer

    def maybe_replace(self) -> None:
        """After the last MoE layer: ask the policy; on a new placement, every layer copies its newly
        hot experts into their GPU slots (on the forward's stream, so later forwards see them)."""
        new = self.placer.poll()
        if new is None:
            return
        moved = 0
        for m in self.methods.values():
            moved += m.adopt(new)
        self.replacements += 1
        logger.info("kt: dynamic expert update %d: %d experts moved to the GPU", self.replacements, moved)

    def get_stats(self, path: str, model: ModelInfo):
        from ..placement import ExpertStats

        with self.lock:
            if self.stats is None:
                self.stats = ExpertStats(model.num_layers, model.num_experts)
                atexit.register(self._save_stats, path)
            return self.stats

    def _save_stats(self, path: str) -> None:
        try:
            self.stats.save(path)
            logger.info("kt: routing statistics saved to %s", path)
        except Exception as exc:  # noqa: BLE001 - at exit: report, never raise
            logger.warning("kt: could not save routing statistics to %s: %s", path, exc)

    def log_once(self, msg: str, *args) -> None:
        with self.lock:
            if self.logged:
                return
            self.logged = True
        logger.info(msg, *args)


proc = _Process()
