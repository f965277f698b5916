"""DataLoaders for training and evaluation."""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any, cast

from torch.utils.data import DataLoader, Dataset

from leanformer.data.sampler import GlobalBatchSampler


def train_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    """Shuffled, last partial batch dropped, each global batch split across ranks;
    ``collate_fn`` for items the default cannot stack (detection targets)."""
    sampler = GlobalBatchSampler(
        len(cast(Sized, dataset)),
        batch_size=batch_size,
        shuffle=True,
        seed=seed,
        rank=rank,
        world_size=world_size,
    )
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate_fn)


def eval_loader(dataset: Dataset, *, batch_size: int, num_workers: int = 0) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
