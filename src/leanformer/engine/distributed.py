"""Process-group set-up for ``torchrun``: gloo on CPU, nccl on CUDA; rank-0-only writing."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def launch_rank() -> tuple[int, int]:
    """``(rank, world_size)`` as ``torchrun`` sets them; ``(0, 1)`` outside a launch (a stray
    ``RANK`` without ``WORLD_SIZE`` > 1 is ignored)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return 0, 1
    return int(os.environ["RANK"]), world_size


def setup_distributed(device: str) -> DistInfo:
    """Join the process group if launched by ``torchrun`` (``WORLD_SIZE`` > 1)."""
    rank, world_size = launch_rank()
    if world_size <= 1:
        return DistInfo(device=torch.device(device))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    target = torch.device(device)
    if target.type == "cuda":
        target = torch.device("cuda", local_rank)
        torch.cuda.set_device(target)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if target.type == "cuda" else "gloo")
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=target)


def barrier(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.barrier()


def cleanup_distributed(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
