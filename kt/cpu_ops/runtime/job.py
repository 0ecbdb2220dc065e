"""The job descriptor: the int64 words a native job reads, declared once per kind of job and
written only through this module.

A ``JobLayout`` names a job's array slots and scalar words; it assigns their indices (slots
first, ``SLOT`` words each: the data address, 0 for an empty array, then the dims; scalar words
after them), so no caller writes an index by hand. Python builds templates (a layer's weights,
its scratch) with a ``JobDescriptor``, which checks every name and array; jitted code writes the
per-call slots with ``put_array`` / ``put_array_at`` and a declared run of call words with
``put_words``, and a job reads slots back as arrays with ``array1`` .. ``array5``. The indices
come from the layout as module constants, which is what jitted code needs.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit

from .. import cache as _cache
from .native import ptr
from .worker import DESC_SIZE

_cache.install()

__all__ = ["SLOT", "JobLayout", "JobDescriptor", "put_array", "put_array_at", "put_words",
           "array1", "array2", "array4", "array5", "rows", "seg", "participant_rows"]

SLOT = 8  # words per array slot: the address, then up to 7 dims


class JobLayout:
    """The words of one kind of job: ``arrays`` (slot names, in slot order) and ``words``
    (scalar word names, in order, after the slots). Fits the pool's descriptor (DESC_SIZE)."""

    def __init__(self, name: str, arrays: tuple[str, ...], words: tuple[str, ...]):
        if len(set(arrays)) != len(arrays) or len(set(words)) != len(words) or set(arrays) & set(words):
            raise ValueError(f"{name}: slot and word names must be unique")
        self.name = name
        self.arrays = tuple(arrays)
        self.words = tuple(words)
        self._slot = {n: i for i, n in enumerate(self.arrays)}
        base = len(self.arrays) * SLOT
        self._word = {n: base + i for i, n in enumerate(self.words)}
        self.size = base + len(self.words)
        if self.size > DESC_SIZE:
            raise ValueError(f"{name}: {self.size} words do not fit a descriptor of {DESC_SIZE}")

    def slot(self, name: str) -> int:
        try:
            return self._slot[name]
        except KeyError:
            raise KeyError(f"{self.name} has no array slot {name!r}; slots: {list(self.arrays)}") from None

    def word(self, name: str) -> int:
        try:
            return self._word[name]
        except KeyError:
            raise KeyError(f"{self.name} has no word {name!r}; words: {list(self.words)}") from None

    def run(self, names: tuple[str, ...]) -> int:
        """The index of the first of ``names``, which must be consecutive words in this order
        (the block ``put_words`` writes)."""
        first = self.word(names[0])
        if [self.word(n) for n in names] != list(range(first, first + len(names))):
            raise ValueError(f"{self.name}: words {names} are not consecutive in this order")
        return first

    def descriptor(self) -> "JobDescriptor":
        return JobDescriptor(self)

    def __repr__(self):
        return f"JobLayout({self.name!r}, {len(self.arrays)} slots, {len(self.words)} words)"


class JobDescriptor:
    """Named writes into one descriptor's words (``words``: int64 [layout.size])."""

    __slots__ = ("layout", "words")

    def __init__(self, layout: JobLayout, words: np.ndarray | None = None):
        self.layout = layout
        self.words = np.zeros(layout.size, np.int64) if words is None else words

    def put_array(self, name: str, a: np.ndarray) -> None:
        """Slot ``name`` <- a's data address (0 if empty) and shape; ``a`` must be C-contiguous
        and stay alive while a job reads it."""
        if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
            raise ValueError(f"{self.layout.name}.{name}: descriptor arrays must be C-contiguous numpy arrays")
        if a.ndim > SLOT - 1:
            raise ValueError(f"{self.layout.name}.{name}: at most {SLOT - 1} dims, got {a.ndim}")
        o = self.layout.slot(name) * SLOT
        self.words[o] = a.ctypes.data if a.size else 0
        self.words[o + 1: o + 1 + a.ndim] = a.shape

    def __setitem__(self, name: str, value) -> None:
        self.words[self.layout.word(name)] = int(value)

    def __getitem__(self, name: str) -> int:
        return int(self.words[self.layout.word(name)])

    def copy(self) -> "JobDescriptor":
        return JobDescriptor(self.layout, self.words.copy())


# ----------------------------------------------------------------------------- jitted writers

@njit(cache=True, inline="always")
def put_array(desc, slot, a):
    """``JobDescriptor.put_array`` for jitted callers (``a`` C-contiguous)."""
    desc[slot * SLOT] = a.ctypes.data if a.size > 0 else 0
    for i in range(a.ndim):
        desc[slot * SLOT + 1 + i] = a.shape[i]


@njit(cache=True, inline="always")
def put_array_at(desc, slot, addr, n0, n1):
    """Slot ``slot`` from an address and up to two dims (n1 unused for a 1-D array)."""
    o = slot * SLOT
    desc[o] = addr
    desc[o + 1] = n0
    desc[o + 2] = n1


@njit(cache=True, inline="always")
def put_words(desc, first, words):
    """desc[first + i] = words[i] for a tuple of ints (a ``JobLayout.run`` of words)."""
    for i in range(len(words)):
        desc[first + i] = words[i]


# ----------------------------------------------------------------------------- jitted readers

@njit(nogil=True, cache=True)
def array1(desc, slot, dt):
    o = slot * SLOT
    return carray(ptr(desc[o], dt), (desc[o + 1],))


@njit(nogil=True, cache=True)
def array2(desc, slot, dt):
    o = slot * SLOT
    return carray(ptr(desc[o], dt), (desc[o + 1], desc[o + 2]))


@njit(nogil=True, cache=True)
def array4(desc, slot, dt):
    o = slot * SLOT
    return carray(ptr(desc[o], dt), (desc[o + 1], desc[o + 2], desc[o + 3], desc[o + 4]))


@njit(nogil=True, cache=True)
def array5(desc, slot, dt):
    o = slot * SLOT
    return carray(ptr(desc[o], dt),
                  (desc[o + 1], desc[o + 2], desc[o + 3], desc[o + 4], desc[o + 5]))


@njit(nogil=True, cache=True, inline="always")
def rows(a, r0, r1, dt):
    """a[r0:r1] of a C-contiguous 2-D array, typed C-contiguous (kernels get 'C' layouts)."""
    return carray(ptr(a.ctypes.data + r0 * a.shape[1] * a.itemsize, dt), (r1 - r0, a.shape[1]))


@njit(nogil=True, cache=True, inline="always")
def seg(a, r0, r1, dt):
    """a[r0:r1] of a 1-D array, typed C-contiguous."""
    return carray(ptr(a.ctypes.data + r0 * a.itemsize, dt), (r1 - r0,))


@njit(nogil=True, cache=True, inline="always")
def participant_rows(desc, slot, me, nrows, cols, dt):
    """Participant me's [nrows, cols] of a per-participant scratch slot (int8 [nth, bytes each])."""
    o = slot * SLOT
    return carray(ptr(desc[o] + me * desc[o + 2], dt), (nrows, cols))
