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
The views are made by :mod:`leanformer.data.paired`, shared with ``fashion_pairs``.

``paired_arrays`` loads local paired data (``root``: a ``.npz`` file, or a folder with
``train.npz`` and ``test.npz``) holding ``a`` (``[N, C, H, W]`` images or ``[N, P]`` /
``[N, P, F]`` measurements), ``b`` (same choices), ``labels`` ``[N]`` and optionally
``region_a``/``region_b`` (one map shared by all examples, or one per example) and, in
a single file, ``split`` (``[N]``, "train"/"test"; without it a seeded stratified split
is made). Arrays are used as they are (normalise them beforehand).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from sklearn.model_selection import train_test_split
from torch import Tensor

from leanformer.data.digits import digits_split
from leanformer.data.paired import (
    PairedDataset,
    check_view_options,
    paired_dataset,
    paired_views,
    quadrant_labels,
)
from leanformer.data.registry import DatasetInfo, register_dataset


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
    check_view_options(
        "digits_pairs",
        source="scans",
        side=8,
        img_size=img_size,
        points=points,
        noise_a=noise_a,
        occlude=occlude,
        noise_b=noise_b,
    )
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    x_train, x_test, y_train, y_test = digits_split(test_fraction, split_seed)
    # One noise stream per split (the same stream would give train and test twins); the
    # training data is always drawn, as its statistics standardise both splits.
    views = (img_size, points, noise_a, occlude, noise_b)
    train = paired_views(torch.from_numpy(x_train), *views, torch.Generator().manual_seed(2 * seed))
    if split == "train":
        return paired_dataset(
            train, torch.from_numpy(y_train).long(), train, points=points, return_regions=return_regions
        )
    test = paired_views(torch.from_numpy(x_test), *views, torch.Generator().manual_seed(2 * seed + 1))
    return paired_dataset(
        test, torch.from_numpy(y_test).long(), train, points=points, return_regions=return_regions
    )


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
