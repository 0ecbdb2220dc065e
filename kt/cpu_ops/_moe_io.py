"""CPUMoE's inputs and outputs: torch or numpy arrays in, the driver's numpy operands out, and
the result handed back in the caller's type. Legend: T tokens, E experts, K top-k, H hidden size,
I expert intermediate size.
"""
from __future__ import annotations

import numpy as np

from ..config import GROUP_SIZES, QuantScheme
from .driver.layout import id_range
from .packing import PackedWeight, pack
from . import _align


def _is_torch(a) -> bool:
    return type(a).__module__.startswith("torch") and hasattr(a, "detach")


def _torch_cpu(name: str, a):
    """A torch tensor's data on the CPU without autograd (no copy if it is there already), or a
    clear error for a meta tensor. Written with the cheap attribute reads (``is_cpu``,
    ``requires_grad``): a decode call does this for four tensors, and ``.device.type`` and an
    unneeded ``detach()`` cost ~0.5 us each."""
    if a.is_meta:
        raise ValueError(f"{name} is a meta tensor (it has no data)")
    if a.requires_grad:
        a = a.detach()
    return a if a.is_cpu else a.cpu()


def _to_numpy_2d(name: str, a, dtypes: tuple[str, ...]):
    """-> (numpy array, kind) with kind 'f32' or 'bf16' (uint16 bit patterns)."""
    if _is_torch(a):
        import torch

        if a.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(a.shape)}")
        t = _torch_cpu(name, a)
        if t.dtype is torch.bfloat16:
            if not t.is_contiguous():
                t = t.contiguous()
            return t.view(torch.int16).numpy().view(np.uint16), "bf16"
        if t.dtype is torch.float32 and t.is_contiguous():
            return t.numpy(), "f32"
        if t.dtype in (torch.float16, torch.float32, torch.float64):
            return np.ascontiguousarray(t.to(torch.float32).numpy()), "f32"
        raise TypeError(f"{name} must be bf16, fp16 or fp32, got {t.dtype}")
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(a).__name__}")
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {a.shape}")
    if a.dtype not in (np.float32, np.float16, np.float64):
        raise TypeError(f"{name} must be float32/float16 (numpy), got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32), "f32"


def _routing_np(name: str, a) -> np.ndarray:
    """A routing argument (torch or numpy) as numpy, without a copy where it can."""
    if type(a) is np.ndarray:
        return a
    if _is_torch(a):
        import torch

        t = _torch_cpu(name, a)
        return t.float().numpy() if t.dtype is torch.bfloat16 else t.numpy()
    if isinstance(a, np.ndarray):
        return a
    raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(a).__name__}")


def _routing(name_ids, ids, name_w, w, T, E):
    ids_np = _routing_np(name_ids, ids)
    w_np = _routing_np(name_w, w)
    if ids_np.ndim != 2 or ids_np.shape[0] != T:
        raise ValueError(f"{name_ids} must be [T={T}, K], got shape {ids_np.shape}")
    if ids_np.dtype.kind not in "iu":
        raise TypeError(f"{name_ids} must hold integers, got {ids_np.dtype}")
    if w_np.shape != ids_np.shape:
        raise ValueError(f"{name_w} must have the shape of {name_ids} {ids_np.shape}, got {w_np.shape}")
    if w_np.dtype.kind != "f":
        raise TypeError(f"{name_w} must be floating point, got {w_np.dtype}")
    ids64 = np.ascontiguousarray(ids_np, dtype=np.int64)
    if ids64.size:
        lo, hi = id_range(ids64)
        if lo < -1 or hi >= E:
            raise ValueError(f"{name_ids} must be in [-1, {E}) (-1 = skip), got values in [{lo}, {hi}]")
    return ids64, np.ascontiguousarray(w_np, dtype=np.float32)


def _as_stack(name: str, a, ndim: int = 3) -> np.ndarray | object:
    if _is_torch(a):
        if a.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(a.shape)}")
        if str(a.dtype) not in ("torch.bfloat16", "torch.float16", "torch.float32"):
            raise TypeError(f"{name} must be bf16, fp16 or fp32, got {a.dtype}")
        return a
    if isinstance(a, np.ndarray):
        if a.ndim != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
        if a.dtype not in (np.float32, np.float16, np.float64):
            raise TypeError(f"{name} must be float32/float16, got {a.dtype}")
        return a
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(a).__name__}")


