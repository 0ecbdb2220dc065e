"""kt.weights: the kt weight format, the converter (HF safetensors bf16/fp16/fp32/fp8, GGUF) and
the loader. See docs/weight-format.md.

    kt.weights.convert("Qwen3-30B-A3B/", "qwen3-int8/", scheme="int8")
    le = kt.weights.load_experts("qwen3-int8/", layer=3)   # le.w13, le.w2: PackedWeight stacks
"""
from __future__ import annotations

from ._convert import convert, parse_layers, verify
from ._cpu_moe import load_cpu_moe, numa_split
from ._format import FORMAT_VERSION, WeightFormatError
from ._loader import (LoadedExperts, NodeShard, NumaTopology, load_experts, make_shards,
                      shard_ranges)
from ._sources import SourceError

__all__ = ["convert", "verify", "load_experts", "LoadedExperts", "NodeShard", "NumaTopology",
           "load_cpu_moe", "numa_split",
           "make_shards",
           "shard_ranges", "parse_layers", "WeightFormatError", "SourceError", "FORMAT_VERSION"]
