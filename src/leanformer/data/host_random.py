"""Python's and NumPy's global random streams, driven by torch's generator for one call.

timm's augmentations (RandAugment, random erasing, Mixup/CutMix) draw from ``random`` and
``numpy.random``. A run saves and restores only torch's generator, so a resumed run
would augment differently. Inside :func:`seeded_by_torch` both streams start from a seed
drawn from torch's global generator (one draw), and are put back as they were afterwards:
the augmentation becomes a function of torch's stream (exactly resumable, the same under
DataLoader workers, which seed torch per worker), and the user's own use of ``random`` or
NumPy is not disturbed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def seeded_by_torch() -> Iterator[None]:
    seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
