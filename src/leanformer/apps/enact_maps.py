"""ENACT's entropy map, curvature signs and regions for one image: the figure of
`leanformer visualize enact`.

The image (one of the two photographs scikit-learn ships, any image file, or smooth
noise) goes through a fixed, seeded conv stem; its features through an
:class:`EntropyClusteredAttention` (seeded and untrained, or the first ENACT layer of a
trained ``detr_encoder`` checkpoint). The figure shows the input, the entropy map
``-p log2 p``, the curvature signs and the region boundaries (row-major runs of equal
sign) over the input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image, UnidentifiedImageError
from sklearn.datasets import load_sample_image
from torch import Tensor, nn

from leanformer.apps.plots import save_figure
from leanformer.engine.checkpoint import load_model
from leanformer.layers.enact_attention import EntropyClusteredAttention
from leanformer.memory_budget import check_image_pixels
from leanformer.ops.entropy_map import curvature_signs
from leanformer.ops.regions import plan_from_signs

SAMPLES = {"china": "china.jpg", "flower": "flower.jpg"}  # shipped inside scikit-learn


def load_image(path: str | None, sample: str, *, seed: int = 0) -> tuple[Tensor, str]:
    """RGB image ``[3, h, w]`` in [0, 1] and its name: the file at ``path`` if given, else
    the bundled ``sample`` (a key of :data:`SAMPLES`, or ``noise``: smooth noise drawn from ``seed``)."""
    if path:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"--input {path!r} is not a file")
        try:
            with Image.open(file) as img:  # reads the header only: the size, before decoding
                check_image_pixels(*img.size, f"--input {path!r}")
                rgb = img.convert("RGB")
        except UnidentifiedImageError:
            raise ValueError(f"--input {path!r} is not an image file PIL can read") from None
        arr = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
        return arr.view(rgb.height, rgb.width, 3).permute(2, 0, 1).float() / 255.0, file.name
    if sample == "noise":
        gen = torch.Generator().manual_seed(seed)
        coarse = torch.rand(1, 3, 12, 16, generator=gen)
        return F.interpolate(coarse, size=(384, 512), mode="bilinear", align_corners=False)[0], "noise"
    photo = load_sample_image(SAMPLES[sample])  # uint8 [h, w, 3]
    return torch.tensor(photo).permute(2, 0, 1).float() / 255.0, sample


def conv_stem(stride: int, out_dim: int, seed: int) -> nn.Module:
    """Seeded stride-``stride`` stem: 3x3 stride-2 conv + ReLU stages widening to ``out_dim``."""
    if stride < 2 or stride & (stride - 1):
        raise ValueError(f"--stride must be a power of 2 >= 2, got {stride}")
    torch.manual_seed(seed)
    stages = int(math.log2(stride))
    dims = [3] + [min(out_dim, 32 * 2**i) for i in range(stages - 1)] + [out_dim]
    layers: list[nn.Module] = []
    for i in range(stages):
        layers += [nn.Conv2d(dims[i], dims[i + 1], 3, stride=2, padding=1), nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # no ReLU at the end: keep signed features


def enact_attention(
    checkpoint: str | None, *, d_model: int, sigma: float | None, seed: int
) -> EntropyClusteredAttention:
    """The first ENACT layer of a ``detr_encoder`` ``checkpoint`` (with the sigma it was
    trained with, unless ``sigma`` is given), else a seeded, untrained one of width
    ``d_model`` (``sigma`` default 3, ENACT's)."""
    if checkpoint:
        model = load_model(checkpoint)
        layers = getattr(model, "layers", [])
        attn = next((l.self_attn for l in layers if isinstance(l.self_attn, EntropyClusteredAttention)), None)
        if attn is None:
            raise ValueError(
                f"{checkpoint!r} holds no ENACT attention (train detr_encoder --attention enact)"
            )
        if sigma is not None:
            attn.sigma = sigma
        return attn
    torch.manual_seed(seed)
    return EntropyClusteredAttention(d_model, 8, sigma=3.0 if sigma is None else sigma)


@dataclass
class EnactMaps:
    """What ENACT computes for one image on its ``[H, W]`` feature grid."""

    entropy: Tensor  # [H, W] -p log2 p
    signs: Tensor  # [H, W] curvature sign, True where concave
    regions: Tensor  # [H, W] region id (row-major runs of equal sign)
    count: int  # regions, the tokens ENACT's attention runs on


def enact_maps(image: Tensor, stem: nn.Module, attn: EntropyClusteredAttention) -> EnactMaps:
    """Standardise ``image [3, h, w]``, run it through ``stem`` and ``attn``'s entropy and
    region plan."""
    mean = image.mean(dim=(1, 2), keepdim=True)
    std = image.std(dim=(1, 2), keepdim=True).clamp(min=1e-6)
    with torch.no_grad():
        feats = stem(((image - mean) / std)[None])  # [1, C, H, W]
        _, _, H, W = feats.shape
        return maps_of_tokens(feats.flatten(2).transpose(1, 2), (H, W), attn)


def maps_of_tokens(tokens: Tensor, shape: tuple[int, int], attn: EntropyClusteredAttention) -> EnactMaps:
    """The maps of ``attn`` for one map's tokens ``[1, HW, C]`` (what its queries and keys
    are computed from) on an ``(H, W)`` grid."""
    H, W = shape
    with torch.no_grad():
        entropy = attn.entropy(tokens, None)  # [1, HW]
        signs = curvature_signs(entropy.view(1, H, W), sigma=attn.sigma)
        plan = plan_from_signs(signs.view(1, H * W))
    return EnactMaps(
        entropy=entropy.view(H, W),
        signs=signs[0],
        regions=plan.region_id.view(H, W),
        count=int(plan.counts[0]),
    )


def region_colours(regions: Tensor) -> Tensor:
    """Region ids ``[H, W]`` shuffled by a fixed permutation, so neighbouring regions get
    different colours of a qualitative map."""
    gen = torch.Generator().manual_seed(0)
    return torch.randperm(int(regions.max()) + 1, generator=gen)[regions]


def boundary_overlay(regions: Tensor) -> Tensor:
    """An RGBA ``[H, W, 4]`` overlay marking where a region starts inside a row. Regions are
    row-major runs: each is a horizontal segment of one row (or wraps from a row's end to
    the next row's start)."""
    H, W = regions.shape
    starts = torch.zeros(H, W, dtype=torch.bool)
    starts[:, 1:] = regions[:, 1:] != regions[:, :-1]
    overlay = torch.zeros(H, W, 4)
    overlay[starts] = torch.tensor([1.0, 0.1, 0.1, 0.9])
    return overlay


def finish_figure(fig: Figure, axes: Any, title: str, out: Path) -> Path:
    """No ticks, the title, a tight layout, saved to ``out``; returns the file."""
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, out, dpi=110)


