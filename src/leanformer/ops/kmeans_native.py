"""K-Means iterations in C++ for eager CPU runs (``kmeans_cpu.cpp``), as the custom op
``torch.ops.leanformer.kmeans_iterate_cpu``.

The batched plan in :mod:`leanformer.ops.kmeans` runs a dozen small tensor operations per
iteration, whose fixed cost outweighs the arithmetic on small models. The kernel runs the
same algorithm (seeds as the first centres, assign to the nearest centre, move every
centre with weight to its members' weighted mean, stop at the fixed point) one example at
a time, examples in parallel, the distances to the centres one BLAS product per
assignment. Plans equal the batched code's up to the float rounding of the distances.

A FLOP counter counts the products of the batched plan under a counter: the initial
assignment and one per iteration, all ``max_iters`` of them (a counted cost depends on
the token counts alone, not on where these images converged).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from leanformer.ops.native import check_one_device, extension, register_kernel

OP = "kmeans_iterate_cpu"

register_kernel(
    OP,
    "_kmeans_cpu",
    what="K-Means kernel",
    instead="K-Means runs its batched PyTorch code on the CPU: the same plans, slower",
)


@torch.library.custom_op(f"leanformer::{OP}", mutates_args=())
def iterate_on_cpu(x: Tensor, weights: Tensor, seeds: Tensor, max_iters: int) -> tuple[Tensor, Tensor]:
    """Up to ``max_iters`` centre updates from the tokens ``seeds [B, K]`` (int64, distinct,
    ``K < N``) -> ``(assign [B, N], centres [B, K, C])``.

    ``x [B, N, C]`` CPU tokens (each example's rows contiguous, as in ``x[:, 1:]``, are read
    in place; other layouts are copied) and ``weights [B, N]``, one floating type, float32
    or wider. The kernel centres each example on its mean token, as
    :func:`leanformer.ops.token_distances.centred` does; the centres are in the tokens'
    coordinates.
    """
    return extension(OP).kmeans_iterate(x, weights, seeds, max_iters)


@iterate_on_cpu.register_fake
def _(x: Tensor, weights: Tensor, seeds: Tensor, max_iters: int) -> tuple[Tensor, Tensor]:
    check_one_device(OP, x, weights, seeds)
    B, N, C = x.shape
    return seeds.new_empty(B, N), x.new_empty(B, seeds.shape[1], C)


@register_flop_formula(torch.ops.leanformer.kmeans_iterate_cpu)
def _flops(
    x: Any, weights: Any, seeds: Any, max_iters: int, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    # One [N, C] x [C, K] distance product per assignment, as the batched plan's
    # pairwise_sq_dists: the initial one and one per iteration.
    B, N, C = x
    return (max(max_iters, 0) + 1) * 2 * B * N * seeds[1] * C
