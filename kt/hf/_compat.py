"""The one place kt imports Hugging Face transformers (lazily, with a clear error)."""
from __future__ import annotations

import importlib

# transformers 5 stores the routed experts of every supported family as one module holding fused
# 3-D weights (gate_up_proj [E, 2I, H], down_proj [E, H, I]) called as experts(x, ids, weights);
# kt replaces that module. transformers 4 kept a ModuleList of per-expert MLPs and routed inside
# the block's forward, which kt does not patch.
MIN_TRANSFORMERS = (5, 0)

_INSTALL_HINT = "pip install 'kt[hf]'"


def _parse_version(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def require_transformers():
    """Import and return the transformers module, or raise ImportError naming the extra."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as exc:
        raise ImportError(
            f"kt.hf needs Hugging Face transformers (>= {'.'.join(map(str, MIN_TRANSFORMERS))}), "
            f"which is not installed: {_INSTALL_HINT}") from exc
    found = _parse_version(getattr(transformers, "__version__", "0"))
    if found < MIN_TRANSFORMERS:
        raise ImportError(
            f"kt.hf needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} (fused expert "
            f"modules), found {transformers.__version__}: {_INSTALL_HINT} or pip install -U transformers")
    return transformers


def require_tokenizers():
    try:
        return importlib.import_module("tokenizers")
    except ImportError as exc:
        raise ImportError(f"building a tokenizer needs the `tokenizers` package: {_INSTALL_HINT}") from exc
