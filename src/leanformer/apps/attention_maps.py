"""Average cross-attention map of every Perceiver query over a dataset (paper figures 3-5).

Each query's attention over the patch grid is averaged over all images (and heads),
then drawn as a grid of small heat maps, queries ordered left to right, top to bottom.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor, nn

from leanformer.apps.plots import save_figure
from leanformer.engine.evaluate import to_device
from leanformer.progress import progress_bar


@torch.inference_mode()
def average_cross_attention(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    num_queries: int | None = None,
    device: str = "cpu",
    progress: bool = False,
) -> Tensor:
    """``[K, H/p, W/p]``: each query's cross-attention map averaged over the dataset
    (``progress``: a bar over the batches)."""
    maps_fn = getattr(model, "cross_attention_maps", None)
    if not callable(maps_fn):
        raise ValueError(f"{type(model).__name__} has no cross_attention_maps (expected a Visual Perceiver)")
    was_training = model.training
    model.eval()
    total: Tensor | None = None
    count = 0
    try:
        for inputs, _ in progress_bar(loader, desc="attention maps", show=progress, leave=False):
            maps = maps_fn(to_device(inputs, device), num_queries=num_queries)  # [B, K, h, w]
            total = maps.sum(0) if total is None else total + maps.sum(0)
            count += maps.shape[0]
    finally:
        model.train(was_training)
    if total is None:
        raise ValueError("the dataset is empty")
    return total / count


def save_attention_grid(
    maps: Tensor, path: str | Path, *, cols: int | None = None, title: str = "", shared_scale: bool = False
) -> Path:
    """Draw ``maps [K, h, w]`` as a grid of heat maps (one per query) and save a PNG.

    Each map gets its own colour scale unless ``shared_scale`` (a broad first query
    would otherwise wash out the sharp ones).
    """
    if maps.ndim != 3:
        raise ValueError(f"expected maps [K, h, w], got shape {tuple(maps.shape)}")
    K = maps.shape[0]
    cols = cols or math.ceil(math.sqrt(K))
    rows = math.ceil(K / cols)
    fig = Figure(figsize=(1.3 * cols, 1.3 * rows + (0.4 if title else 0.0)), constrained_layout=True)
    FigureCanvasAgg(fig)
    data = maps.detach().float().cpu().numpy()
    vmax = float(data.max()) if shared_scale else None
    for i in range(rows * cols):
        ax = fig.add_subplot(rows, cols, i + 1)
        ax.set_xticks([])
        ax.set_yticks([])
        if i < K:
            ax.imshow(data[i], cmap="viridis", vmin=0.0 if shared_scale else None, vmax=vmax)
            ax.set_title(f"q{i}", fontsize=7, pad=2)
        else:
            ax.axis("off")
    return save_figure(fig, path, title, dpi=110, title_size=10)
