"""Argument checks and translations of kt-kernel's ``KTMoEWrapper`` (kt.compat.ktkernel)."""
from __future__ import annotations

import warnings

import numpy as np
import torch

from ..config import QuantScheme

__all__ = ["METHODS", "UNSUPPORTED_METHODS", "int_arg", "method_scheme", "gpu_mask", "check_map",
           "tensor_arg", "numa_split"]

# kt-kernel method name -> (kt scheme, INT4 group size)
METHODS = {
    "AMXINT8": (QuantScheme.INT8, 0),
    "MOE_INT8": (QuantScheme.INT8, 0),
    "AMXINT4": (QuantScheme.INT4, 64),
    "MOE_INT4": (QuantScheme.INT4, 64),
    "BF16": (QuantScheme.BF16, 0),
}
UNSUPPORTED_METHODS = ("FP8", "FP8_PERCHANNEL", "RAWINT4", "GPTQ_INT4", "LLAMAFILE")


def int_arg(name: str, v, low: int = 1) -> int:
    """v as an int >= low (a bool, a float or a string is refused)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
        what = "a positive int" if low == 1 else f"an int >= {low}"
        raise ValueError(f"{name} must be {what}, got {v!r}")
    return int(v)


def method_scheme(method) -> tuple[str, QuantScheme, int]:
    """kt-kernel's method name -> (its canonical name, kt's scheme, INT4 group size)."""
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {type(method).__name__}")
    key = method.strip().upper()
    if key not in METHODS:
        what = "is not supported by kt" if key in UNSUPPORTED_METHODS else "is not a kt-kernel method"
        raise ValueError(f"method={method!r} {what}; supported: {sorted(METHODS)} (convert fp8/GGUF "
                         f"checkpoints with `kt convert` and use AMXINT8, AMXINT4 or BF16)")
    return (key,) + METHODS[key]


def _np(a, name: str) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    if isinstance(a, np.ndarray):
        return a
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(a).__name__}")


def gpu_mask(mask, num_gpu_experts, e: int) -> np.ndarray:
    """The experts the caller computes on the GPU, bool [E]: ``gpu_experts_mask`` and/or the first
    ``num_gpu_experts`` ids (upstream SGLang's form)."""
    out = np.zeros(e, bool)
    if mask is not None:
        gm = _np(mask, "gpu_experts_mask")
        if gm.shape != (e,):
            raise ValueError(f"gpu_experts_mask must be bool [num_experts={e}], got shape {gm.shape}")
        if gm.dtype != np.bool_:
            raise TypeError(f"gpu_experts_mask must be bool, got {gm.dtype}")
        out |= gm
    if num_gpu_experts is not None:
        if isinstance(num_gpu_experts, bool) or not isinstance(num_gpu_experts, (int, np.integer)) \
                or not 0 <= num_gpu_experts <= e:
            raise ValueError(f"num_gpu_experts must be an int in [0, {e}], got {num_gpu_experts!r}")
        out[: int(num_gpu_experts)] = True
    return out


def check_map(p2l, e: int) -> np.ndarray | None:
    """physical_to_logical_map as int64 [E] with values in [0, E), or None."""
    if p2l is None:
        return None
    m = _np(p2l, "physical_to_logical_map")
    if m.ndim != 1 or not np.issubdtype(m.dtype, np.integer):
        raise ValueError(f"physical_to_logical_map must be a 1-D int array, got {m.dtype} {m.shape}")
    if m.size and (m.min() < 0 or m.max() >= e):
        raise ValueError(f"physical_to_logical_map values must be in [0, {e}), got [{m.min()}, {m.max()}]")
    if m.shape != (e,):
        raise ValueError(f"physical_to_logical_map must have num_experts={e} entries, got {m.size}")
    return m.astype(np.int64)


def tensor_arg(name: str, a, shape: tuple, layout: str) -> torch.Tensor:
    """A weight stack as a torch tensor of ``shape`` (numpy arrays are wrapped, not copied)."""
    if isinstance(a, np.ndarray):
        a = torch.from_numpy(a)
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray [{layout}], got "
                        f"{type(a).__name__}")
    if tuple(a.shape) != shape:
        raise ValueError(f"{name} must be [{layout}] = {shape}, got {tuple(a.shape)}")
    return a


def numa_split(moe, threadpool_count: int, numa_nodes, threads):
    """kt-kernel's ``threadpool_count`` > 1 (one sub-pool per NUMA node): ``moe`` split across
    that many nodes (``kt.NumaMoE``; ``numa_nodes`` picks which) when this process has them; with
    fewer nodes, a warning and ``moe`` itself."""
    if threadpool_count <= 1:
        return moe
    from ..cpu_ops.runtime import pool
    from ..weights import numa_split as split

    nodes = pool.numa_nodes()
    if numa_nodes is not None:
        want = [int(n) for n in numa_nodes]
        missing = [n for n in want if n not in nodes]
        if missing:
            raise ValueError(f"numa_nodes {missing} are not NUMA nodes of this process "
                             f"(it has {sorted(nodes)})")
        nodes = {n: nodes[n] for n in want}
    if len(nodes) < threadpool_count:
        warnings.warn(f"KTMoEWrapper: threadpool_count={threadpool_count} but this process "
                      f"has {len(nodes)} NUMA node(s); using one thread pool", stacklevel=4)
        return moe
    keys = sorted(nodes)[:threadpool_count]
    per = None if threads is None else max(1, threads // len(keys))
    return split(moe, nodes={k: nodes[k] for k in keys}, threads_per_node=per)
