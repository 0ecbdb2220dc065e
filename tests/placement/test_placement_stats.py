"""ExpertStats: recording (numpy, torch, the device path), EMA, merge, files, SGLang import."""
import json

import numpy as np
import pytest
import torch

from kt.placement import ExpertStats, load_counts


class SGLangDumpLike:
    """Stands in for an object that carries SGLang's ``logical_count`` attribute."""

    def __init__(self, logical_count):
        self.logical_count = logical_count


def _bincount_ref(ids, E, w=None):
    out = np.zeros(E)
    for i, e in enumerate(np.asarray(ids).reshape(-1)):
        if e >= 0:
            out[e] += 1.0 if w is None else float(np.asarray(w).reshape(-1)[i])
    return out


def test_record_numpy_counts_token_slots_and_skips_minus_one():
    rng = np.random.default_rng(0)
    s = ExpertStats(3, 7)
    ids0 = rng.integers(-1, 7, size=(11, 3))
    ids2 = rng.integers(0, 7, size=(5, 2))
    s.record(0, ids0)
    s.record(2, ids2)
    s.record(2, ids2.astype(np.int32))
    np.testing.assert_array_equal(s.counts[0], _bincount_ref(ids0, 7))
    np.testing.assert_array_equal(s.counts[1], 0)
    np.testing.assert_array_equal(s.counts[2], 2 * _bincount_ref(ids2, 7))
    assert s.tokens.tolist() == [11, 0, 10]
    s.record(1, np.zeros((0, 4), dtype=np.int64))  # zero tokens is fine
    assert s.tokens.tolist() == [11, 0, 10]


def test_record_weighted_and_torch_cpu():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 5, size=(9, 2))
    w = rng.random((9, 2)).astype(np.float32)
    s = ExpertStats(1, 5, weighted=True)
    s.record(0, torch.from_numpy(ids), torch.from_numpy(w))
    np.testing.assert_allclose(s.counts[0], _bincount_ref(ids, 5, w), rtol=1e-12)
    with pytest.raises(ValueError, match="needs topk_weights"):
        s.record(0, ids)
    u = ExpertStats(1, 5)
    u.record(0, ids, w)  # unweighted statistics ignore router weights
    np.testing.assert_array_equal(u.counts[0], _bincount_ref(ids, 5))


def test_device_path_matches_numpy_path():
    """The accelerator path (index_add_ into a device buffer) run on CPU tensors: same counts."""
    rng = np.random.default_rng(2)
    E = 6
    ref = ExpertStats(2, E, weighted=True, halflife_tokens=8)
    dev = ExpertStats(2, E, weighted=True, halflife_tokens=8)
    for step in range(5):
        layer = step % 2
        ids = rng.integers(-1, E, size=(3 + step, 2))
        w = rng.random(ids.shape).astype(np.float32)
        ref.record(layer, ids, w)
        dev._record_torch(layer, torch.from_numpy(ids), torch.from_numpy(w))
    assert dev._host.sum() == 0 and len(dev._dev) == 1  # accumulated in the "device" buffer only
    np.testing.assert_allclose(dev.counts, ref.counts, rtol=1e-12, atol=0)
    assert dev.tokens.tolist() == ref.tokens.tolist()
    # weights given as numpy (or on another device) next to device ids are moved to the ids' device
    mixed = ExpertStats(1, E, weighted=True)
    ids = rng.integers(0, E, size=(4, 2))
    w = rng.random((4, 2))
    mixed._record_torch(0, torch.from_numpy(ids), w)
    np.testing.assert_allclose(mixed.counts[0], _bincount_ref(ids, E, w), rtol=1e-12)
    with pytest.raises(TypeError, match="float dtype"):
        mixed._record_torch(0, torch.from_numpy(ids), ids)


def test_device_path_reports_bad_ids_when_read():
    s = ExpertStats(1, 4)
    s._record_torch(0, torch.tensor([[0, 9]]), None)  # no check at record time (would sync)
    with pytest.raises(ValueError, match=r"expert ids outside \[-1, 4\)"):
        s.counts


