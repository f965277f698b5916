"""The bundled default data: scikit-learn's handwritten digits (real 8x8 scans, 1,797 images).

Resized to ``img_size`` (default 32x32), split train/test by a fixed seeded stratified
split, and normalised with the training split's mean and std. Nothing is downloaded:
the images ship inside scikit-learn.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from leanformer.data.registry import DatasetInfo, register_dataset
from leanformer.data.tensor_dataset import TensorImageDataset, channel_stats, normalise, resize_images


@lru_cache(maxsize=4)
def digits_split(
    test_fraction: float, split_seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, x_test, y_train, y_test)``; images in [0, 1], shape ``[N, 8, 8]``."""
    bunch = load_digits()
    images = (bunch.images / 16.0).astype(np.float32)
    return tuple(
        train_test_split(
            images, bunch.target, test_size=test_fraction, stratify=bunch.target, random_state=split_seed
        )
    )


@register_dataset("digits")
def build_digits(
    *, split: str, img_size: int = 32, channels: int = 1, test_fraction: float = 0.2, split_seed: int = 0
) -> TensorImageDataset:
    """Digits as ``[channels, img_size, img_size]`` images with 10 classes."""
    if img_size < 8:
        raise ValueError(f"digits img_size must be >= 8 (the scans are 8x8), got {img_size}")
    if channels not in (1, 3):
        raise ValueError(f"digits channels must be 1 or 3, got {channels}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    x_train, x_test, y_train, y_test = digits_split(test_fraction, split_seed)
    train = resize_images(torch.from_numpy(x_train)[:, None], img_size)
    mean, std = channel_stats(train)
    images = train if split == "train" else resize_images(torch.from_numpy(x_test)[:, None], img_size)
    images = normalise(images, mean, std).expand(-1, channels, -1, -1).contiguous()
    labels = torch.from_numpy(y_train if split == "train" else y_test).long()
    grey = (float(mean[0]),) * channels, (float(std[0]),) * channels
    info = DatasetInfo(num_classes=10, in_chans=channels, img_size=img_size, mean=grey[0], std=grey[1])
    return TensorImageDataset(images, labels, info)
