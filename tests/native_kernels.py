"""Helpers for the tests of the C++ kernels: clustered tokens, and running without a kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TypeVar

import pytest
import torch

from leanformer.ops import cluster_regimes, kmeans_native, kmedoids_native
from leanformer.ops.cluster_init import init_centers
from leanformer.ops.native import KERNELS

T = TypeVar("T")

# (batch, tokens, channels, clusters) for the kernels' parity tests: the digits model's
# layers, DeiT-S's width at 197 tokens, a block removing 3 tokens, long sequences, K = 1,
# and a width that is no multiple of a vector (the kernels' dot products end in a tail).
PLAN_SHAPES = [
    (16, 65, 96, 56),
    (16, 64, 96, 32),
    (16, 64, 96, 8),
    (4, 197, 48, 98),
    (3, 120, 8, 117),
    (2, 300, 16, 150),
    (5, 9, 4, 1),
    (3, 40, 37, 12),
]

# Every combination of float type and start, for the parity tests.
plan_variants = pytest.mark.parametrize(
    ("dtype", "start"), [(d, s) for d in (torch.float32, torch.float64) for s in ("topk", "random")]
)


def clustered(b: int, n: int, c: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, n, c]`` tokens around ``n // 6`` centres (so clusterings have moves to make),
    and weights in [0.1, 1.1]."""
    g = torch.Generator().manual_seed(seed)
    centres = 4 * torch.randn(b, max(2, n // 6), c, generator=g)
    members = torch.randint(0, centres.shape[1], (n,), generator=g)
    x = centres[:, members] + torch.randn(b, n, c, generator=g)
    return x.to(dtype), (torch.rand(b, n, generator=g) + 0.1).to(dtype)


@contextmanager
def without_kernel(monkeypatch: pytest.MonkeyPatch, native: ModuleType) -> Iterator[None]:
    """As in a package built without a C++ compiler, minus the one-time warning:
    ``native`` is the module that defines the kernel's custom op (``native.OP``)."""
    with monkeypatch.context() as m:
        m.setattr(KERNELS[native.OP], "extension", None)
        m.setattr(KERNELS[native.OP], "warned", True)
        yield


def like_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the clusterings as where reading a value back is not free: the batched code,
    every iteration (no C++ kernel, which only runs eagerly on the CPU)."""
    monkeypatch.setattr(cluster_regimes, "reads_back", lambda t: False)
    for native in (kmeans_native, kmedoids_native):
        monkeypatch.setattr(KERNELS[native.OP], "extension", None)
        monkeypatch.setattr(KERNELS[native.OP], "warned", True)


def on_threads(threads: int, run: Callable[[], T]) -> T:
    """``run()`` with ``threads`` intra-op threads, the thread count restored after."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return run()
    finally:
        torch.set_num_threads(before)


def starting_tokens(start: str, k: int, num_tokens: int, batch: int) -> torch.Tensor | None:
    """The plans' ``init``: None (the top-K by weight) for ``"topk"``, else K random tokens."""
    if start == "topk":
        return None
    gen = torch.Generator().manual_seed(k)
    return init_centers(None, k, num_tokens=num_tokens, batch=batch, mode="random", generator=gen)


def three_starts_at_one_point(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens ``[3, 40, 8]`` where token 1 has 20 copies (tokens 20-39), ones as weights,
    and 10 starting tokens with three copies of that point at positions 2, 6 and 9 (20,
    21, 1). The BLAS product that makes their distances need not round them alike (in
    float64 on an AVX2 CPU it did not): every other copy must go to position 2, and the
    later two positions hold their own token only."""
    x, _ = clustered(3, 40, 8, seed=810, dtype=dtype)
    x[:, 20:] = x[:, 1:2]
    rest = [t for t in range(40) if t not in (1, 20, 21)][:7]
    start = torch.tensor([*rest[:2], 20, *rest[2:5], 21, *rest[5:], 1]).expand(3, 10)
    return x, torch.ones(3, 40, dtype=dtype), start.contiguous()


def assert_ties_go_to_the_first_copy(assign: torch.Tensor) -> None:
    """The check of :func:`three_starts_at_one_point` on the first assignment."""
    assert bool((assign[:, 22:] == 2).all())
    for later in (6, 9):
        assert bool(((assign == later).sum(1) == 1).all())
