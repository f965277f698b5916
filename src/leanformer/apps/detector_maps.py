"""A detector's boxes beside ENACT's regions on one ``fashion_detect`` canvas: the figure of
`leanformer visualize enact --detector`.

The canvas goes through the detector once; a hook on its first ENACT encoder layer keeps
what that layer's queries and keys are computed from (features plus position
embeddings), from which the entropy map, curvature signs and regions are drawn as
:mod:`leanformer.apps.enact_maps` draws them for a photo.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import Tensor, nn

from leanformer.apps.enact_maps import (
    EnactMaps,
    boundary_overlay,
    finish_figure,
    maps_of_tokens,
    region_colours,
)


def detector_maps(model: nn.Module, image: Tensor) -> tuple[dict[str, Tensor], EnactMaps]:
    """``model.predict`` on ``image [C, S, S]`` and the maps of its first ENACT encoder layer."""
    from leanformer.patch.transformers.detr import enact_layers

    layers = enact_layers(getattr(model, "detector", model))
    if not layers:
        name = getattr(model, "leanformer_name", type(model).__name__)
        raise ValueError(f"{name} has no ENACT encoder layer to draw (try detr_fashion_enact)")
    first = layers[0]
    seen: dict[str, Any] = {}

    def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        pos = kwargs.get("position_embeddings")
        seen["tokens"] = hidden if pos is None else hidden + pos
        seen["shape"] = kwargs.get("enact_spatial_shape")

    handle = first.register_forward_pre_hook(keep, with_kwargs=True)
    was_training = model.training
    model.eval()
    try:
        (detections,) = model.predict(image[None])  # type: ignore[operator]
    finally:
        handle.remove()
        model.train(was_training)
    shape = tuple(int(n) for n in seen["shape"])
    return detections, maps_of_tokens(seen["tokens"].detach(), (shape[0], shape[1]), first)


def plot_detector_maps(
    image: Tensor,
    truth: dict[str, Tensor],
    detections: dict[str, Tensor],
    maps: EnactMaps,
    out: Path,
    *,
    min_score: float,
    class_names: tuple[str, ...],
    title: str,
) -> Path:
    """The canvas with its true boxes (green) and the detections scoring at least
    ``min_score`` (red), ENACT's regions, and their boundaries over the canvas."""
    regions = maps.regions
    H, W = regions.shape
    side = image.shape[-1]
    picture = image[0].numpy()
    extent = (0, side, side, 0)
    fig = Figure(figsize=(13, 4.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    axes[0].imshow(picture, cmap="gray")
    for x0, y0, x1, y1 in truth["boxes"].tolist():
        axes[0].add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor="lime", lw=1.5))
    kept = detections["scores"] >= min_score
    for box, label, score in zip(
        detections["boxes"][kept].tolist(),
        detections["labels"][kept].tolist(),
        detections["scores"][kept].tolist(),
        strict=True,
    ):
        x0, y0, x1, y1 = box
        axes[0].add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor="red", lw=1.2))
        axes[0].text(x0, y0, f"{class_names[label]} {score:.2f}", color="red", fontsize=7, va="bottom")
    axes[0].set_title(f"true (green), detected >= {min_score:g} (red): {int(kept.sum())}", fontsize=9)
    axes[1].imshow(region_colours(regions).numpy(), cmap="tab20", interpolation="nearest")
    axes[1].set_title(f"ENACT regions, first encoder layer: {maps.count} for {H * W}", fontsize=9)
    axes[2].imshow(picture, cmap="gray")
    axes[2].imshow(boundary_overlay(regions).numpy(), extent=extent, interpolation="nearest")
    axes[2].set_title("region boundaries within rows", fontsize=9)
    return finish_figure(fig, axes, title, out)
