"""K-Medoids iterations in C++ for eager CPU runs (``kmedoids_cpu.cpp``), when built.

The batched plan in :mod:`leanformer.ops.clustering` runs about a hundred small tensor
operations per iteration. At token pooling's sizes (tens to hundreds of tokens per
example) their fixed cost outweighs the arithmetic, which the kernel avoids: several
times faster on a plan for 64 x 64 tokens of width 96 (docs/BENCHMARKS.md, "Compiled and
eager, small models and batch 1"). The kernel runs the same algorithm (assign to
the nearest medoid, move every medoid to the member nearest its cluster's weighted mean,
stop at the fixed point) one example at a time, examples in parallel: it makes the
medoid table (:mod:`leanformer.ops.medoid_distances`) with one BLAS product and keeps
it current where medoids move.
Plans equal the batched code's up to the float rounding of the distances.

The kernel is built when the package is installed (``setup.py``); without a C++
compiler the package installs without it, and :func:`kernel_available` says so.
"""

from __future__ import annotations

import torch
from torch import Tensor

from leanformer.ops.native import MissingKernelNotice, MissingKernelWarning, counting, load

__all__ = [
    "MissingKernelWarning",
    "iterate_and_pool_on_cpu",
    "iterate_on_cpu",
    "kernel_available",
    "warn_once_without_kernel",
]

_kernel = load("_kmedoids_cpu")


@torch.library.custom_op("leanformer::medoid_distance_work", mutates_args=())
def distance_work(xc: Tensor, distances: int) -> None:
    """Does nothing: a FLOP counter (:mod:`leanformer.ops.flop_count`) counts ``distances``
    squared distances between tokens of ``xc [B, N, C]``, ``C`` multiply-adds each, which
    the kernel computed where the counter cannot see them."""


_missing = MissingKernelNotice(
    "K-Medoids kernel (leanformer.ops._kmedoids_cpu), so K-Medoids runs its batched PyTorch "
    "code on the CPU: the same plans, slower",
)


def kernel_available() -> bool:
    """Whether the package was built with the C++ K-Medoids iterations."""
    return _kernel is not None


def warn_once_without_kernel() -> None:
    """Say once per process that eager CPU K-Medoids runs the slower batched code."""
    if _kernel is None:
        _missing.warn_once(stacklevel=4)  # past this function, kmedoids_plan and its no_grad wrapper


def iterate_on_cpu(x: Tensor, weights: Tensor, medoids: Tensor, max_iters: int) -> tuple[Tensor, Tensor]:
    """Up to ``max_iters`` medoid updates from ``medoids [B, K]`` -> ``(assign [B, N], medoids [B, K])``.

    ``x [B, N, C]`` CPU tokens (each example's rows contiguous, as in ``x[:, 1:]``; other
    layouts are copied) and ``weights [B, N]``, one floating type, float32 or wider. The
    kernel centres each example on its mean token (as
    :func:`leanformer.ops.token_distances.centred` does) and makes the initial medoids'
    table (:mod:`leanformer.ops.medoid_distances` says what it holds) with one BLAS
    product. Needs :func:`kernel_available`.
    """
    assign, medoids, _ = _iterate(x, weights, medoids, max_iters, pool=False)
    return assign, medoids


def iterate_and_pool_on_cpu(
    x: Tensor, weights: Tensor, medoids: Tensor, max_iters: int
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`iterate_on_cpu`, and the pooled tokens ``[B, K, C]``: every cluster's mean
    of ``x`` weighted by ``weights``, bit for bit what
    :func:`leanformer.ops.clustering.cluster_mean` makes of the plan (without a
    gradient), summed while each example's tokens are still in the core's cache."""
    return _iterate(x, weights, medoids, max_iters, pool=True)


def _iterate(
    x: Tensor, weights: Tensor, medoids: Tensor, max_iters: int, *, pool: bool
) -> tuple[Tensor, Tensor, Tensor]:
    if _kernel is None:
        raise RuntimeError("leanformer was installed without its C++ K-Medoids kernel")
    assign, medoids, work, pooled = _kernel.kmedoids_iterate(x, weights, medoids, max_iters, pool)
    if counting():
        # The distances computed (the initial table, then those of moved medoids), which
        # the batched plan computes with matrix products that a FLOP counter sees.
        distance_work(x, int(work.sum()))
    return assign, medoids, pooled
