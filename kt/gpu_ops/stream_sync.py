"""Ordering CPU work on a CUDA stream with no host synchronisation, capturable in CUDA graphs.

A `CpuSignal` holds two 32-bit flags, "start" and "done", in pinned (host-mapped) memory:

    GPU stream:  ... D2H of the inputs ... signal_start(stream) ... GPU work ... wait_done(stream) ... H2D
    CPU worker:  wait_start()  ->  compute  ->  set_done()

- signal_start(stream) enqueues "start = 1"; the worker's wait_start() spins until it sees 1 and clears
  it back to 0, then computes; set_done() stores "done = 1"; wait_done(stream) enqueues "block the
  stream until done >= 1, then done = 0". Every enqueued value is a constant and each side resets the
  flag it consumes, so a captured graph works for every replay.
- Two mechanisms (see ../shared/notes/cuda-stream-cpu-sync.md): "memop" uses the stream memory
  operations cuStreamWriteValue32 / cuStreamWaitValue32 on the flags' device-mapped address (no
  callback thread; the cheaper one); "hostfunc" enqueues cuLaunchHostFunc callbacks, Numba @cfunc
  functions that store / spin on the flags without Python or the GIL. mode="auto" picks memop when a
  probe of it works on this device.
- Flag accesses are atomic (acquire loads, release stores), so the worker's writes to its output
  buffers are visible before "done". Numba workers use `start_address` / `done_address` with
  `spin_wait_clear` and `store_flag` (nogil) directly.

libcuda (ctypes) and the Numba callbacks are loaded at first use; on a host without CUDA, creating a
`CpuSignal` raises `CudaUnavailableError`.
"""
from __future__ import annotations

import ctypes
import threading
import time
from functools import lru_cache

__all__ = ["CpuSignal", "CudaUnavailableError", "spin_wait_clear", "store_flag", "load_flag"]

# CUDA driver enums (cuda.h)
_CU_STREAM_WAIT_VALUE_GEQ = 0x0
_CU_STREAM_WRITE_VALUE_DEFAULT = 0x0  # with a memory fence before the write

_FLAG_STRIDE = 16  # int32 elements between the two flags: separate 64-byte cache lines


class CudaUnavailableError(RuntimeError):
    """No CUDA device or driver: stream-ordered CPU signalling cannot run on this host."""


# ----------------------------------------------------------------------------- libcuda

