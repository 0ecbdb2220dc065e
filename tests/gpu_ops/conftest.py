"""Fixtures for kt.gpu_ops tests.

With CUDA the kernel cases run in this process on the GPU. Without it they run under Triton's
interpreter, which must be switched on (TRITON_INTERPRET=1) before triton itself is first imported:
so they run in one spawned worker process that starts with that variable set, and this pytest
process and the other tests in it are left as they were.
"""
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


class _InProcess:
    device = "cuda"

    def __call__(self, fn, *args, **kwargs):
        return fn("cuda", *args, **kwargs)


class _Interpreter:
    device = "cpu"

    def __init__(self):
        saved = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "PYTHONPATH")}
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in sys.path if p])
        try:
            self.pool = ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn"))
            self.pool.submit(os.getpid).result()  # start the worker while the variables are set
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def __call__(self, fn, *args, **kwargs):
        return self.pool.submit(fn, "cpu", *args, **kwargs).result()


@pytest.fixture(scope="session")
def run_case():
    """run_case(fn, *args): fn(device, *args) on the GPU, or in the interpreter worker on the CPU."""
    pytest.importorskip("triton", reason="kt.gpu_ops needs triton")
    if torch.cuda.is_available():
        yield _InProcess()
        return
    runner = _Interpreter()
    yield runner
    runner.pool.shutdown()
