"""Segment sums in C++ for eager CPU inference (``segment_sum_cpu.cpp``), as the custom op
``torch.ops.leanformer.segment_sum_cpu``.

:func:`leanformer.ops.segment_sum.segment_sum` sorts the rows by segment and sums them
with ``embedding_bag``, which keeps the sums differentiable, in about a dozen tensor
operations. Without autograd the kernel makes the same sums in the same order (every
example's rows in row order) in one call, examples in parallel: the pooled tokens of
every merge and clustering reducer (docs/BENCHMARKS.md). Like ``embedding_bag`` and
``index_add_``, it has no FLOP formula: FLOPs here count products.
"""

from __future__ import annotations

import torch
from torch import Tensor

from leanformer.ops.native import check_one_device, extension, register_kernel

OP = "segment_sum_cpu"

register_kernel(
    OP,
    "_segment_sum_cpu",
    what="segment sums",
    instead="pooled tokens are summed by PyTorch's embedding_bag on the CPU: the same results, slower",
)


@torch.library.custom_op(f"leanformer::{OP}", mutates_args=())
def segment_sum_cpu(values: Tensor, segment: Tensor, num_segments: int, weights: Tensor) -> Tensor:
    """``values [B, N, D]`` summed per id of ``segment [B, N]`` (int64) in ``[0, S)``, each row
    scaled by ``weights [B, N]`` (the values' floating type) -> ``[B, S, D]``; an id outside
    the range raises a ``ValueError``."""
    return extension(OP).segment_sum(values, segment, num_segments, weights)


@segment_sum_cpu.register_fake
def _(values: Tensor, segment: Tensor, num_segments: int, weights: Tensor) -> Tensor:
    check_one_device(OP, values, segment, weights)
    return values.new_empty(values.shape[0], num_segments, values.shape[2])


def segment_sum_on_cpu(values: Tensor, segment: Tensor, num_segments: int, weights: Tensor | None) -> Tensor:
    """:func:`segment_sum_cpu`, the weights ones when None (or converted to the values' type)."""
    w = values.new_ones(segment.shape) if weights is None else weights.to(values.dtype)
    return segment_sum_cpu(values, segment, num_segments, w)
