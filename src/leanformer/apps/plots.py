"""Plots for the trade-off sweep and the token-cluster maps (matplotlib, Agg canvas).

Figures are drawn on ``matplotlib.figure.Figure`` with an Agg canvas instead of through
``pyplot``, so nothing here touches the global backend or needs a display.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import hsv_to_rgb
from matplotlib.figure import Figure

from leanformer.apps.sweep_config import score_key

_MARKERS = "osD^v<>phXPd"
_COLOURS = [f"C{i}" for i in range(10)]  # matplotlib's default cycle (tab10)
_LINESTYLES = ("-", "--", ":", "-.")


def line_styles(n: int) -> list[dict[str, str]]:
    """``n`` distinct line styles: the ten default colours, then the same colours dashed (then
    dotted ...) with other markers, so a sweep of more than ten methods has no two alike."""
    return [
        {
            "color": _COLOURS[j % len(_COLOURS)],
            "linestyle": _LINESTYLES[(j // len(_COLOURS)) % len(_LINESTYLES)],
            "marker": _MARKERS[(j + j // len(_COLOURS)) % len(_MARKERS)],
        }
        for j in range(n)
    ]


def plot_tradeoff(rows: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Top-1 (a segmentation sweep's rows: mIoU) vs GFLOPs (and vs img/s when measured),
    one line per method; the unpooled model (``none``) is a star. Returns ``path``."""
    score = score_key(rows[0]) if rows else "top1"
    has_speed = all("img_per_s" in r for r in rows)
    axes_keys = [("gflops", "GFLOPs per image")] + ([("img_per_s", "images / s")] if has_speed else [])
    fig = Figure(figsize=(5.2 * len(axes_keys), 4.2), constrained_layout=True)
    FigureCanvasAgg(fig)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    reduced = [m for m in methods if m != "none"]
    styles = dict(zip(reduced, line_styles(len(reduced)), strict=True))
    for col, (key, label) in enumerate(axes_keys):
        ax = fig.add_subplot(1, len(axes_keys), col + 1)
        for method in methods:
            # Connect a method's points in budget (GFLOPs) order on both axes, so noisy
            # timings show as a kink rather than reordering the curve.
            pts = sorted((r["gflops"], r[key], r[score]) for r in rows if r["method"] == method)
            xs, ys = [p[1] for p in pts], [p[2] for p in pts]
            if method == "none":
                ax.plot(xs, ys, "k*", markersize=13, label="none (unpooled)", zorder=5)
                ax.axhline(ys[0], color="k", linestyle=":", linewidth=0.8, alpha=0.6)
            else:
                ax.plot(xs, ys, linewidth=1.4, markersize=5, label=method, **styles[method])
        ylabel = "mIoU (%)" if score == "miou" else "top-1 accuracy (%)"
        style_accuracy_axis(ax, label, legend=col == 0, legend_loc="best", ylabel=ylabel)
    return save_figure(fig, path, title)


def style_accuracy_axis(
    ax: Any, xlabel: str, *, legend: bool, legend_loc: str, ylabel: str = "top-1 accuracy (%)"
) -> None:
    """Labels, grid and (optionally) the legend of an accuracy-vs-cost panel."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8, loc=legend_loc)


def save_figure(
    fig: Any, path: str | Path, title: str | None = None, *, dpi: int = 120, title_size: float | None = None
) -> Path:
    """Give ``fig`` its title and write it to ``path`` (folders created); returns the file written.

    A path without a suffix gets ``.png`` (matplotlib would add it anyway, and the
    caller reports the returned path); any other suffix picks matplotlib's format.
    """
    if title:
        fig.suptitle(title, fontsize=title_size)
    path = Path(path)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def _palette(k: int, seed: int = 0) -> np.ndarray:
    """``[k, 3]`` distinct-looking colours: hues spread by the golden ratio, shuffled."""
    hues = (np.arange(k) * 0.618034) % 1.0
    rng = np.random.default_rng(seed)
    hues = hues[rng.permutation(k)]
    return hsv_to_rgb(np.stack([hues, np.full(k, 0.75), np.full(k, 0.95)], axis=1))


def plot_cluster_maps(
    images: np.ndarray,
    assignments: np.ndarray,
    grid: tuple[int, int],
    path: str | Path,
    *,
    title: str = "",
    alpha: float = 0.55,
) -> Path:
    """One image with its token clusters coloured over it (the paper's figure 1c).

    ``images [H, W, 3]`` in [0, 1] (or ``[H, W]`` grey); ``assignments [gh * gw]``: the
    output token each patch ended up in, ``-1`` for a dropped patch (hatched grey).
    Cluster borders are drawn where neighbouring patches belong to different tokens.
    """
    img = images if images.ndim == 3 else np.repeat(images[..., None], 3, axis=2)
    gh, gw = grid
    H, W = img.shape[:2]
    labels = assignments.reshape(gh, gw)
    k = int(labels.max()) + 1 if (labels >= 0).any() else 1
    colours = np.concatenate([_palette(k), np.full((1, 3), 0.5)])  # last colour: dropped
    cell = colours[np.where(labels >= 0, labels, k)]  # [gh, gw, 3]
    # Nearest-neighbour upsampling of the patch grid to pixels.
    rows = (np.arange(H) * gh // H)[:, None]
    cols = (np.arange(W) * gw // W)[None, :]
    overlay = cell[rows, cols]
    dropped = (labels < 0)[rows, cols][..., None]
    blend = np.where(dropped, 0.25 * img + 0.75 * 0.5, (1 - alpha) * img + alpha * overlay)
    fig = Figure(figsize=(6.4, 3.4), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax0, ax1 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    ax0.imshow(img, interpolation="nearest")
    ax0.set_title("input", fontsize=9)
    ax1.imshow(blend, interpolation="nearest")
    # Borders between patches of different clusters.
    ph, pw = H / gh, W / gw
    for r in range(gh):
        for c in range(gw):
            if c + 1 < gw and labels[r, c] != labels[r, c + 1]:
                ax1.plot([(c + 1) * pw - 0.5] * 2, [r * ph - 0.5, (r + 1) * ph - 0.5], "w-", lw=0.8)
            if r + 1 < gh and labels[r, c] != labels[r + 1, c]:
                ax1.plot([c * pw - 0.5, (c + 1) * pw - 0.5], [(r + 1) * ph - 0.5] * 2, "w-", lw=0.8)
    kept = int((labels >= 0).sum())
    ax1.set_title(f"{k} tokens ({kept}/{gh * gw} patches kept)", fontsize=9)
    for ax in (ax0, ax1):
        ax.set_xticks([])
        ax.set_yticks([])
    return save_figure(fig, path, title, dpi=110, title_size=10)
