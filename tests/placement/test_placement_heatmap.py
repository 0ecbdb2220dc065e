"""The heatmap PNG: written, sized, and the GPU experts really marked."""
import numpy as np
import pytest

from kt.placement import ExpertStats, Placement, plan, render_heatmap

OUTLINE = np.array([0x3E, 0xE8, 0xFF]) / 255.0  # the outline colour of GPU cells


def _read_png(path):
    from matplotlib import image

    return image.imread(path)


def _outline_pixels(img):
    return int((np.abs(img[..., :3] - OUTLINE).max(axis=-1) < 0.03).sum())


def test_heatmap_marks_gpu_experts(tmp_path):
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 100, size=(5, 12)).astype(float)
    p = plan(counts, 0.25, "frequency")
    out = render_heatmap(p, tmp_path / "h.png", counts, title="test")
    img = _read_png(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert img.shape[0] > 300 and img.shape[1] > 600
    marked = _outline_pixels(img)
    none = _outline_pixels(_read_png(render_heatmap(Placement.all_cpu(5, 12), tmp_path / "n.png", counts)))
    assert none == 0 and marked > 15 * p.num_gpu_experts()  # every outlined cell adds pixels


def test_heatmap_without_stats_and_bad_counts(tmp_path):
    p = Placement.from_contiguous(3, 8, 2, expert_bytes=2**20)
    img = _read_png(render_heatmap(p, tmp_path / "m.png"))
    assert _outline_pixels(img) > 0
    with pytest.raises(ValueError, match="counts shape"):
        render_heatmap(p, tmp_path / "x.png", np.ones((3, 9)))
    s = ExpertStats.from_array(np.ones((3, 8)))
    render_heatmap(p, tmp_path / "s.png", s)  # ExpertStats accepted as counts
