"""kt.gpu_ops.stream_sync on the CPU: the atomic flag helpers and host-function callbacks (called
directly, as the driver would), the worker-side protocol with a thread, and the clear error without
CUDA. The stream side (memops, host functions in CUDA graphs) runs in benchmarks/bench_gpu.py on the
device machine.
"""
import ctypes
import threading

import numpy as np
import pytest
import torch

from kt.gpu_ops import stream_sync as ss


def test_flag_helpers_roundtrip():
    flags = np.zeros(32, np.int32)
    a = flags.ctypes.data
    assert ss.load_flag(a) == 0
    ss.store_flag(a, 1)
    assert flags[0] == 1 and ss.load_flag(a) == 1
    assert ss.spin_wait_clear(a, 10) is True and flags[0] == 0
    assert ss.spin_wait_clear(a, 1000) is False and flags[0] == 0  # gives up, flag untouched


def test_host_callbacks_as_the_driver_calls_them():
    ops = ss._numba_ops()
    cb_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    start_cb = cb_type(ops["start_cb"].address)
    wait_cb = cb_type(ops["wait_cb"].address)
    flags = np.zeros(32, np.int32)
    start, done = flags.ctypes.data, flags.ctypes.data + 64
    start_cb(start)
    assert flags[0] == 1
    # wait_cb blocks until a worker stores done = 1, then resets it.
    t = threading.Thread(target=lambda: wait_cb(done))
    t.start()
    t.join(0.2)
    assert t.is_alive(), "wait callback returned before done was set"
    ss.store_flag(done, 1)
    t.join(5)
    assert not t.is_alive() and flags[16] == 0


def test_worker_protocol_with_a_thread():
    # The stream's role played by this thread: set start, wait for done, many rounds.
    flags = np.zeros(32, np.int32)
    start, done = flags.ctypes.data, flags.ctypes.data + 64
    data = np.zeros(4, np.float64)
    rounds = 50

    def worker():
        for i in range(rounds):
            assert ss.spin_wait_clear(start, 50_000_000)
            data[:] = i * 2.0
            ss.store_flag(done, 1)

    th = threading.Thread(target=worker)
    th.start()
    for i in range(rounds):
        ss.store_flag(start, 1)
        assert ss.spin_wait_clear(done, 50_000_000), f"round {i}: worker never finished"
        assert np.all(data == i * 2.0)
    th.join(5)
    assert flags[0] == 0 and flags[16] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
def test_cpu_signal_without_cuda_is_a_clear_error():
    with pytest.raises(ss.CudaUnavailableError, match="needs a CUDA GPU"):
        ss.CpuSignal()


def test_cpu_signal_bad_mode():
    with pytest.raises(ValueError, match="mode must be one of"):
        ss.CpuSignal(mode="callback")
