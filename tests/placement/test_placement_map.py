"""Placement: validation, constructors, accounting, moves, JSON round trips."""
import json

import numpy as np
import pytest

from kt.placement import Placement


def test_from_mask_assigns_slots_in_expert_order():
    mask = np.array([[False, True, False, True], [True, True, True, False]])
    p = Placement.from_mask(mask)
    assert p.gpu_slot.tolist() == [[-1, 0, -1, 1], [0, 1, 2, -1]]
    assert p.n_slots.tolist() == [2, 3]
    assert p.row(1).tolist() == [0, 1, 2, -1]
    assert p.num_gpu_experts(0) == 2 and p.num_gpu_experts(1) == 3 and p.num_gpu_experts() == 5
    assert p.experts_in_slots(0).tolist() == [1, 3]
    assert p.shape == (2, 4)


def test_all_cpu_all_gpu_contiguous():
    assert not Placement.all_cpu(3, 5).gpu_mask.any()
    assert Placement.all_gpu(3, 5).gpu_mask.all()
    assert Placement.all_gpu(3, 5).gpu_slot[2].tolist() == [0, 1, 2, 3, 4]
    p = Placement.from_contiguous(2, 6, 4)
    assert p.gpu_slot.tolist() == [[0, 1, 2, 3, -1, -1]] * 2
    assert Placement.from_contiguous(2, 6, 0) == Placement.all_cpu(2, 6)
    with pytest.raises(ValueError, match=r"num_gpu_experts must be an int in \[0, 6\]"):
        Placement.from_contiguous(2, 6, 7)
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        Placement.all_cpu(0, 4)


def test_arrays_are_read_only_copies():
    mask = np.array([[True, False]])
    p = Placement.from_mask(mask)
    mask[0, 1] = True
    assert p.gpu_mask.tolist() == [[True, False]]
    with pytest.raises(ValueError):
        p.gpu_slot[0, 0] = 5
    with pytest.raises(AttributeError):
        p.model = "x"


@pytest.mark.parametrize("slot, n_slots, message", [
    ([[0, 0, -1]], None, "slot 0 holds more than one expert"),
    ([[0, 2, -1]], None, "slot 2 used but the layer has n_slots=2"),
    ([[0, -2, -1]], None, r"gpu_slot\[0, 1\] = -2"),
    ([[0, 1, -1]], [1], "slot 1 used but the layer has n_slots=1"),
    ([[0, 1, -1]], [2, 2], "n_slots: expected 1 integers"),
    ([[0, 1, -1]], [4], r"n_slots must lie in \[0, E=3\]"),
])
def test_invalid_slots(slot, n_slots, message):
    with pytest.raises(ValueError, match=message):
        Placement.from_slots(np.array(slot), n_slots=n_slots)


def test_mask_slot_disagreement_and_types():
    with pytest.raises(ValueError, match="disagree at layer 0, expert 1"):
        Placement(np.array([[True, True]]), np.array([[0, -1]]))
    with pytest.raises(ValueError, match="shape"):
        Placement(np.array([[True, False]]), np.array([[0, -1, -1]]))
    with pytest.raises(TypeError, match="expected dtype bool"):
        Placement(np.array([[1, 0]]), np.array([[0, -1]]))
    with pytest.raises(TypeError, match="integer dtype"):
        Placement.from_slots(np.array([[0.0, -1.0]]))
    with pytest.raises(ValueError, match=r"\[L, E\] array"):
        Placement.from_mask(np.array([True, False]))
    with pytest.raises(ValueError, match="expert_bytes must be a positive int"):
        Placement.from_mask(np.array([[True]]), expert_bytes=0)


