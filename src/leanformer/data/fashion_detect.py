"""``fashion_detect``: Fashion-MNIST garments scattered on square canvases, for detection and segmentation.

Each canvas (``canvas_size`` pixels square, one grey channel) holds 1 to 6 garments at
random positions and sizes (20 to 64 pixels), overlapping a little at most; see
:mod:`leanformer.data.canvas`. Garments come from disjoint pools: ``train`` from the first
50,000 Fashion-MNIST training images, ``val`` from the last 10,000, ``test`` from the
10,000 test images. A split's canvases depend only on ``seed`` and ``num_canvases``, and
are kept in memory once drawn.

``target="detection"`` (default) gives ``(image [1, S, S], target)`` with ``target`` a dict
of ``boxes [K, 4]`` (x0, y0, x1, y1 in pixels), ``labels [K]`` (0-9), ``masks [K, S, S]``
(each garment's visible pixels) and ``image_id``; batch it with :func:`collate_detection`.
``target="semantic"`` gives ``(image, [S, S] int64)``: 0 background, ``1 + class`` elsewhere.
:func:`coco_ground_truth` writes a split's annotations as a COCO dataset dict.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from leanformer.data.canvas import Canvases, CanvasSpec, compose_canvases
from leanformer.data.fashion_mnist import CLASSES, MEAN, STD, find_root, load_split
from leanformer.data.registry import DatasetInfo, register_dataset

TARGETS = ("detection", "semantic")
TRAIN_POOL = 50_000  # the first 50,000 training garments; the last 10,000 are the val pool
DEFAULT_CANVASES = {"train": 20_000, "val": 2_000, "test": 2_000}
_SPLIT_SEED = {"train": 0, "val": 1, "test": 2}  # so splits drawn with one seed differ


class FashionDetect(Dataset):
    """Canvases with normalised images ``[1, S, S]`` and detection or semantic targets."""

    def __init__(self, canvases: Canvases, *, target: str = "detection") -> None:
        if target not in TARGETS:
            raise ValueError(f"fashion_detect target must be one of {', '.join(TARGETS)}, got {target!r}")
        self.canvases = canvases
        self.target = target
        size = canvases.images.shape[-1]
        # A semantic target has 11 classes (background + 10 garments); detection has 10.
        classes = len(CLASSES) + (target == "semantic")
        self.info = DatasetInfo(num_classes=classes, in_chans=1, img_size=size, task=target)

    def __len__(self) -> int:
        return len(self.canvases)

    def __getitem__(self, index: int) -> tuple[Tensor, Any]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        image = (self.canvases.images[index][None].float() / 255 - MEAN) / STD
        if self.target == "semantic":
            return image, self.canvases.semantic(index)
        boxes, labels, masks = self.canvases.instances(index)
        return image, {"boxes": boxes, "labels": labels, "masks": masks, "image_id": index}


def collate_detection(batch: list[tuple[Tensor, dict[str, Any]]]) -> tuple[Tensor, list[dict[str, Any]]]:
    """Images stacked ``[B, 1, S, S]``; targets kept as a list (their object counts differ)."""
    return torch.stack([image for image, _ in batch]), [target for _, target in batch]


@lru_cache(maxsize=4)
def _cached_canvases(folder: Path, split: str, num_canvases: int, seed: int, canvas_size: int) -> Canvases:
    images, labels = load_split(folder, "test" if split == "test" else "train")
    if split == "train":
        images, labels = images[:TRAIN_POOL], labels[:TRAIN_POOL]
    elif split == "val":
        images, labels = images[TRAIN_POOL:], labels[TRAIN_POOL:]
    if len(images) == 0:
        raise ValueError(
            f"fashion_detect split {split!r} draws from training images {TRAIN_POOL + 1} on, "
            f"but {folder} holds {TRAIN_POOL if split == 'val' else 0} or fewer"
        )
    spec = CanvasSpec(canvas_size=canvas_size)
    return compose_canvases(
        torch.from_numpy(np.array(images)),  # a writable copy of the cached pool
        torch.from_numpy(labels.astype(np.int64)),
        num_canvases=num_canvases,
        seed=seed * len(_SPLIT_SEED) + _SPLIT_SEED[split],
        spec=spec,
    )


@register_dataset("fashion_detect")
def build_fashion_detect(
    *,
    split: str,
    root: str | None = None,
    num_canvases: int | None = None,
    seed: int = 0,
    img_size: int = 128,
    target: str = "detection",
) -> Dataset:
    """``num_canvases`` canvases of ``img_size`` pixels (default 20,000 for train, 2,000 for
    val and test), drawn from ``seed``."""
    if target not in TARGETS:
        raise ValueError(f"fashion_detect target must be one of {', '.join(TARGETS)}, got {target!r}")
    if img_size < 64:
        raise ValueError(f"fashion_detect img_size must be >= 64 (garments are up to 64 px), got {img_size}")
    count = DEFAULT_CANVASES[split] if num_canvases is None else num_canvases
    if count < 1:
        raise ValueError(f"fashion_detect num_canvases must be >= 1, got {count}")
    canvases = _cached_canvases(find_root(root), split, count, seed, img_size)
    return FashionDetect(canvases, target=target)


build_fashion_detect.splits = ("train", "val", "test")  # type: ignore[attr-defined]


def coco_ground_truth(
    dataset: FashionDetect, *, masks: bool = False, limit: int | None = None
) -> dict[str, Any]:
    """The canvases' objects as a COCO dataset dict (``images``, ``annotations``, ``categories``).

    Category ids are ``1 + class`` (COCO starts at 1); ``bbox`` is ``[x, y, w, h]``; ``area``
    is the garment's visible pixel count, which sets COCO's small / medium / large.
    ``masks=True`` adds each garment's visible pixels as an uncompressed RLE ``segmentation``;
    ``limit``: only the first ``limit`` canvases.
    """
    canvases = dataset.canvases
    size = canvases.images.shape[-1]
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for index in range(len(canvases) if limit is None else min(limit, len(canvases))):
        images.append({"id": index, "width": size, "height": size, "file_name": f"{index}.png"})
        boxes, labels, instance_masks = canvases.instances(index)
        for box, label, mask in zip(boxes.tolist(), labels.tolist(), instance_masks):
            x0, y0, x1, y1 = box
            note: dict[str, Any] = {
                "id": len(annotations) + 1,
                "image_id": index,
                "category_id": label + 1,
                "bbox": [x0, y0, x1 - x0, y1 - y0],
                "area": float(mask.sum()),
                "iscrowd": 0,
            }
            if masks:
                note["segmentation"] = uncompressed_rle(mask)
            annotations.append(note)
    categories = [{"id": c + 1, "name": name} for c, name in enumerate(CLASSES)]
    return {"images": images, "annotations": annotations, "categories": categories}


def uncompressed_rle(mask: Tensor) -> dict[str, Any]:
    """COCO's uncompressed run-length encoding of ``mask [H, W]``: run lengths of the pixels in
    column-major order, starting with a run of zeros (possibly empty)."""
    flat = mask.t().flatten().to(torch.int8)
    changes = (flat[1:] != flat[:-1]).nonzero().flatten() + 1
    edges = torch.cat([torch.tensor([0]), changes, torch.tensor([flat.numel()])])
    runs = (edges[1:] - edges[:-1]).tolist()
    if flat.numel() and bool(flat[0]):
        runs = [0, *runs]
    return {"size": list(mask.shape), "counts": runs}
