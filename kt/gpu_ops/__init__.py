"""kt.gpu_ops: the GPU half of kt (Triton fused MoE for the GPU-resident experts, stream/CPU sync).

Importing this package imports torch only: triton is imported at the first kernel launch, and libcuda
and the Numba callbacks at the first use of `CpuSignal`.
"""
from .configs import DirectConfig, MoEConfig, pick_config
from .moe import fused_moe
from .stream_sync import CpuSignal, CudaUnavailableError

__all__ = ["fused_moe", "MoEConfig", "DirectConfig", "pick_config", "CpuSignal", "CudaUnavailableError"]
