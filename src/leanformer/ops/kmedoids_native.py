"""K-Medoids iterations in C++ for eager CPU runs (``kmedoids_cpu.cpp``), as the custom op
``torch.ops.leanformer.kmedoids_iterate_cpu``.

The batched plan in :mod:`leanformer.ops.kmedoids` runs about a hundred small tensor
operations per iteration. At token pooling's sizes (tens to hundreds of tokens per
example) their fixed cost outweighs the arithmetic, which the kernel avoids
(docs/BENCHMARKS.md). The kernel runs the same algorithm (assign to the nearest medoid,
move every medoid to the member nearest its cluster's weighted mean, stop at the fixed
point) one example at a time, examples in parallel: it makes the medoid table
(:mod:`leanformer.ops.medoid_distances`) with one BLAS product and keeps it current where
medoids move. Plans equal the batched code's up to the float rounding of the distances.

The op also returns how many distances each example computed (the initial table, then
those of moved medoids), which its FLOP formula counts, ``C`` multiply-adds each.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from leanformer.ops.native import check_one_device, extension, register_kernel

OP = "kmedoids_iterate_cpu"

register_kernel(
    OP,
    "_kmedoids_cpu",
    what="K-Medoids kernel",
    instead="K-Medoids runs its batched PyTorch code on the CPU: the same plans, slower",
)


@torch.library.custom_op(f"leanformer::{OP}", mutates_args=())
def kmedoids_iterate_cpu(
    x: Tensor, weights: Tensor, medoids: Tensor, max_iters: int, pool: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Up to ``max_iters`` medoid updates from ``medoids [B, K]`` (int64, distinct, ``K < N``)
    -> ``(assign [B, N], medoids [B, K], distances [B], pooled)``.

    ``x [B, N, C]`` CPU tokens (each example's rows contiguous, as in ``x[:, 1:]``, are read
    in place; other layouts are copied) and ``weights [B, N]``, one floating type, float32
    or wider. The kernel centres each example on its mean token (as
    :func:`leanformer.ops.token_distances.centred` does). ``distances``: how many each
    example computed. With ``pool``, ``pooled [B, K, C]`` is every cluster's mean of ``x``
    weighted by ``weights``, bit for bit what :func:`leanformer.ops.cluster_plan.cluster_mean`
    makes of the plan (without a gradient); without, it is empty ``[0, K, C]``.
    """
    return extension(OP).kmedoids_iterate(x, weights, medoids, max_iters, pool)


@kmedoids_iterate_cpu.register_fake
def _(
    x: Tensor, weights: Tensor, medoids: Tensor, max_iters: int, pool: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_one_device(OP, x, weights, medoids)
    B, N, C = x.shape
    K = medoids.shape[1]
    pooled = x.new_empty(B if pool else 0, K, C)
    return medoids.new_empty(B, N), medoids.new_empty(B, K), medoids.new_empty(B), pooled


@register_flop_formula(torch.ops.leanformer.kmedoids_iterate_cpu, get_raw=True)
def _flops(x: Tensor, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    # The distances computed depend on which medoids moved: read from the op's output
    # (get_raw), C multiply-adds each, as the batched plan's products make them.
    return 2 * int(out_val[2].sum()) * x.shape[-1]


def iterate_on_cpu(x: Tensor, weights: Tensor, medoids: Tensor, max_iters: int) -> tuple[Tensor, Tensor]:
    """:func:`kmedoids_iterate_cpu` -> ``(assign [B, N], medoids [B, K])``."""
    assign, medoids, _, _ = kmedoids_iterate_cpu(x, weights, medoids, max_iters, False)
    return assign, medoids


def iterate_and_pool_on_cpu(
    x: Tensor, weights: Tensor, medoids: Tensor, max_iters: int
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`kmedoids_iterate_cpu` -> ``(assign [B, N], medoids [B, K], pooled [B, K, C])``:
    the pooled tokens summed while each example's tokens are still in the core's cache."""
    assign, medoids, _, pooled = kmedoids_iterate_cpu(x, weights, medoids, max_iters, True)
    return assign, medoids, pooled
