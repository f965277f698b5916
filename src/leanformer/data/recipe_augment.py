"""The training recipe's image augmentation: timm's RandAugment and random erasing.

Images in our data sets are normalised tensors; RandAugment's policies work on PIL
images. :class:`RecipeAugmentDataset` undoes the normalisation (``DatasetInfo.mean/std``),
runs the policy on the 8-bit image (grey images stay one-channel: PIL's ``L`` mode),
normalises again and erases boxes on the result. Randomness: see
:mod:`leanformer.data.host_random` (exactly resumable).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image
from timm.data.auto_augment import rand_augment_transform
from timm.data.random_erasing import RandomErasing
from torch import Tensor
from torch.utils.data import Dataset

from leanformer.data.host_random import seeded_by_torch
from leanformer.data.registry import DatasetInfo

ERASE_MODES = ("const", "rand", "pixel")


def build_rand_augment(policy: str, info: DatasetInfo) -> Any:
    """timm's RandAugment for ``policy`` (``rand-m9-mstd0.5``), its fill the data's mean
    colour and its translations scaled to the image size (as timm's ``create_transform``
    does); a ValueError naming the policy when timm cannot read it."""
    if info.mean is None or info.img_size is None:
        raise ValueError("aug.randaugment needs a data set of images with a known normalisation")
    fill = tuple(min(255, round(255 * m)) for m in info.mean)
    hparams = {
        "translate_const": int(info.img_size * 0.45),
        # PIL fills a one-channel image with a number, a colour image with a tuple.
        "img_mean": fill[0] if len(fill) == 1 else fill,
    }
    if not policy.startswith("rand"):
        raise ValueError(f"aug.randaugment: {policy!r} is not a RandAugment policy (e.g. rand-m9-mstd0.5)")
    try:
        return rand_augment_transform(policy, hparams)
    except (AssertionError, ValueError, KeyError, IndexError) as err:
        raise ValueError(f"aug.randaugment: timm cannot read the policy {policy!r} ({err})") from None


class RecipeAugmentDataset(Dataset):
    """Each item of ``base`` through RandAugment (``policy``, or none) and random erasing
    (probability ``reprob``, ``remode`` fill, up to ``recount`` boxes)."""

    def __init__(
        self, base: Dataset, *, policy: str | None, reprob: float, remode: str = "pixel", recount: int = 1
    ) -> None:
        info: DatasetInfo = base.info  # type: ignore[attr-defined]
        if info.inputs != 1:
            raise ValueError("aug.randaugment / aug.reprob augment single images, not pairs of inputs")
        if not 0.0 <= reprob <= 1.0:
            raise ValueError(f"aug.reprob must be in [0, 1], got {reprob}")
        if remode not in ERASE_MODES:
            raise ValueError(f"aug.remode must be one of {', '.join(ERASE_MODES)}, got {remode!r}")
        if recount < 1:
            raise ValueError(f"aug.recount must be >= 1, got {recount}")
        self.base = base
        self.info = info
        self.policy = None if policy is None else build_rand_augment(policy, info)
        if self.policy is not None:
            assert info.mean is not None and info.std is not None  # build_rand_augment checked
            self.mean = torch.tensor(info.mean)[:, None, None]
            self.std = torch.tensor(info.std)[:, None, None]
        self.erase = (
            RandomErasing(probability=reprob, mode=remode, max_count=recount, device="cpu")
            if reprob
            else None
        )

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def _rand_augment(self, image: Tensor) -> Tensor:
        pixels = (image * self.std + self.mean).clamp(0, 1).mul(255).round().to(torch.uint8)
        array = pixels.permute(1, 2, 0).numpy()
        assert self.policy is not None  # called only with a policy
        picture = Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)
        out = np.asarray(self.policy(picture), dtype=np.float32) / 255.0
        tensor = torch.from_numpy(out.copy()).reshape(*out.shape[:2], -1).permute(2, 0, 1)
        return (tensor - self.mean) / self.std

    def __getitem__(self, index: int) -> tuple[Tensor, Any]:
        image, label = self.base[index]
        with seeded_by_torch():
            if self.policy is not None:
                image = self._rand_augment(image)
            if self.erase is not None:
                image = self.erase(image.clone())
        return image, label


def with_recipe_augmentation(dataset: Dataset, aug: Any) -> Dataset:
    """``dataset`` wrapped in :class:`RecipeAugmentDataset` when ``aug`` (an ``AugConfig``)
    asks for RandAugment or random erasing; ``dataset`` itself otherwise."""
    if aug.randaugment is None and not aug.reprob:
        return dataset
    return RecipeAugmentDataset(
        dataset, policy=aug.randaugment, reprob=aug.reprob, remode=aug.remode, recount=aug.recount
    )
