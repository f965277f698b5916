"""Paired two-modality data: the bundled ``digits_pairs`` task and local ``paired_arrays``.

``digits_pairs`` is built from scikit-learn's digits (the same seeded stratified split
as ``digits``) to mimic DRRT's setting, an OCT scan and a visual field of one eye:

- modality A, "the scan": the digit resized to ``img_size`` (default 32x32), with
  Gaussian pixel noise (``noise_a``) and, for a fraction ``occlude`` of the examples,
  one quadrant blanked out (an artefact; which quadrant is random);
- modality B, "the field": a coarse ``points x points`` grid (default 4x4) of point
  measurements of the same digit, each the mean ink of its cell plus Gaussian noise
  (``noise_b``), like sensitivity thresholds at test locations.

Neither side alone is complete (occlusion vs. low resolution), so relating them helps.
Regions: both sides are cut into the same ``2x2`` quadrants (top-left, top-right,
bottom-left, bottom-right), in topographic correspondence; these are the DRRT models'
default labels, so items are ``((a, b), target)``. With ``return_regions=True`` items
are ``((a, b, region_a, region_b), target)`` with ``region_a`` a pixel map ``[H, W]`` and
``region_b`` one label per point ``[P]``. All noise and occlusions are drawn once from
``seed`` when the dataset is built: every epoch and every evaluation sees the same data.

``paired_arrays`` loads local paired data (``root``: a ``.npz`` file, or a folder with
``train.npz`` and ``test.npz``) holding ``a`` (``[N, C, H, W]`` images or ``[N, P]`` /
``[N, P, F]`` measurements), ``b`` (same choices), ``labels`` ``[N]`` and optionally
``region_a``/``region_b`` (one map shared by all examples, or one per example) and, in
a single file, ``split`` (``[N]``, "train"/"test"; without it a seeded stratified split
is made). Arrays are used as they are (normalise them beforehand).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.model_selection import train_test_split
from torch import Tensor
from torch.utils.data import Dataset

from leanformer.data.digits import digits_split
from leanformer.data.registry import DatasetInfo, register_dataset
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


@register_dataset("digits_pairs")
def build_digits_pairs(
    *,
    split: str,
    img_size: int = 32,
    points: int = 4,
    noise_a: float = 0.3,
    occlude: float = 0.5,
    noise_b: float = 0.15,
    return_regions: bool = False,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    seed: int = 0,
) -> PairedDataset:
    """Digits as (noisy, partly occluded image ``[1, S, S]``, noisy point grid ``[P]``) pairs."""
    if img_size < 8 or img_size % 2:
        raise ValueError(f"digits_pairs img_size must be even and >= 8, got {img_size}")
    if points < 2 or 8 % points:
        raise ValueError(f"digits_pairs points must divide the 8x8 scans (2, 4 or 8), got {points}")
    if noise_a < 0 or noise_b < 0 or not 0.0 <= occlude <= 1.0:
        raise ValueError(f"noise must be >= 0 and occlude in [0, 1]; got {noise_a}, {noise_b}, {occlude}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    x_train, x_test, y_train, y_test = digits_split(test_fraction, split_seed)
    # One noise stream per split (the same stream would give train and test twins); the
    # training data is always drawn, as its statistics standardise both splits.
    gen = torch.Generator().manual_seed(2 * seed)
    a_train, b_train = _modalities(
        torch.from_numpy(x_train), img_size, points, noise_a, occlude, noise_b, gen
    )
    if split == "train":
        a, b, y = a_train, b_train, y_train
    else:
        gen = torch.Generator().manual_seed(2 * seed + 1)
        a, b = _modalities(torch.from_numpy(x_test), img_size, points, noise_a, occlude, noise_b, gen)
        y = y_test
    # Standardise both modalities with the training split's statistics.
    mean_a, std_a = channel_stats(a_train)
    a = normalise(a, mean_a, std_a)
    b = (b - b_train.mean()) / b_train.std()
    info = DatasetInfo(num_classes=10, in_chans=1, img_size=img_size, inputs=2)
    regions: dict[str, Any] = {}
    if return_regions:
        regions = dict(
            region_a=quadrant_labels(img_size, img_size), region_b=quadrant_labels(points, points).flatten()
        )
    return PairedDataset(a.contiguous(), b.contiguous(), torch.from_numpy(y).long(), info, **regions)


def _modalities(
    scans: Tensor,
    img_size: int,
    points: int,
    noise_a: float,
    occlude: float,
    noise_b: float,
    gen: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """8x8 scans in [0, 1] ``[N, 8, 8]`` -> (images ``[N, 1, S, S]``, point grids ``[N, P]``)."""
    n = scans.shape[0]
    images = resize_images(scans[:, None].float(), img_size)
    images = images + noise_a * torch.randn(images.shape, generator=gen)
    # Blank one random quadrant of a random subset (multiplying by a per-example mask).
    quadrant = torch.randint(0, 4, (n,), generator=gen)
    hit = torch.rand(n, generator=gen) < occlude
    blank = (quadrant_labels(img_size, img_size)[None] == quadrant[:, None, None]) & hit[:, None, None]
    images = images.masked_fill(blank[:, None], 0.0)
    cell = 8 // points
    grid = scans.reshape(n, points, cell, points, cell).mean(dim=(2, 4)).flatten(1)
    grid = grid + noise_b * torch.randn(grid.shape, generator=gen)
    return images, grid


@register_dataset("paired_arrays")
def build_paired_arrays(
    *, split: str, root: str, test_fraction: float = 0.2, split_seed: int = 0
) -> PairedDataset:
    """Local paired data: ``root`` is a ``.npz`` file, or a folder with ``train.npz`` and ``test.npz``."""
    path = Path(root).expanduser()
    file = path / f"{split}.npz" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"paired_arrays: no such file {str(file)!r}")
    with np.load(file, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    missing = [k for k in ("a", "b", "labels") if k not in arrays]
    if missing:
        raise ValueError(
            f"paired_arrays: {file.name} lacks array(s) {', '.join(missing)} (needs a, b, labels)"
        )
    a = torch.from_numpy(arrays["a"]).float()
    b = torch.from_numpy(arrays["b"]).float()
    labels = torch.from_numpy(arrays["labels"]).long()
    n = labels.shape[0]
    if labels.ndim != 1 or a.shape[0] != n or b.shape[0] != n:
        raise ValueError(
            f"paired_arrays: a, b and labels must have the same length, got {a.shape[0]}, {b.shape[0]}, {n}"
        )
    if int(labels.min()) < 0:
        raise ValueError("paired_arrays: labels must be class indices >= 0")
    if path.is_dir():
        index = torch.arange(n)  # one file per split
    elif "split" in arrays:
        names = np.asarray(arrays["split"]).astype(str)
        if names.shape != (n,) or not set(names) <= {"train", "test"}:
            raise ValueError("paired_arrays: 'split' must hold 'train' or 'test' for every example")
        index = torch.from_numpy(np.flatnonzero(names == split))
    else:
        train_idx, test_idx = train_test_split(
            np.arange(n), test_size=test_fraction, stratify=labels.numpy(), random_state=split_seed
        )
        index = torch.from_numpy(np.sort(train_idx if split == "train" else test_idx))
    regions, per_example = _regions(arrays, n, index)
    info = DatasetInfo(
        num_classes=int(labels.max()) + 1,
        in_chans=a.shape[1] if a.ndim == 4 else None,
        img_size=a.shape[-1] if a.ndim == 4 and a.shape[-1] == a.shape[-2] else None,
        inputs=2,
    )
    return PairedDataset(a[index], b[index], labels[index], info, per_example_regions=per_example, **regions)


def _regions(arrays: dict[str, np.ndarray], n: int, index: Tensor) -> tuple[dict[str, Tensor], bool]:
    """Region maps from the file: shared by all examples, or per example (indexed by ``index``)."""
    if "region_a" not in arrays and "region_b" not in arrays:
        return {}, False
    if "region_a" not in arrays or "region_b" not in arrays:
        raise ValueError("paired_arrays: give both region_a and region_b, or neither")
    ra, rb = (torch.from_numpy(arrays[k]) for k in ("region_a", "region_b"))
    if ra.dtype.is_floating_point or rb.dtype.is_floating_point:
        raise ValueError("paired_arrays: region maps must hold integer labels")
    per_a, per_b = _per_example(ra, arrays["a"]), _per_example(rb, arrays["b"])
    if per_a != per_b:
        raise ValueError("paired_arrays: region_a and region_b must both be shared or both per example")
    if per_a:
        if ra.shape[0] != n or rb.shape[0] != n:
            raise ValueError(
                f"paired_arrays: per-example region maps need {n} entries, got {ra.shape[0]}, {rb.shape[0]}"
            )
        ra, rb = ra[index], rb[index]
    return {"region_a": ra.long(), "region_b": rb.long()}, per_a


def _per_example(region: Tensor, data: np.ndarray) -> bool:
    """Whether a region map has a leading example axis.

    Shared maps are ``[H, W]`` (pixel map of an image side) or ``[T]`` (one label per
    token or point); per-example maps add a leading ``N``.
    """
    if data.ndim == 4:
        return region.ndim == 3 or (region.ndim == 2 and tuple(region.shape) != data.shape[-2:])
    return region.ndim == 2


__all__ = ["PairedDataset", "build_digits_pairs", "build_paired_arrays", "quadrant_labels"]