def test_ema_halves_per_halflife():
    s = ExpertStats(1, 3, halflife_tokens=4)
    s.record(0, np.array([[0], [0], [0], [0]]))  # 4 tokens to expert 0
    s.record(0, np.array([[1], [1], [1], [1]]))  # 4 more tokens: old counts halve first
    np.testing.assert_allclose(s.counts[0], [2.0, 4.0, 0.0], rtol=1e-15)
    s.record(0, np.array([[2], [2]]))
    f = 0.5 ** (2 / 4)
    np.testing.assert_allclose(s.counts[0], [2.0 * f, 4.0 * f, 2.0], rtol=1e-15)


def test_record_rejects_bad_input():
    s = ExpertStats(2, 4)
    with pytest.raises(ValueError, match=r"expert id 4 out of range \[-1, 4\) at layer 1"):
        s.record(1, np.array([[0, 4]]))
    with pytest.raises(ValueError, match=r"expert id -3 out of range"):
        s.record(1, np.array([[-3, 0]]))
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        s.record(2, np.array([[0]]))
    with pytest.raises(TypeError, match="integer dtype"):
        s.record(0, np.array([[0.0, 1.0]]))
    with pytest.raises(ValueError, match=r"expected shape \[T, K\]"):
        s.record(0, np.zeros((2, 2, 2), dtype=np.int64))
    w = ExpertStats(1, 4, weighted=True)
    with pytest.raises(ValueError, match="topk_weights shape"):
        w.record(0, np.array([[0, 1]]), np.array([[0.5]]))
    with pytest.raises(ValueError, match="finite and >= 0"):
        w.record(0, np.array([[0, 1]]), np.array([[0.5, np.nan]]))
    with pytest.raises(ValueError, match="halflife_tokens must be a positive"):
        ExpertStats(1, 4, halflife_tokens=0)
    assert s.total() == 0  # nothing was added by the failed calls


def test_merge_and_frequencies():
    a = ExpertStats.from_array(np.array([[1.0, 3.0], [0.0, 0.0]]), model="m")
    b = ExpertStats.from_array(np.array([[1.0, 0.0], [2.0, 2.0]]))
    c = a.merge(b)
    np.testing.assert_array_equal(c.counts, [[2.0, 3.0], [2.0, 2.0]])
    assert c.model == "m"
    np.testing.assert_allclose((a + b).frequencies(), [[0.4, 0.6], [0.5, 0.5]], rtol=1e-15)
    np.testing.assert_array_equal(a.frequencies()[1], [0.0, 0.0])
    with pytest.raises(ValueError, match="shapes differ"):
        a.merge(ExpertStats(2, 3))
    with pytest.raises(ValueError, match="router-weighted"):
        a.merge(ExpertStats(2, 2, weighted=True))


@pytest.mark.parametrize("suffix", [".npz", ".json"])
def test_save_load_round_trip(tmp_path, suffix):
    s = ExpertStats(3, 5, weighted=True, halflife_tokens=128.0, model="toy")
    rng = np.random.default_rng(3)
    for l in range(3):
        ids = rng.integers(0, 5, size=(7, 2))
        s.record(l, ids, rng.random(ids.shape))
    path = s.save(tmp_path / f"s{suffix}")
    t = ExpertStats.load(path, num_layers=3, num_experts=5)
    np.testing.assert_array_equal(t.counts, s.counts)  # float64 survives both formats exactly
    assert t.tokens.tolist() == s.tokens.tolist()
    assert (t.weighted, t.halflife_tokens, t.model) == (True, 128.0, "toy")
    with pytest.raises(ValueError, match=r"statistics in .* have \[L, E\] = \[3, 5\], but the model has"):
        ExpertStats.load(path, num_layers=3, num_experts=6)
    with pytest.raises(ValueError, match="saved as .npz or .json"):
        s.save(tmp_path / "s.txt")


