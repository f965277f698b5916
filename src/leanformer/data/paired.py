"""Building blocks of the paired two-modality tasks (``digits_pairs``, ``fashion_pairs``).

Both tasks mimic DRRT's setting, an OCT scan and a visual field of one eye, from a set
of grey source images in [0, 1] ``[N, s, s]``:

- modality A, "the scan": the source resized to ``img_size``, with Gaussian pixel noise
  (``noise_a``) and, for a fraction ``occlude`` of the examples, one quadrant blanked out
  (an artefact; which quadrant is random);
- modality B, "the field": a coarse ``points x points`` grid of point measurements of the
  same source, each the mean ink of its cell plus Gaussian noise (``noise_b``).

Neither side alone is complete (occlusion vs. low resolution), so relating them helps.
Regions: both sides are cut into the same ``2x2`` quadrants, in topographic
correspondence (see :func:`quadrant_labels`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from leanformer.data.registry import DatasetInfo
from leanformer.data.tensor_dataset import channel_stats, normalise, resize_images


class PairedDataset(Dataset):
    """Examples ``((a_i, b_i[, region_a_i, region_b_i]), label_i)`` from stacked tensors.

    ``region_a``/``region_b`` are either one map for all examples (no leading ``N``) or
    one per example; items always carry one map each, so batches stack to ``[B, ...]``.
    """

    def __init__(
        self,
        a: Tensor,
        b: Tensor,
        labels: Tensor,
        info: DatasetInfo,
        *,
        region_a: Tensor | None = None,
        region_b: Tensor | None = None,
        per_example_regions: bool = False,
    ) -> None:
        n = labels.shape[0]
        if labels.ndim != 1 or a.shape[0] != n or b.shape[0] != n:
            raise ValueError(
                f"paired data needs the same number of a, b and labels: got {a.shape[0]}, {b.shape[0]}, {n}"
            )
        if (region_a is None) != (region_b is None):
            raise ValueError("give both region maps (region_a and region_b) or neither")
        self.a, self.b, self.labels, self.info = a, b, labels, info
        self.region_a, self.region_b = region_a, region_b
        self.per_example_regions = per_example_regions

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, index: int) -> tuple[tuple[Tensor, ...], Tensor]:
        inputs: tuple[Tensor, ...] = (self.a[index], self.b[index])
        if self.region_a is not None and self.region_b is not None:
            if self.per_example_regions:
                inputs += (self.region_a[index], self.region_b[index])
            else:
                inputs += (self.region_a, self.region_b)
        return inputs, self.labels[index]


def quadrant_labels(rows: int, cols: int) -> Tensor:
    """``[rows, cols]`` labels 0..3: top-left, top-right, bottom-left, bottom-right."""
    r = (torch.arange(rows) * 2 // rows)[:, None]
    c = (torch.arange(cols) * 2 // cols)[None, :]
    return r * 2 + c


def check_view_options(
    task: str,
    *,
    source: str,
    side: int,
    img_size: int,
    points: int,
    noise_a: float,
    occlude: float,
    noise_b: float,
) -> None:
    """One-line ValueErrors for options :func:`paired_views` cannot honour (``side``: the
    sources' side, which the point grid must divide; ``source``: what they are, in words)."""
    if img_size < 8 or img_size % 2:
        raise ValueError(f"{task} img_size must be even and >= 8, got {img_size}")
    if points < 2 or side % points:
        divisors = [d for d in range(2, side + 1) if side % d == 0]
        choices = ", ".join(map(str, divisors[:-1])) + f" or {divisors[-1]}"
        raise ValueError(f"{task} points must divide the {side}x{side} {source} ({choices}), got {points}")
    if noise_a < 0 or noise_b < 0 or not 0.0 <= occlude <= 1.0:
        raise ValueError(f"noise must be >= 0 and occlude in [0, 1]; got {noise_a}, {noise_b}, {occlude}")


def paired_views(
    sources: Tensor,
    img_size: int,
    points: int,
    noise_a: float,
    occlude: float,
    noise_b: float,
    gen: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """Sources in [0, 1] ``[N, s, s]`` -> (images ``[N, 1, S, S]``, point grids ``[N, P]``).

    ``points`` must divide ``s``; all randomness comes from ``gen``, drawn in a fixed order
    (pixel noise, quadrants, which examples are occluded, point noise).
    """
    n, side = sources.shape[0], sources.shape[-1]
    images = resize_images(sources[:, None].float(), img_size)
    images = images + noise_a * torch.randn(images.shape, generator=gen)
    # Blank one random quadrant of a random subset (multiplying by a per-example mask).
    quadrant = torch.randint(0, 4, (n,), generator=gen)
    hit = torch.rand(n, generator=gen) < occlude
    blank = (quadrant_labels(img_size, img_size)[None] == quadrant[:, None, None]) & hit[:, None, None]
    images = images.masked_fill(blank[:, None], 0.0)
    cell = side // points
    grid = sources.float().reshape(n, points, cell, points, cell).mean(dim=(2, 4)).flatten(1)
    grid = grid + noise_b * torch.randn(grid.shape, generator=gen)
    return images, grid


def paired_dataset(
    views: tuple[Tensor, Tensor],
    labels: Tensor,
    reference: tuple[Tensor, Tensor],
    *,
    points: int,
    return_regions: bool,
) -> PairedDataset:
    """The dataset of ``views`` (images, grids), both modalities standardised with the
    statistics of ``reference`` (training views), with the quadrant maps when asked."""
    (a, b), (a_train, b_train) = views, reference
    mean_a, std_a = channel_stats(a_train)
    a = normalise(a, mean_a, std_a)
    b = (b - b_train.mean()) / b_train.std()
    img_size = a.shape[-1]
    info = DatasetInfo(num_classes=10, in_chans=1, img_size=img_size, inputs=2)
    regions: dict[str, Any] = {}
    if return_regions:
        regions = dict(
            region_a=quadrant_labels(img_size, img_size), region_b=quadrant_labels(points, points).flatten()
        )
    return PairedDataset(a.contiguous(), b.contiguous(), labels, info, **regions)


__all__ = ["PairedDataset", "check_view_options", "paired_dataset", "paired_views", "quadrant_labels"]
