"""XXH64 (the xxHash 64-bit hash, seed 0) in portable scalar Numba code, for file checksums.

Four independent 64-bit lanes per 32-byte stripe keep the multiplier busy: ~3x the speed of
zlib's CRC-32 per core, so verifying a layer file runs near memory bandwidth. ``nogil``: the
checksum hashes chunks of a file on several threads.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..cpu_ops.cache import prefer_512_bit_vectors

prefer_512_bit_vectors()  # before Numba's first compile (kt.cpu_ops.cache explains)

P1 = np.uint64(0x9E3779B185EBCA87)
P2 = np.uint64(0xC2B2AE3D27D4EB4F)
P3 = np.uint64(0x165667B19E3779F9)
P4 = np.uint64(0x85EBCA77C2B2AE63)
P5 = np.uint64(0x27D4EB2F165667C5)


@njit(nogil=True, cache=True, inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit(nogil=True, cache=True, inline="always")
def _round(acc, v):
    acc = acc + v * P2
    return _rotl(acc, 31) * P1


@njit(nogil=True, cache=True, inline="always")
def _merge(h, v):
    h = h ^ _round(np.uint64(0), v)
    return h * P1 + P4


@njit(nogil=True, cache=True)
def xxh64(buf):
    """XXH64 of the bytes of buf (uint8 [n], C-contiguous), seed 0."""
    n = buf.shape[0]
    nw = n // 8
    words = buf[: nw * 8].view(np.uint64)
    p = 0  # next unread word
    if n >= 32:
        v1 = P1 + P2
        v2 = P2
        v3 = np.uint64(0)
        v4 = np.uint64(0) - P1
        stripes = n // 32
        for s in range(stripes):
            w = 4 * s
            v1 = _round(v1, words[w])
            v2 = _round(v2, words[w + 1])
            v3 = _round(v3, words[w + 2])
            v4 = _round(v4, words[w + 3])
        p = 4 * stripes
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        h = _merge(h, v1)
        h = _merge(h, v2)
        h = _merge(h, v3)
        h = _merge(h, v4)
    else:
        h = P5
    h = h + np.uint64(n)
    while p < nw:
        h = h ^ _round(np.uint64(0), words[p])
        h = _rotl(h, 27) * P1 + P4
        p += 1
    b = p * 8
    if n - b >= 4:
        v = (np.uint64(buf[b]) | (np.uint64(buf[b + 1]) << np.uint64(8))
             | (np.uint64(buf[b + 2]) << np.uint64(16)) | (np.uint64(buf[b + 3]) << np.uint64(24)))
        h = h ^ (v * P1)
        h = _rotl(h, 23) * P2 + P3
        b += 4
    while b < n:
        h = h ^ (np.uint64(buf[b]) * P5)
        h = _rotl(h, 11) * P1
        b += 1
    h = h ^ (h >> np.uint64(33))
    h = h * P2
    h = h ^ (h >> np.uint64(29))
    h = h * P3
    h = h ^ (h >> np.uint64(32))
    return h