class _Driver:
    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaUnavailableError(f"CpuSignal needs the CUDA driver (libcuda.so.1): {e}") from None
        L = self.lib
        u64, u32, vp, i32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int
        self.write32 = self._fn(("cuStreamWriteValue32_v2", "cuStreamWriteValue32"), [vp, u64, u32, ctypes.c_uint])
        self.wait32 = self._fn(("cuStreamWaitValue32_v2", "cuStreamWaitValue32"), [vp, u64, u32, ctypes.c_uint])
        self.host_get_dptr = self._fn(("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"),
                                      [ctypes.POINTER(u64), vp, ctypes.c_uint])
        self.launch_host_func = self._fn(("cuLaunchHostFunc",), [vp, vp, vp])
        self.get_error_name = L.cuGetErrorName
        self.get_error_name.argtypes = [i32, ctypes.POINTER(ctypes.c_char_p)]

    def _fn(self, names, argtypes):
        for n in names:
            f = getattr(self.lib, n, None)
            if f is not None:
                f.argtypes = argtypes
                f.restype = ctypes.c_int
                return f
        raise CudaUnavailableError(f"libcuda.so.1 lacks {names[0]}: the CUDA driver is too old")

    def check(self, rc: int, what: str):
        if rc != 0:
            name = ctypes.c_char_p()
            self.get_error_name(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: CUDA error {rc} ({(name.value or b'?').decode()})")


@lru_cache(maxsize=None)
def _driver() -> _Driver:
    return _Driver()


# ----------------------------------------------------------------------------- atomics (Numba)

@lru_cache(maxsize=None)
def _numba_ops():
    """Compile the atomic flag helpers and the host-function callbacks (once, at first use)."""
    from llvmlite import ir
    from numba import cfunc, njit, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    i32p = ir.IntType(32).as_pointer()

    def _ptr(builder, addr):
        if isinstance(addr.type, ir.PointerType):
            return builder.bitcast(addr, i32p)
        return builder.inttoptr(addr, i32p)

    @intrinsic
    def atomic_load(typingctx, addr):
        def codegen(context, builder, sig, args):
            v = builder.load_atomic(_ptr(builder, args[0]), "acquire", 4)
            return builder.zext(v, ir.IntType(64))
        return types.int64(addr), codegen

    @intrinsic
    def atomic_store(typingctx, addr, value):
        def codegen(context, builder, sig, args):
            v = builder.trunc(args[1], ir.IntType(32))
            builder.store_atomic(v, _ptr(builder, args[0]), "release", 4)
            return context.get_dummy_value()
        return types.void(addr, types.int64), codegen

    @intrinsic
    def cpu_relax(typingctx):
        def codegen(context, builder, sig, args):
            # The x86 spin-wait hint as an LLVM intrinsic (Numba's LLVM has no inline-asm parser).
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.pause"), [])
            return context.get_dummy_value()
        return types.void(), codegen

    @njit(nogil=True, cache=False)
    def spin_wait_clear(addr, max_spins):
        # Spin until *addr == 1, then clear it; False after max_spins pauses (max_spins < 0: forever).
        n = 0
        while atomic_load(addr) != 1:
            cpu_relax()
            n += 1
            if max_spins >= 0 and n >= max_spins:
                return False
        atomic_store(addr, 0)
        return True

    @njit(nogil=True, cache=False)
    def store_flag(addr, value):
        atomic_store(addr, value)

    @njit(nogil=True, cache=False)
    def load_flag(addr):
        return atomic_load(addr)

    # Host-function callbacks: void fn(void *user_data); user_data is the flag's host address.
    sig = types.void(types.voidptr)

    @cfunc(sig, nopython=True, cache=False)
    def start_cb(flag):
        atomic_store(flag, 1)

    @cfunc(sig, nopython=True, cache=False)
    def wait_cb(flag):
        while atomic_load(flag) != 1:
            cpu_relax()
        atomic_store(flag, 0)

    return dict(spin_wait_clear=spin_wait_clear, store_flag=store_flag, load_flag=load_flag,
                start_cb=start_cb, wait_cb=wait_cb)


def spin_wait_clear(addr: int, max_spins: int = -1) -> bool:
    """Spin (nogil) until the int32 flag at host address addr is 1, then set it to 0."""
    return _numba_ops()["spin_wait_clear"](addr, max_spins)


def store_flag(addr: int, value: int) -> None:
    """Atomic release store of an int32 flag at a host address."""
    _numba_ops()["store_flag"](addr, value)


def load_flag(addr: int) -> int:
    """Atomic acquire load of an int32 flag at a host address."""
    return int(_numba_ops()["load_flag"](addr))


# ----------------------------------------------------------------------------- CpuSignal

def _stream_handle(stream) -> int:
    import torch

    if stream is None:
        stream = torch.cuda.current_stream()
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        raise TypeError(f"stream must be a torch.cuda.Stream, a raw CUstream int or None, got {type(stream).__name__}")
    return int(handle)


class CpuSignal:
    """A "start" / "done" pair of flags ordering one CPU task at a time on a CUDA stream.

    mode: "auto" (memop if it works on this device, else hostfunc), "memop" or "hostfunc".
    device: the CUDA device (default: the current one).
    """

    MODES = ("auto", "memop", "hostfunc")

    def __init__(self, mode: str = "auto", device=None):
        if mode not in self.MODES:
            raise ValueError(f"CpuSignal: mode must be one of {self.MODES}, got {mode!r}")
        import torch

        if not torch.cuda.is_available():
            raise CudaUnavailableError(
                "CpuSignal needs a CUDA GPU and driver; this host has none (torch.cuda.is_available() is "
                "False). Without a GPU, run the CPU experts through the CPU pool's submit()/wait().")
        self._drv = _driver()
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None
                                   else torch.device(device).index or 0)
        with torch.cuda.device(self.device):
            torch.cuda.current_stream().synchronize()  # makes the primary context current here
            self._flags = torch.zeros(2 * _FLAG_STRIDE, dtype=torch.int32, pin_memory=True)
        self.start_address = self._flags.data_ptr()
        self.done_address = self.start_address + 4 * _FLAG_STRIDE
        self._lock = threading.Lock()
        self._dptr = {}
        if mode == "auto":
            mode = "memop" if self._probe_memop() else "hostfunc"
        elif mode == "memop":
            self._device_ptrs()
        self.mode = mode
        if mode == "hostfunc":
            ops = _numba_ops()
            self._start_cb, self._wait_cb = ops["start_cb"].address, ops["wait_cb"].address

    # -- GPU side (enqueue on a stream; capturable) -----------------------------------------------
    def signal_start(self, stream=None) -> None:
        """Enqueue "start = 1" on the stream (default: the current stream), after its prior work."""
        s = _stream_handle(stream)
        if self.mode == "memop":
            self._drv.check(self._drv.write32(s, self._device_ptrs()[0], 1, _CU_STREAM_WRITE_VALUE_DEFAULT),
                            "cuStreamWriteValue32(start)")
        else:
            self._drv.check(self._drv.launch_host_func(s, self._start_cb, self.start_address),
                            "cuLaunchHostFunc(start)")

    def wait_done(self, stream=None) -> None:
        """Enqueue "wait until done == 1, then done = 0": later work on the stream sees the CPU result."""
        s = _stream_handle(stream)
        if self.mode == "memop":
            done = self._device_ptrs()[1]
            self._drv.check(self._drv.wait32(s, done, 1, _CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32(done)")
            self._drv.check(self._drv.write32(s, done, 0, _CU_STREAM_WRITE_VALUE_DEFAULT),
                            "cuStreamWriteValue32(done reset)")
        else:
            self._drv.check(self._drv.launch_host_func(s, self._wait_cb, self.done_address),
                            "cuLaunchHostFunc(wait)")

    # -- CPU side (the worker) ------------------------------------------------------------------
    def wait_start(self, timeout: float | None = None) -> bool:
        """Block (spinning, GIL released) until the stream reached signal_start; clears "start".

        Returns False if timeout seconds passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if spin_wait_clear(self.start_address, 200_000):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def set_done(self) -> None:
        """Publish the CPU result: the stream's wait_done may go on (release store of "done = 1")."""
        store_flag(self.done_address, 1)

    @property
    def flags(self) -> tuple[int, int]:
        """(start, done) as they are now (for tests and debugging)."""
        return load_flag(self.start_address), load_flag(self.done_address)

    # -- internals --------------------------------------------------------------------------------
    def _device_ptrs(self) -> tuple[int, int]:
        with self._lock:
            if not self._dptr:
                out = []
                for addr in (self.start_address, self.done_address):
                    d = ctypes.c_uint64()
                    self._drv.check(self._drv.host_get_dptr(ctypes.byref(d), ctypes.c_void_p(addr), 0),
                                    "cuMemHostGetDevicePointer")
                    out.append(d.value)
                self._dptr = tuple(out)
            return self._dptr

    def _probe_memop(self) -> bool:
        """Run the memop protocol once on a private stream; False if the driver refuses it."""
        import torch

        try:
            start, done = self._device_ptrs()
            store_flag(self.done_address, 1)
            s = torch.cuda.Stream(self.device)
            h = _stream_handle(s)
            self._drv.check(self._drv.write32(h, start, 1, 0), "probe write")
            self._drv.check(self._drv.wait32(h, done, 1, _CU_STREAM_WAIT_VALUE_GEQ), "probe wait")
            self._drv.check(self._drv.write32(h, done, 0, 0), "probe reset")
            s.synchronize()
            ok = self.flags == (1, 0)
        except RuntimeError:
            ok = False
        store_flag(self.start_address, 0)
        store_flag(self.done_address, 0)
        return ok

    def __repr__(self):
        return f"CpuSignal(mode={self.mode!r}, device={self.device})"
