"""The job descriptor (kt/cpu_ops/runtime/job.py): layouts assign every index, the Python and the
jitted writers encode a slot alike, and the readers give the arrays back."""
import numpy as np
import pytest
from numba import njit

from kt.cpu_ops.driver import layout as L
from kt.cpu_ops.runtime.job import (SLOT, JobLayout, array1, array2, put_array, put_array_at,
                                    put_words)
from kt.cpu_ops.runtime.worker import DESC_SIZE


def test_layout_assigns_slots_then_words():
    lay = JobLayout("t", arrays=("a", "b"), words=("x", "y", "z"))
    assert (lay.slot("a"), lay.slot("b")) == (0, 1)
    assert [lay.word(n) for n in ("x", "y", "z")] == [2 * SLOT, 2 * SLOT + 1, 2 * SLOT + 2]
    assert lay.size == 2 * SLOT + 3 and lay.run(("y", "z")) == 2 * SLOT + 1
    with pytest.raises(KeyError, match="no array slot 'c'"):
        lay.slot("c")
    with pytest.raises(KeyError, match="no word 'w'"):
        lay.word("w")
    with pytest.raises(ValueError, match="not consecutive"):
        lay.run(("z", "x"))
    with pytest.raises(ValueError, match="unique"):
        JobLayout("t", arrays=("a", "a"), words=())
    with pytest.raises(ValueError, match="unique"):
        JobLayout("t", arrays=("a",), words=("a",))
    with pytest.raises(ValueError, match="do not fit"):
        JobLayout("t", arrays=tuple(f"a{i}" for i in range(DESC_SIZE // SLOT)), words=("x",))


def test_descriptor_writes_by_name():
    lay = JobLayout("t", arrays=("a", "e"), words=("x",))
    d = lay.descriptor()
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    d.put_array("a", a)
    d.put_array("e", np.zeros((5, 0), np.int32))
    d["x"] = np.int64(7)
    assert list(d.words[:3]) == [a.ctypes.data, 3, 4]
    assert list(d.words[SLOT:SLOT + 3]) == [0, 5, 0]  # an empty array has address 0
    assert d["x"] == 7 and d.copy().words is not d.words
    with pytest.raises(ValueError, match="C-contiguous"):
        d.put_array("a", a[:, ::2])
    with pytest.raises(ValueError, match="C-contiguous"):
        d.put_array("a", [1, 2])
    with pytest.raises(KeyError, match="no word"):
        d["y"] = 1


@njit
def _write(desc, a, addr, words):
    put_array(desc, 0, a)
    put_array_at(desc, 1, addr, 6, 2)
    put_words(desc, 2 * SLOT, words)


@njit
def _read(desc):
    return array2(desc, 0, np.float32).sum() + array1(desc, 1, np.int64)[3]


def test_jitted_writers_match_and_readers_round_trip():
    lay = JobLayout("t", arrays=("a", "b"), words=("x", "y"))
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(12, dtype=np.int64)
    py = lay.descriptor()
    py.put_array("a", a)
    py.words[SLOT:SLOT + 3] = (b.ctypes.data, 6, 2)
    py["x"], py["y"] = 11, 12
    jit = np.zeros(lay.size, np.int64)
    _write(jit, a, b.ctypes.data, (11, 12))
    assert np.array_equal(py.words, jit)
    assert _read(jit) == a.sum() + b[3]


def test_the_moe_job_layout():
    """Every index the driver reads comes from MOE_JOB; the per-call words are one run."""
    assert L.DESC_WORDS == L.MOE_JOB.size <= DESC_SIZE
    assert L.CALL_WORDS == L.MOE_JOB.word("T")
    assert L.MOE_JOB.run(L.PER_CALL + L.TUNING) == L.CALL_WORDS
    assert (L.A_X, L.A_W2R) == (L.MOE_JOB.slot("x"), L.MOE_JOB.slot("w2.tab"))
    assert L.S_WATCH == L.MOE_JOB.word("watch") == L.CALL_WORDS + len(L.PER_CALL + L.TUNING) - 1
    assert len({getattr(L, n) for n in dir(L) if n.startswith(("S_", "D_"))}) == \
        len([n for n in dir(L) if n.startswith(("S_", "D_"))])
