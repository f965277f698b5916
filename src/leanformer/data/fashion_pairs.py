"""``fashion_pairs``: the paired two-modality task of ``digits_pairs`` on Fashion-MNIST.

Each garment gives a pair (see :mod:`leanformer.data.paired`):

- modality A: the 28x28 photograph (resized to ``img_size``) with Gaussian pixel noise
  (``noise_a``) and, for a fraction ``occlude`` of the examples, one quadrant blanked out;
- modality B: a coarse ``points x points`` grid (default 7x7, one point per 4x4-pixel
  cell) of the garment's mean ink per cell, plus Gaussian noise (``noise_b``).

Splits: the 10,000 test images give the test pairs; ``validation=N`` sets the last N
training images aside as the ``val`` pairs (``train`` is then the first 60,000 - N).
The noise and occlusions of the training images are drawn for all 60,000 at once from
``seed``, before the cut; the test images draw from a stream of their own. Both
modalities are standardised with the statistics of all 60,000 training pairs (as
``fashion_mnist`` uses the mean and std of all 60,000 training images), so an image gets
the same pair whatever N is, and the test pairs need no ``validation`` option to match a
run's. Items are ``((a, b), target)``, or with
``return_regions=True`` ``((a, b, region_a, region_b), target)``: the quadrants of both
sides, the DRRT models' default regions.

The images are read as ``fashion_mnist`` reads them (``root``, ``$LEANFORMER_DATA``, then
Debian's package), never downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from leanformer.data.fashion_mnist import find_root, load_split, validation_cut
from leanformer.data.paired import PairedDataset, check_view_options, paired_dataset, paired_views
from leanformer.data.registry import register_dataset

SIDE = 28  # Fashion-MNIST's images are 28x28; the point grid must divide them


@register_dataset("fashion_pairs")
def build_fashion_pairs(
    *,
    split: str,
    root: str | None = None,
    img_size: int = SIDE,
    points: int = 7,
    noise_a: float = 0.3,
    occlude: float = 0.5,
    noise_b: float = 0.15,
    validation: int = 0,
    return_regions: bool = False,
    seed: int = 0,
) -> PairedDataset:
    """Fashion-MNIST as (noisy, partly occluded image ``[1, S, S]``, noisy point grid ``[P]``) pairs."""
    check_view_options(
        "fashion_pairs",
        source="images",
        side=SIDE,
        img_size=img_size,
        points=points,
        noise_a=noise_a,
        occlude=occlude,
        noise_b=noise_b,
    )
    if split == "val" and validation < 1:
        raise ValueError("fashion_pairs split 'val' needs validation=N (the last N training images)")
    folder = find_root(root)
    images, labels = _load(folder, "train")
    cut = validation_cut(len(images), validation) if validation else len(images)
    views = (img_size, points, noise_a, occlude, noise_b)
    every = paired_views(_pixels(images), *views, torch.Generator().manual_seed(2 * seed))
    if split == "test":
        images, labels = _load(folder, "test")
        chosen = paired_views(_pixels(images), *views, torch.Generator().manual_seed(2 * seed + 1))
    elif split == "val":
        chosen, labels = (every[0][cut:], every[1][cut:]), labels[cut:]
    else:
        chosen, labels = (every[0][:cut], every[1][:cut]), labels[:cut]
    targets = torch.from_numpy(labels.astype(np.int64))
    return paired_dataset(chosen, targets, every, points=points, return_regions=return_regions)


def _load(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST's uint8 images and labels of ``split``, checked to be 28x28."""
    images, labels = load_split(folder, split)
    if images.shape[1:] != (SIDE, SIDE):
        raise ValueError(
            f"fashion_pairs needs {SIDE}x{SIDE} images, the {split} file holds {images.shape[1:]}"
        )
    return images, labels


def _pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 ``[N, 28, 28]`` -> float ``[N, 28, 28]`` in [0, 1]."""
    return torch.from_numpy(images.astype(np.float32) / 255.0)


build_fashion_pairs.splits = ("train", "val", "test")  # type: ignore[attr-defined]

__all__ = ["build_fashion_pairs"]
