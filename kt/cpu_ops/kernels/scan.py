"""Jitted scans of packed weights (kept out of packing.py, which is plain NumPy)."""
from __future__ import annotations

import numpy as np
from numba import njit

from .. import cache

cache.install()


@njit(nogil=True, cache=True)
def any_zero_nibble(words):
    """Whether any 4-bit field of ``words`` (uint64, 1-D) is 0. Per word, (x - 0x11..1) & ~x &
    0x88..8 is non-zero exactly when a nibble of x is: the lowest zero nibble borrows and its top
    bit comes out set, which ~x keeps; with no zero nibble nothing borrows, and each nibble's top
    bit is cleared by ~x (nibble >= 8) or by the subtraction (nibble < 8). The OR over a stretch
    of words vectorises; a hit ends the scan at that stretch."""
    ones = np.uint64(0x1111111111111111)
    tops = np.uint64(0x8888888888888888)
    n = words.size
    for a in range(0, n, 16384):
        acc = np.uint64(0)
        for i in range(a, min(n, a + 16384)):
            x = words[i]
            acc |= (x - ones) & ~x & tops
        if acc != 0:
            return True
    return False