def test_sglang_pt_import(tmp_path):
    rng = np.random.default_rng(4)
    lc = torch.from_numpy(rng.integers(0, 50, size=(4, 3, 8)))  # [buffer, L, E]
    path = tmp_path / "expert_distribution.pt"
    torch.save({"logical_count": lc, "rank": 0}, path)
    s = ExpertStats.from_sglang(path, num_layers=3, num_experts=8)
    np.testing.assert_array_equal(s.counts, lc.sum(0).numpy())
    np.testing.assert_array_equal(ExpertStats.load(path).counts, lc.sum(0).numpy())
    np.testing.assert_array_equal(load_counts(path), lc.sum(0).numpy())
    with pytest.raises(ValueError, match=r"have \[L, E\] = \[3, 8\], but the model has num_layers=4"):
        ExpertStats.from_sglang(path, num_layers=4, num_experts=8)
    torch.save({"something": lc}, tmp_path / "nolc.pt")
    with pytest.raises(ValueError, match="no 'logical_count'"):
        ExpertStats.from_sglang(tmp_path / "nolc.pt")


def test_sglang_object_import_needs_trust(tmp_path):
    lc = torch.arange(2 * 2 * 3).reshape(2, 2, 3)
    path = tmp_path / "obj.pt"
    torch.save(SGLangDumpLike(lc), path)
    with pytest.raises(ValueError, match="trust_pickle=True"):
        ExpertStats.from_sglang(path)
    s = ExpertStats.from_sglang(path, trust_pickle=True)
    np.testing.assert_array_equal(s.counts, lc.sum(0).numpy())
    np.testing.assert_array_equal(ExpertStats.load(path, trust_pickle=True).counts, lc.sum(0).numpy())


def test_plain_array_imports(tmp_path):
    a = np.array([[3, 0, 1], [2, 2, 2]], dtype=np.int64)
    np.save(tmp_path / "a.npy", a)
    np.savez(tmp_path / "a.npz", freq=a)
    np.savez(tmp_path / "b.npz", counts=a, other=np.zeros(3))
    torch.save(torch.from_numpy(a).float(), tmp_path / "a.pt")
    (tmp_path / "a.json").write_text(json.dumps(a.tolist()))
    for name in ("a.npy", "a.npz", "b.npz", "a.pt", "a.json"):
        np.testing.assert_array_equal(ExpertStats.load(tmp_path / name).counts, a, err_msg=name)


def test_bad_stats_files(tmp_path):
    np.save(tmp_path / "neg.npy", np.array([[1.0, -2.0]]))
    with pytest.raises(ValueError, match=r"negative count -2.0 at layer 0, expert 1"):
        ExpertStats.load(tmp_path / "neg.npy")
    np.save(tmp_path / "nan.npy", np.array([[1.0, np.nan]]))
    with pytest.raises(ValueError, match="expected a finite number"):
        ExpertStats.load(tmp_path / "nan.npy")
    np.save(tmp_path / "1d.npy", np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"expected counts of shape \[L, E\] or \[buffer, L, E\]"):
        ExpertStats.load(tmp_path / "1d.npy")
    torch.save(torch.ones(2, 2, 2, 2), tmp_path / "4d.pt")
    with pytest.raises(ValueError, match="found shape"):
        ExpertStats.load(tmp_path / "4d.pt")
    np.savez(tmp_path / "two.npz", x=np.ones((2, 2)), y=np.ones((2, 2)))
    with pytest.raises(ValueError, match="named 'counts'"):
        ExpertStats.load(tmp_path / "two.npz")
    (tmp_path / "x.csv").write_text("1,2\n")
    with pytest.raises(ValueError, match="unknown statistics file type"):
        ExpertStats.load(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError):
        ExpertStats.load(tmp_path / "missing.npz")
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="cannot read"):
        ExpertStats.load(tmp_path / "bad.pt")


def test_load_counts_names_the_file_for_bad_bytes(tmp_path):
    """Random bytes as .npy (numpy would speak of pickles), a JSON nested too deeply, a FIFO."""
    import os

    from kt.placement import load_counts

    rng = np.random.default_rng(0)
    npy = tmp_path / "r.npy"
    npy.write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    fifo = tmp_path / "s.json"
    os.mkfifo(fifo)
    for path, msg in ((npy, "not a numeric .npy array file"), (deep, "nested too deeply"),
                      (fifo, "not a regular file")):
        with pytest.raises(ValueError, match=msg) as ei:
            load_counts(path)
        assert str(path) in str(ei.value) and "pickle" not in str(ei.value)
