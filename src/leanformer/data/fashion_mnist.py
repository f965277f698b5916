"""Fashion-MNIST (Xiao et al., 2017): 70,000 real 28x28 grey photographs of clothing, 10 classes.

Read from the four standard IDX files (gzipped or not) in a local folder, never
downloaded. The folder is, in order: ``root`` (``--data-root``),
``$LEANFORMER_DATA/fashion-mnist``, then where Debian's ``dataset-fashion-mnist``
package installs them.

``validation=N`` sets the last N training images aside: ``split="train"`` then gives
the first 60,000 - N and ``split="val"`` the last N, so methods can be compared
without looking at the test set.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from leanformer.data.augment import ShiftFlipDataset
from leanformer.data.idx import IdxError, read_idx
from leanformer.data.registry import DatasetInfo, register_dataset
from leanformer.data.tensor_dataset import TensorImageDataset, normalise, resize_images

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
CLASSES = (
    *("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat"),
    *("Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"),
)
# Mean and std of the 60,000 training images' pixels in [0, 1].
MEAN, STD = 0.2860, 0.3530
HOW_TO_GET = (
    "install Debian's package (apt-get install dataset-fashion-mnist) or put the four files "
    f"{', '.join(n + '.gz' for pair in FILES.values() for n in pair)} from the dataset's publisher "
    "(Zalando Research) in a folder and pass it as --data-root"
)


def default_roots() -> list[Path]:
    """The folders searched when no root is given, in order."""
    roots = []
    if os.environ.get("LEANFORMER_DATA"):
        roots.append(Path(os.environ["LEANFORMER_DATA"]) / "fashion-mnist")
    roots.append(DEBIAN_DIR)
    return roots


def _find(folder: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (folder / name).is_file():
            return folder / name
    return None


def find_root(root: str | Path | None = None) -> Path:
    """The first folder holding all four files; a ValueError saying how to get them otherwise."""
    candidates = [Path(root)] if root is not None else default_roots()
    for folder in candidates:
        if all(_find(folder, stem) for pair in FILES.values() for stem in pair):
            return folder
    looked = ", ".join(str(c) for c in candidates)
    raise ValueError(f"Fashion-MNIST files not found (looked in {looked}): {HOW_TO_GET}")


def is_available(root: str | Path | None = None) -> bool:
    try:
        find_root(root)
    except ValueError:
        return False
    return True


@lru_cache(maxsize=4)
def load_split(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images [N, 28, 28] uint8, labels [N] uint8)``, checked against each other."""
    image_path, label_path = (_find(folder, stem) for stem in FILES[split])
    assert image_path is not None and label_path is not None  # find_root checked
    try:
        images, labels = read_idx(image_path), read_idx(label_path)
    except IdxError as exc:
        raise ValueError(f"bad Fashion-MNIST file: {exc}") from None
    if images.ndim != 3:
        raise ValueError(f"bad Fashion-MNIST file: {image_path} holds shape {images.shape}, not [N, H, W]")
    if labels.ndim != 1:
        raise ValueError(f"bad Fashion-MNIST file: {label_path} holds shape {labels.shape}, not [N]")
    if len(images) != len(labels):
        raise ValueError(
            f"bad Fashion-MNIST files: {len(images)} images in {image_path.name} "
            f"but {len(labels)} labels in {label_path.name}"
        )
    if labels.size and int(labels.max()) >= len(CLASSES):
        top = int(labels.max())
        raise ValueError(f"bad Fashion-MNIST file: {label_path} holds label {top} (classes 0-9)")
    return images, labels


def validation_cut(train_images: int, validation: int) -> int:
    """Where the validation split starts: the last ``validation`` of ``train_images``."""
    if not 0 < validation < train_images:
        raise ValueError(f"validation must be in [1, {train_images - 1}], got {validation}")
    return train_images - validation


@register_dataset("fashion_mnist")
def build_fashion_mnist(
    *,
    split: str,
    root: str | None = None,
    img_size: int = 28,
    validation: int = 0,
    augment: bool = False,
) -> Dataset:
    """Fashion-MNIST as ``[1, img_size, img_size]`` normalised images, 10 classes.

    ``augment``: random shifts of up to 2 pixels and left-right flips on the training split
    (the other splits ignore it, so one set of data options serves a whole run).
    """
    if img_size < 8:
        raise ValueError(f"fashion_mnist img_size must be >= 8, got {img_size}")
    if split == "val" and validation < 1:
        raise ValueError("fashion_mnist split 'val' needs validation=N (the last N training images)")
    folder = find_root(root)
    images, labels = load_split(folder, "test" if split == "test" else "train")
    if split != "test" and validation:
        cut = validation_cut(len(images), validation)
        images, labels = (images[cut:], labels[cut:]) if split == "val" else (images[:cut], labels[:cut])
    pixels = torch.from_numpy(images.astype(np.float32) / 255.0)[:, None]
    pixels = normalise(resize_images(pixels, img_size), torch.tensor([MEAN]), torch.tensor([STD]))
    info = DatasetInfo(num_classes=len(CLASSES), in_chans=1, img_size=img_size, mean=(MEAN,), std=(STD,))
    dataset = TensorImageDataset(pixels, torch.from_numpy(labels.astype(np.int64)), info)
    if augment and split == "train":
        return ShiftFlipDataset(dataset, max_shift=2, fill=-MEAN / STD)
    return dataset


build_fashion_mnist.splits = ("train", "val", "test")  # type: ignore[attr-defined]