def plot_enact_maps(image: Tensor, maps: EnactMaps, out: Path, *, title: str) -> Path:
    """Input, entropy, curvature signs, regions and region boundaries side by side; returns the file."""
    regions = maps.regions
    img = image.permute(1, 2, 0).clamp(0, 1).numpy()
    extent = (0, image.shape[2], image.shape[1], 0)
    # An Agg canvas of its own, as in leanformer.apps.plots: pyplot's global backend is left alone.
    fig = Figure(figsize=(20, 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 5)
    axes[0].imshow(img)
    axes[0].set_title("input")
    im = axes[1].imshow(maps.entropy.numpy(), cmap="viridis")
    axes[1].set_title("entropy -p log2 p")
    fig.colorbar(im, ax=axes[1], fraction=0.035)
    axes[2].imshow(maps.signs.float().numpy() * 2 - 1, cmap="coolwarm", vmin=-1, vmax=1)
    axes[2].set_title("curvature sign (+1 concave)")
    axes[3].imshow(region_colours(regions).numpy(), cmap="tab20", interpolation="nearest")
    axes[3].set_title(f"regions ({int(regions.max()) + 1})")
    axes[4].imshow(img)
    axes[4].imshow(boundary_overlay(regions).numpy(), extent=extent, interpolation="nearest")
    axes[4].set_title("region boundaries within rows")
    return finish_figure(fig, axes, title, out)
