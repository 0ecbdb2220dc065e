"""kt.gpu_ops: the GPU half of kt (Triton fused MoE for the GPU-resident experts, stream/CPU sync).

Importing this package imports torch only: triton is imported at the first kernel launch, and cupy /
libcuda at the first use of `CpuSignal`.
"""
from .configs import MoEConfig, pick_config
from .moe import fused_moe

__all__ = ["fused_moe", "MoEConfig", "pick_config"]
