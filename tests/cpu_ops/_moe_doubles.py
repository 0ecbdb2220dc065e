"""Scalar kernels of the kt/cpu_ops/README.md contract: a test double for the MoE driver.

Plain loops over the packed layout, written for clarity, not speed; they let the driver be
tested independently of the ISA kernels (and check that the driver honours the contract).
"""
import numpy as np
from numba import njit


@njit(nogil=True)
def gemm_int8_ref(xq, xs, data, scale, wsum, out, nb0, nb1):
    M = xq.shape[0]
    L = data.shape[1]
    for m in range(M):
        for b in range(nb0, nb1):
            for r in range(16):
                acc = 0
                for j in range(L):
                    for i in range(4):
                        acc += np.int32(xq[m, 4 * j + i]) * np.int32(data[b, j, r, i])
                out[m, 16 * b + r] = xs[m] * scale[16 * b + r] * np.float32(acc)


@njit(nogil=True)
def gemm_int4_ref(xq, xs, data, scale, group_size, out, nb0, nb1):
    M = xq.shape[0]
    half = data.shape[1]  # d_pad / 8
    for m in range(M):
        for b in range(nb0, nb1):
            for r in range(16):
                total = np.float32(0.0)
                acc = 0
                for j in range(half):
                    for i in range(4):
                        byte = np.int32(data[b, j, r, i])
                        acc += np.int32(xq[m, 8 * j + i]) * ((byte & 15) - 8)
                        acc += np.int32(xq[m, 8 * j + 4 + i]) * ((byte >> 4) - 8)
                    k_end = 8 * (j + 1)
                    if k_end % group_size == 0:
                        g = k_end // group_size - 1
                        total += scale[b, g, r] * np.float32(acc)
                        acc = 0
                out[m, 16 * b + r] = xs[m] * total


@njit(nogil=True)
def gemm_bf16_ref(xb, data, out, nb0, nb1):
    M = xb.shape[0]
    L = data.shape[1]
    for m in range(M):
        for b in range(nb0, nb1):
            for r in range(16):
                acc = np.float32(0.0)
                for j in range(L):
                    for i in range(2):
                        xv = (np.uint32(xb[m, 2 * j + i]) << np.uint32(16))
                        wv = (np.uint32(data[b, j, r, i]) << np.uint32(16))
                        acc += _bits(xv) * _bits(wv)
                out[m, 16 * b + r] = acc


@njit(nogil=True, inline="always")
def _bits(u):
    a = np.empty(1, np.uint32)
    a[0] = u
    return a.view(np.float32)[0]


DOUBLES = {"int8": (gemm_int8_ref, gemm_int8_ref), "int4": (gemm_int4_ref, gemm_int4_ref),
           "bf16": (gemm_bf16_ref, gemm_bf16_ref)}
