"""What every source checkpoint reader hands the converter: one MoE layer's experts, and the error
a source that cannot be converted raises. Both readers (``_sources`` for Hugging Face safetensors,
``_gguf`` for GGUF) import this module, and neither imports the other at module level.

Legend: E experts, H hidden size, I expert intermediate size, L layer index.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ._files import FileFormatError

__all__ = ["SourceError", "LayerExperts", "check_expert_ids"]


class SourceError(FileFormatError):
    """A source checkpoint that cannot be converted (the message names the file/architecture)."""


@dataclass
class LayerExperts:
    """The routed experts of one MoE layer: per-expert matrices as kernel sources.

    ``matrices(e)`` returns (gate [I, H], up [I, H], down [H, I]), each a uint16 (bf16 bits) or
    float32 array: views of the mapped file where the stored dtype allows, else a per-expert
    fp32 temporary (fp16, fp8, GGUF quantised types).
    """

    layer: int
    num_experts: int
    hidden: int
    inter: int
    source_bytes: int
    _get: object = field(repr=False)

    def matrices(self, e: int):
        return self._get(e)


def _ids(ids: list[int], limit: int = 16) -> str:
    shown = ", ".join(map(str, ids[:limit]))
    return f"[{shown}{', ...' if len(ids) > limit else ''}] ({len(ids)})"


def check_expert_ids(where, layer: int, present, configured: int, key: str) -> None:
    """Refuse a layer whose expert ids are not exactly 0 .. configured-1 (``key`` names the
    config field that gave the count), naming the missing and the unexpected ids."""
    have = set(int(e) for e in present)
    missing = sorted(set(range(configured)) - have)
    extra = sorted(have - set(range(configured)))
    if missing or extra:
        found = []
        if missing:
            found.append(f"missing expert ids {_ids(missing)}")
        if extra:
            found.append(f"unexpected expert ids {_ids(extra)}")
        raise SourceError(where, f"experts 0..{configured - 1} ({key} = {configured})",
                          f"layer {layer}: {' and '.join(found)}")
