"""CIFAR-10 from the standard python-pickle batches in a local folder (never downloaded).

Not torchvision's ``CIFAR10``: it refuses any batch file whose MD5 differs from the
published archive's, so it cannot read a subset, a re-pickled copy or a tiny test fixture;
the format itself is six pickled dicts, read below in a few lines.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from leanformer.data.registry import DatasetInfo, register_dataset
from leanformer.data.tensor_dataset import TensorImageDataset, normalise, resize_images

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
# Per-channel statistics of the CIFAR-10 training set (the usual published values).
MEAN = torch.tensor([0.4914, 0.4822, 0.4465])
STD = torch.tensor([0.2470, 0.2435, 0.2616])


def _batch_dir(root: Path) -> Path:
    # Accept either the folder holding the batches or its parent (the tarball's layout).
    nested = root / "cifar-10-batches-py"
    return nested if nested.is_dir() else root


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with path.open("rb") as handle:
        entry = pickle.load(handle, encoding="latin1")
    data = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    labels = np.asarray(entry.get("labels", entry.get("fine_labels")), dtype=np.int64)
    return data, labels


@register_dataset("cifar10")
def build_cifar10(*, split: str, root: str | None = None, img_size: int = 32) -> TensorImageDataset:
    """CIFAR-10 ``[3, img_size, img_size]`` from ``root`` (python-pickle batches)."""
    if root is None:
        raise ValueError(
            "cifar10 needs a local folder: pass root=... (--data-root) holding the python batches"
        )
    folder = _batch_dir(Path(root))
    files = TRAIN_FILES if split == "train" else TEST_FILES
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise ValueError(
            f"CIFAR-10 batches missing in {folder}: {', '.join(missing)} "
            f"(expected {', '.join(TRAIN_FILES + TEST_FILES)}; leanformer never downloads data)"
        )
    parts = [_read_batch(folder / name) for name in files]
    images = torch.from_numpy(np.concatenate([p[0] for p in parts])).float() / 255.0
    labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    images = normalise(resize_images(images, img_size), MEAN, STD)
    info = DatasetInfo(
        num_classes=10, in_chans=3, img_size=img_size, mean=tuple(MEAN.tolist()), std=tuple(STD.tolist())
    )
    return TensorImageDataset(images, labels, info)
