"""Light training augmentation for small grey images: random shift and horizontal flip."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from leanformer.data.tensor_dataset import TensorImageDataset


class ShiftFlipDataset(Dataset):
    """Each item of ``base``, shifted by up to ``max_shift`` pixels in each direction (the
    uncovered border takes ``fill``, the background value after normalisation) and
    flipped left-right with probability 1/2. Draws from torch's global generator, so a
    seeded run (and a resumed one, which restores that generator) repeats exactly."""

    def __init__(self, base: TensorImageDataset, *, max_shift: int, fill: float) -> None:
        if max_shift < 0:
            raise ValueError(f"max_shift must be >= 0, got {max_shift}")
        self.base = base
        self.info = base.info
        self.max_shift = max_shift
        self.fill = fill

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image, label = self.base[index]
        s = self.max_shift
        draws = torch.randint(0, 2 * s + 1, (2,)).tolist() if s else [0, 0]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        if s:
            h, w = image.shape[-2:]
            padded = F.pad(image, (s, s, s, s), value=self.fill)
            image = padded[..., draws[0] : draws[0] + h, draws[1] : draws[1] + w]
        return image, label