def _f32(a) -> np.ndarray:
    if _is_torch(a):
        return a.detach().cpu().float().numpy()
    return np.asarray(a, dtype=np.float32)


def _pack_stack(mats, e_count, scheme, group_size) -> PackedWeight:
    """Pack expert matrices one by one into preallocated stacks (no [E, N, D] fp32 copy)."""
    first = None
    for e in range(e_count):
        p = pack(mats(e), scheme, group_size)
        if first is None:
            first = p
            data = _align.empty((e_count,) + p.data.shape, p.data.dtype)
            scale = _align.empty((e_count,) + p.scale.shape, p.scale.dtype)
            wsum = _align.empty((e_count,) + p.wsum.shape, p.wsum.dtype)
        data[e] = p.data
        scale[e] = p.scale
        wsum[e] = p.wsum
    return PackedWeight(scheme, first.n, first.d, first.n_pad, first.d_pad, first.group_size,
                        data, scale, wsum)


def _check_group_size(group_size, scheme: QuantScheme) -> int:
    """group_size as an int (a float or bool is a TypeError), one of GROUP_SIZES for INT4."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__} {group_size!r}")
    if scheme is QuantScheme.INT4 and group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES} for INT4, got {group_size}")
    return int(group_size)


def _at(a, tensor, tdt, ndt, shape) -> int:
    """The data address of ``a`` if it is a contiguous CPU torch tensor of dtype ``tdt`` or a
    C-contiguous numpy array of dtype ``ndt``, of this (non-empty) shape; else 0."""
    if type(a) is tensor:
        ok = a.dtype is tdt and a.shape == shape and a.is_cpu and a.is_contiguous()
        return a.data_ptr() if ok else 0
    if type(a) is np.ndarray:
        return a.ctypes.data if a.dtype == ndt and a.shape == shape and a.flags.c_contiguous else 0
    return 0


def _direct_out(out, T, H, okind):
    """The numpy array the driver can write into directly for ``out``, or None."""
    if _is_torch(out):
        if tuple(out.shape) != (T, H):
            raise ValueError(f"out must be [T, H] = {(T, H)}, got {tuple(out.shape)}")
        if out.device.type != "cpu" or not out.is_contiguous():
            return None
        import torch

        if okind == "bf16" and out.dtype == torch.bfloat16:
            return out.view(torch.int16).numpy().view(np.uint16)
        if okind == "f32" and out.dtype == torch.float32:
            return out.numpy()
        return None
    if isinstance(out, np.ndarray):
        if out.shape != (T, H):
            raise ValueError(f"out must be [T, H] = {(T, H)}, got {out.shape}")
        if okind == "f32" and out.dtype == np.float32 and out.flags.c_contiguous and out.flags.writeable:
            return out
        return None
    raise TypeError(f"out must be a torch.Tensor or numpy.ndarray, got {type(out).__name__}")


def _out_init(out, T, H, okind):
    if _is_torch(out):
        import torch

        t = out.detach().cpu()
        if okind == "bf16":
            return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
        return t.float().numpy()
    if okind == "bf16":
        from ..reference import f32_to_bf16_bits

        return f32_to_bf16_bits(np.asarray(out, np.float32))
    return np.asarray(out, np.float32)


def _finish_out(ob, out, direct, x, torch_in, xkind, okind):
    if direct:
        return out
    if torch_in:
        import torch

        if okind == "bf16":
            res = torch.from_numpy(ob.view(np.int16)).view(torch.bfloat16)
        else:
            res = torch.from_numpy(ob).to(x.dtype)
        if not x.is_cpu:
            res = res.to(x.device)
    else:
        res = ob if x.dtype == np.float32 else ob.astype(x.dtype)
    if out is not None:
        if _is_torch(out):
            import torch

            out.copy_(res if _is_torch(res) else torch.from_numpy(np.asarray(res)))
        else:
            out[...] = res
        return out
    return res
