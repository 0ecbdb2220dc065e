"""GPU copies of experts, made from the CPU's packed weights (the CPU keeps the authoritative copy).

Building hot-expert weights from the CPU's packed layout, rather than from the checkpoint, means the
GPU and the CPU compute with the same quantised values: an expert's output does not depend on where
it runs, up to accumulation order. The unpacking runs on the GPU (the packed bytes are copied over
as they are), so a swap moves only quantised bytes through PCIe.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from ..config import QuantScheme
from ..cpu_ops.packing import PackedWeight

__all__ = ["packed_to_device", "unpack_on_device", "expert_weights", "drop_up_padding", "LayerStaging",
           "pin_host_array", "GPU_WEIGHT_DTYPES"]

GPU_WEIGHT_DTYPES = ("bf16", "int8")


def _unlines(data: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """[S, NB, lines, 16, per] -> [S, n, d] (the inverse of packing's VNNI order)."""
    s, nb, lines, rows, per = data.shape
    return data.permute(0, 1, 3, 2, 4).reshape(s, nb * rows, lines * per)[:, :n, :d]


def packed_to_device(p: PackedWeight, experts, device, dtype: str = "bf16"):
    """Weights of ``experts`` (a list of expert ids) from a stacked PackedWeight onto ``device``.

    Returns (w [S, N, D], scale [S, N] fp32 or None): bf16 values, or int8 values with per-row
    scales (only for the INT8 scheme, whose scales are per row).
    """
    if dtype not in GPU_WEIGHT_DTYPES:
        raise ValueError(f"GPU expert dtype must be one of {GPU_WEIGHT_DTYPES}, got {dtype!r}")
    idx = np.asarray(list(experts), dtype=np.int64)
    if idx.size == 0:
        wdt = torch.int8 if dtype == "int8" else torch.bfloat16
        scale = torch.zeros((0, p.n), dtype=torch.float32, device=device) if dtype == "int8" else None
        return torch.zeros((0, p.n, p.d), dtype=wdt, device=device), scale
    data = torch.from_numpy(np.ascontiguousarray(p.data[idx])).to(device)
    scale = torch.from_numpy(np.ascontiguousarray(p.scale[idx])).to(device) if p.scale.size else None
    return unpack_on_device(p, data, scale, dtype)


def unpack_on_device(p: PackedWeight, data: torch.Tensor, scale: torch.Tensor | None, dtype: str):
    """Packed bytes already on the GPU ([S, NB, lines, 16, per] in p's dtype, and p's scale
    arrays for those S experts) -> (w [S, N, D], per-row scale [S, N] or None)."""
    if dtype not in GPU_WEIGHT_DTYPES:
        raise ValueError(f"GPU expert dtype must be one of {GPU_WEIGHT_DTYPES}, got {dtype!r}")
    n, d = p.n, p.d
    if p.scheme is QuantScheme.INT8:
        q = _unlines(data, n, d)
        row_scale = scale[:, :n]
        if dtype == "int8":
            return q.contiguous(), row_scale.contiguous()
        return (q.float() * row_scale[:, :, None]).to(torch.bfloat16).contiguous(), None
    if dtype == "int8":
        raise ValueError(f"int8 GPU experts need the INT8 CPU scheme (per-row scales), "
                         f"the CPU weights are {p.scheme.value}")
    if p.scheme is QuantScheme.BF16:
        bits = _unlines(data.view(torch.int16), n, d)
        return bits.view(torch.bfloat16).contiguous(), None
    # INT4: byte lines hold k4-rows 2j (low nibble) and 2j+1 (high nibble)
    lo = (data & 0x0F).to(torch.int8) - 8
    hi = (data >> 4).to(torch.int8) - 8
    s, nb, half, rows, per = data.shape
    nib = torch.stack([lo, hi], dim=3).reshape(s, nb, half * 2, rows, per)
    q = _unlines(nib, p.n_pad, p.d_pad).float()
    g = p.group_size
    sc = scale.permute(0, 1, 3, 2).reshape(s, p.n_pad, -1)  # [S, NB, ng, 16] -> [S, n_pad, ng]
    w = (q.reshape(s, p.n_pad, -1, g) * sc[:, :, :, None]).reshape(s, p.n_pad, p.d_pad)
    return w[:, :n, :d].to(torch.bfloat16).contiguous(), None


def drop_up_padding(w13: torch.Tensor, s13: torch.Tensor | None, intermediate: int, up_offset: int):
    """w13 [S, N, H] with gate rows [0, I) and up rows [up_offset, up_offset + I) -> [S, 2I, H]
    (the layout the GPU kernels take: gate rows, then up rows), scales likewise."""
    i, off = intermediate, up_offset
    if off == i:
        return w13, s13
    w13 = torch.cat([w13[:, :i], w13[:, off:off + i]], dim=1).contiguous()
    if s13 is not None:
        s13 = torch.cat([s13[:, :i], s13[:, off:off + i]], dim=1).contiguous()
    return w13, s13


def expert_weights(cpu_moe, experts, device, dtype: str = "bf16"):
    """The GPU weights of ``experts`` (ids, in slot order) of a ``CPUMoE``: (w13 [S, 2I, H],
    w2 [S, H, I], w13 scale [S, 2I] or None, w2 scale [S, H] or None)."""
    w13, s13 = packed_to_device(cpu_moe.w13, experts, device, dtype)
    w2, s2 = packed_to_device(cpu_moe.w2, experts, device, dtype)
    w13, s13 = drop_up_padding(w13, s13, cpu_moe.intermediate, cpu_moe.up_offset)
    return w13, w2, s13, s2


_PINNED: set = set()
PIN_MIN_BYTES = 1 << 20
_PAGE = 4096
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
_CU_MEMHOSTREGISTER_READ_ONLY = 0x08


def pinned_span(a: np.ndarray) -> tuple[int, int]:
    """The byte range [i0, i1) of a C-contiguous array that ``pin_host_array`` page-locks: the
    whole pages inside the array, and only those. A page the array shares with a neighbour (its
    first and last, when the array does not start or end on a page) is never locked: locking it
    would reach into the neighbour, and a copy from a range that starts in locked memory and runs
    past it fails ("invalid argument" on the H200: layer-wise prefill of heap-allocated scale
    arrays next to each other). (0, 0) when the inside is under ``PIN_MIN_BYTES``."""
    base = a.ctypes.data
    p0 = -(-base // _PAGE) * _PAGE
    p1 = (base + a.nbytes) // _PAGE * _PAGE
    if p1 - p0 < PIN_MIN_BYTES:
        return 0, 0
    return p0 - base, p1 - base


def pin_host_array(a: np.ndarray) -> bool:
    """Page-lock the pages inside a C-contiguous numpy array (``pinned_span``) for fast DMA;
    False if there are too few of them (arrays under ~1 MiB stay pageable: at that size DMA speed
    does not matter) or the driver refuses. Copies from such an array go through
    ``copy_host_to_device``, which sends the locked span and the unlocked ends separately.

    Uses the driver API (cuMemHostRegister), whose errors do not linger in the runtime's
    last-error state the way cudaHostRegister's do (torch would raise them at its next launch).
    Only pages wholly inside one array are locked, so two arrays' registrations never overlap.
    """
    import ctypes

    i0, i1 = pinned_span(a)
    if i1 <= i0:
        return False
    key = (a.ctypes.data + i0, a.ctypes.data + i1)
    if key in _PINNED:
        return True
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        reg = lib.cuMemHostRegister_v2
    except (OSError, AttributeError):
        return False
    reg.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    reg.restype = ctypes.c_int
    for flags in (0, _CU_MEMHOSTREGISTER_READ_ONLY):  # read-only: file mappings opened read-only
        rc = reg(ctypes.c_void_p(key[0]), key[1] - key[0], flags)
        if rc in (0, _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED):
            _PINNED.add(key)
            if rc == 0:
                # unlock when the array goes: locked pages stay held by the driver after the
                # memory is freed (layers built one after another in one process, each locking
                # its own copies of the experts, piled up tens of GB of them)
                weakref.finalize(a, _unpin, key).atexit = False
            return True
    return False


def _unpin(key: tuple[int, int]) -> None:
    """Unlock a span ``pin_host_array`` locked (its array is being freed)."""
    import ctypes

    _PINNED.discard(key)
    try:
        unreg = ctypes.CDLL("libcuda.so.1").cuMemHostUnregister
    except (OSError, AttributeError):
        return
    unreg.argtypes = [ctypes.c_void_p]
    unreg.restype = ctypes.c_int
    unreg(ctypes.c_void_p(key[0]))  # an error (a context already gone) leaves nothing to do


def copy_host_to_device(dst: torch.Tensor, a: np.ndarray) -> None:
    """dst[:a.nbytes] (uint8, on a GPU) <- a's bytes, on the current stream, asynchronously from
    the span ``pin_host_array`` locked and through the driver's staging for the rest (the pages
    at the ends, a few KiB at most, or all of an array that is not locked)."""
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    i0, i1 = pinned_span(flat)
    locked = i1 > i0 and (flat.ctypes.data + i0, flat.ctypes.data + i1) in _PINNED
    cuts = (0, i0, i1, flat.size) if locked else (0, flat.size)
    for c0, c1 in zip(cuts[:-1], cuts[1:]):
        if c1 > c0:
            dst[c0:c1].copy_(torch.from_numpy(flat[c0:c1]), non_blocking=True)


_TORCH_DT = {np.dtype(np.int8): torch.int8, np.dtype(np.uint8): torch.uint8,
             np.dtype(np.uint16): torch.int16, np.dtype(np.float32): torch.float32,
             np.dtype(np.int32): torch.int32}


class LayerStaging:
    """GPU buffers that hold one layer's packed experts during layer-wise prefill, double-buffered.

    Shared by every layer on a device (layers run one after another, so two sets of buffers,
    grown to the largest layer, serve them all). Copies run on a copy stream of their own: while
    a layer computes from one set, the experts of the layer that followed it in the previous
    layer-wise pass (its learned successor) are copied into the other set, so PCIe and compute
    overlap from the second pass on. Events order the two streams: the caller's stream waits for
    a set's copy before reading it, and a copy into a set waits until the caller's stream has
    finished with that set (``release``).
    """

    _shared: dict = {}

    def __init__(self, device):
        self.device = torch.device(device)
        self._sets: list[dict[str, torch.Tensor]] = [{}, {}]
        self._free: list = [None, None]  # event: the caller's stream is done with the set
        self._stream = None
        self._cur = 1               # the set the last acquired layer reads
        self._pending = None        # (layer ref, set, ready event): a successor copied ahead
        self._succ: dict = {}       # id(layer) -> (ref(layer), ref(next layer))
        self._last = None           # ref of the last layer that acquired
        self.prefetch_hits = 0      # acquires served by a copy made ahead (diagnostics)

    @classmethod
    def for_device(cls, device) -> "LayerStaging":
        key = str(device)
        if key not in cls._shared:
            cls._shared[key] = cls(device)
        return cls._shared[key]

    def _copy(self, si: int, arrays: dict[str, np.ndarray]):
        """Copy ``arrays`` (pinned host memory) into set ``si`` on the copy stream; returns the
        event that marks the copy's end."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        bufs = self._sets[si]
        cs = self._stream
        if self._free[si] is not None:
            cs.wait_event(self._free[si])
        grow = [n for n, a in arrays.items() if n not in bufs or bufs[n].numel() < a.nbytes]
        if grow:  # the old buffer may still be in use on either stream: let both finish first
            torch.cuda.current_stream(self.device).synchronize()
            cs.synchronize()
            for n in grow:
                bufs[n] = torch.empty(arrays[n].nbytes, dtype=torch.uint8, device=self.device)
        with torch.cuda.stream(cs):
            for n, a in arrays.items():
                copy_host_to_device(bufs[n], a)
        ready = torch.cuda.Event()
        ready.record(cs)
        return ready

    def acquire(self, layer, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The layer's arrays on the GPU (views of a staging set, in their dtypes and shapes),
        ordered before later work on the current stream; call ``release()`` after that work."""
        pend = self._pending
        self._pending = None
        if pend is not None and pend[0]() is layer:
            si, ready = pend[1], pend[2]
            self.prefetch_hits += 1
        else:
            si = 1 - self._cur
            ready = self._copy(si, arrays)
        torch.cuda.current_stream(self.device).wait_event(ready)
        self._cur = si
        last = self._last() if self._last is not None else None
        if last is not None:
            self._succ[id(last)] = (self._last, weakref.ref(layer))
        self._last = weakref.ref(layer)
        bufs = self._sets[si]
        return {n: bufs[n][: a.nbytes].view(_TORCH_DT[a.dtype]).view(a.shape)
                for n, a in arrays.items()}

    def release(self) -> None:
        """The current stream is done with the last acquired set (record after its last use)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._free[self._cur] = ev

    def successor(self, layer):
        """The layer that followed ``layer`` in the previous pass, if it is still alive."""
        ent = self._succ.get(id(layer))
        if ent is None or ent[0]() is not layer:
            return None
        return ent[1]()

    def prefetch(self, layer, arrays: dict[str, np.ndarray]) -> None:
        """Start copying ``layer``'s arrays into the set the last acquired layer does not use."""
        si = 1 - self._cur
        self._pending = (weakref.ref(layer), si, self._copy(si, arrays))
