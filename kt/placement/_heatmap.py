"""Heatmap of activation frequency per layer x expert with the GPU experts marked (matplotlib).

Uses matplotlib's object API with the Agg canvas, so it changes no global backend and needs no
display. Legend: L layers, E experts.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ._placement import Placement

__all__ = ["render_heatmap"]


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import LogNorm
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("the heatmap needs matplotlib: pip install 'kt[test]' or pip install matplotlib") from None
    return Figure, FigureCanvasAgg, LogNorm


def render_heatmap(placement: Placement, path: str | os.PathLike, counts=None, *, title: str | None = None,
                   dpi: int = 110) -> Path:
    """Write a PNG: left, each layer's share of routed token-slots per expert (log colour scale),
    GPU experts outlined; right, per layer the share of traffic the GPU serves (bars) and the
    number of GPU experts. counts: [L, E] array or ExpertStats; without it only the mask is drawn.
    """
    Figure, FigureCanvasAgg, LogNorm = _matplotlib()
    L, E = placement.shape
    if counts is not None:
        c = counts.counts if hasattr(counts, "counts") and not isinstance(counts, np.ndarray) else np.asarray(counts)
        c = np.asarray(c, dtype=np.float64)
        if c.shape != (L, E):
            raise ValueError(f"heatmap: counts shape {c.shape} != placement shape {(L, E)}")
        tot = c.sum(axis=1, keepdims=True)
        freq = np.divide(c, tot, out=np.zeros_like(c), where=tot > 0)
    else:
        freq = None
    mask = placement.gpu_mask
    w = min(18.0, max(7.0, 3.0 + 0.09 * E))
    h = min(14.0, max(4.5, 2.0 + 0.2 * L))
    fig = Figure(figsize=(w, h), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(1, 3, width_ratios=[E, max(4, E * 0.16), max(1, E * 0.02)])
    ax = fig.add_subplot(gs[0, 0])
    axr = fig.add_subplot(gs[0, 1], sharey=ax)
    cax = fig.add_subplot(gs[0, 2])
    extent = (-0.5, E - 0.5, L - 0.5, -0.5)
    if freq is not None:
        pos = freq[freq > 0]
        vmin = max(float(pos.min()) if pos.size else 1e-4, 1e-5)
        vmax = max(float(freq.max()), vmin * 10)
        shown = np.ma.masked_less_equal(freq, 0)
        from matplotlib import colormaps

        cmap = colormaps["magma"].with_extremes(bad="#dddddd")
        im = ax.imshow(shown, aspect="auto", cmap=cmap, norm=LogNorm(vmin=vmin, vmax=vmax),
                       interpolation="nearest", extent=extent)
        cb = fig.colorbar(im, cax=cax)
        cb.set_label("share of the layer's routed token-slots")
        served = (freq * mask).sum(axis=1)
    else:
        im = ax.imshow(np.where(mask, 1.0, 0.0), aspect="auto", cmap="Greys", vmin=0, vmax=1.6,
                       interpolation="nearest", extent=extent)
        cax.axis("off")
        served = None
    # outline each GPU cell: one rectangle path per cell, drawn as a single collection
    ll, ee = np.nonzero(mask)
    if ll.size:
        from matplotlib.collections import PatchCollection
        from matplotlib.patches import Rectangle

        lw = 1.6 if max(L, E) <= 64 else (1.0 if max(L, E) <= 160 else 0.6)
        rects = [Rectangle((e - 0.5, l - 0.5), 1.0, 1.0) for l, e in zip(ll.tolist(), ee.tolist())]
        ax.add_collection(PatchCollection(rects, facecolor="none", edgecolor="#3ee8ff", linewidth=lw))
    ax.set_xlim(-0.5, E - 0.5)
    ax.set_ylim(L - 0.5, -0.5)
    ax.set_xlabel("expert id")
    ax.set_ylabel("layer")
    step_l = max(1, int(np.ceil(L / 24)))
    ax.set_yticks(np.arange(0, L, step_l))
    step_e = max(1, int(np.ceil(E / 32)))
    ax.set_xticks(np.arange(0, E, step_e))
    ax.tick_params(axis="x", labelsize=7, rotation=90 if E > 64 else 0)
    ax.tick_params(axis="y", labelsize=7)
    counts_per_layer = mask.sum(axis=1)
    if served is not None:
        axr.barh(np.arange(L), served * 100, height=0.8, color="#3b8bd0")
        axr.set_xlim(0, 100)
        axr.set_xlabel("GPU hit rate %")
        for l in range(L):
            axr.text(1, l, f"{counts_per_layer[l]}", va="center", ha="left", fontsize=6 if L > 40 else 7,
                     color="white" if served[l] > 0.15 else "black")
    else:
        axr.barh(np.arange(L), counts_per_layer, height=0.8, color="#3b8bd0")
        axr.set_xlim(0, E)
        axr.set_xlabel("GPU experts")
    axr.tick_params(axis="y", labelleft=False)
    axr.tick_params(axis="x", labelsize=7)
    axr.grid(axis="x", alpha=0.3)
    n_gpu = int(mask.sum())
    head = title or (placement.model or "placement")
    sub = f"L={L} x E={E}, {n_gpu} GPU experts ({100 * n_gpu / (L * E):.1f} %), outlined"
    if served is not None:
        tot = c.sum()
        sub += f"\nexpected GPU hit rate {100 * (c * mask).sum() / tot:.1f} %" if tot > 0 else ""
        axr.set_title("GPU experts\nper layer (#)", fontsize=8)
    else:
        sub += "; no statistics given (mask only)"
    if placement.expert_bytes:
        sub += f"; GPU slots {placement.gpu_bytes() / 2**30:.2f} GiB"
    fig.suptitle(f"{head}\n{sub}", fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path