def test_holes_allowed_with_explicit_n_slots_and_accounting():
    p = Placement.from_slots(np.array([[2, -1, 0], [-1, -1, -1]]), n_slots=[3, 1], expert_bytes=1000)
    assert p.experts_in_slots(0).tolist() == [2, -1, 0]
    assert p.experts_in_slots(1).tolist() == [-1]
    assert p.total_slots == 4
    assert p.gpu_bytes() == 4000  # slots, not experts: buffers are allocated per slot
    assert p.gpu_bytes(expert_bytes=10) == 40
    with pytest.raises(ValueError, match="no expert_bytes"):
        Placement.all_cpu(1, 2).gpu_bytes()


def test_moves_lists_only_changed_slots():
    old = Placement.from_slots(np.array([[0, 1, -1, -1], [0, -1, -1, -1]]))
    new = Placement.from_slots(np.array([[0, -1, 1, -1], [0, -1, -1, -1]]))
    assert old.moves(new) == [(0, 1, 1, 2)]
    assert old.moves(old) == []
    grown = Placement.from_slots(np.array([[0, 1, -1, -1], [0, -1, -1, 1]]))
    assert old.moves(grown) == [(1, 1, -1, 3)]


def test_json_round_trip(tmp_path):
    p = Placement.from_slots(np.array([[1, -1, 0, -1], [-1, 0, -1, -1], [-1, -1, -1, -1]]),
                             n_slots=[2, 2, 0], expert_bytes=9437184, model="qwen3-test")
    path = p.save(tmp_path / "p.json")
    d = json.loads(path.read_text())
    assert d["format"] == "kt.placement" and d["num_layers"] == 3 and d["num_experts"] == 4
    assert d["expert_bytes"] == 9437184 and d["model"] == "qwen3-test"
    q = Placement.load(path)
    assert q == p and hash(q) == hash(p)
    assert q.gpu_slot.dtype == np.int32 and q.gpu_mask.dtype == np.bool_
    Placement.load(path, num_layers=3, num_experts=4, model="qwen3-test")


def test_load_rejects_other_models_and_bad_files(tmp_path):
    path = Placement.from_contiguous(2, 4, 1, model="m1").save(tmp_path / "p.json")
    with pytest.raises(ValueError, match=r"placement is for \[L, E\] = \[2, 4\].*num_layers=3"):
        Placement.load(path, num_layers=3, num_experts=4)
    with pytest.raises(ValueError, match="made for model 'm1', not 'm2'"):
        Placement.load(path, model="m2")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Placement.load(bad)
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a kt placement"):
        Placement.load(bad)
    d = json.loads(path.read_text())
    d["gpu_slot"][0] = [0, 0, -1, -1]
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="slot 0 holds more than one expert"):
        Placement.load(bad)
    d = json.loads(path.read_text())
    d["num_experts"] = 5
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="gpu_slot has shape"):
        Placement.load(bad)
    d = json.loads(path.read_text())
    d["version"] = 99
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="version 99"):
        Placement.load(bad)


def test_import_pulls_in_no_optional_dependency():
    """kt.placement is numpy-only at import: torch and matplotlib load only when used."""
    import subprocess
    import sys

    code = ("import sys, kt.placement; "
            "print([m for m in ('torch', 'matplotlib', 'numba', 'triton') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_load_refuses_what_is_not_a_placement_file(tmp_path):
    """Placement.load names the file for a FIFO (which would block a read), a directory,
    undecodable bytes, a JSON nested too deeply for the parser, and a JSON that is not an object."""
    import os

    from kt.placement import Placement

    fifo = tmp_path / "p.fifo"
    os.mkfifo(fifo)
    cases = {fifo: "not a regular file", tmp_path: "not a regular file",
             tmp_path / "missing.json": "no such file"}
    (tmp_path / "bytes.json").write_bytes(bytes(range(256)))
    cases[tmp_path / "bytes.json"] = "not a placement JSON"
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    cases[tmp_path / "deep.json"] = "nested too deeply"
    (tmp_path / "list.json").write_text("[1, 2]")
    cases[tmp_path / "list.json"] = "top level is a list"
    for path, msg in cases.items():
        with pytest.raises(ValueError, match=msg) as ei:
            Placement.load(path)
        assert str(path) in str(ei.value)
