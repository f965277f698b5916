"""Segment sums in C++ for eager CPU inference (``segment_sum_cpu.cpp``), when built.

:func:`leanformer.ops.segment_sum.segment_sum` sorts the rows by segment and sums them
with ``embedding_bag``, which keeps the sums differentiable, in about a dozen tensor
operations. Without autograd the kernel makes the same sums in the same order (every
example's rows in row order) in one call, examples in parallel: the pooled tokens of
every merge and clustering reducer (their speeds: docs/BENCHMARKS.md, "Compiled and eager,
small models and batch 1").
"""

from __future__ import annotations

import torch
from torch import Tensor

from leanformer.ops.native import MissingKernelNotice, eager_cpu_inference, load

_kernel = load("_segment_sum_cpu")
_missing = MissingKernelNotice(
    "segment sums (leanformer.ops._segment_sum_cpu), so pooled tokens are summed by "
    "PyTorch's embedding_bag on the CPU: the same results, slower"
)


def kernel_available() -> bool:
    """Whether the package was built with the C++ segment sums."""
    return _kernel is not None


def applies(values: Tensor, segment: Tensor, weights: Tensor | None) -> bool:
    """Whether :func:`segment_sum_on_cpu` may stand in for the ``embedding_bag`` sums:
    eager CPU inference in float32 or float64 (nothing that needs a gradient, no forward
    tangent, no ``torch.func`` transform), int64 segment ids, no dispatch mode (a FLOP
    counter) watching."""
    if not eager_cpu_inference(values, segment, weights):
        return False
    if values.dtype not in (torch.float32, torch.float64) or segment.dtype != torch.long:
        return False
    if _kernel is None:
        _missing.warn_once(stacklevel=3)  # past applies and segment_sum
        return False
    return True


def segment_sum_on_cpu(values: Tensor, segment: Tensor, num_segments: int, weights: Tensor | None) -> Tensor:
    """``values [B, N, D]`` summed per id of ``segment [B, N]`` in ``[0, S)``, each row
    scaled by ``weights [B, N]`` (ones when None) -> ``[B, S, D]``; an id outside the range
    raises a ``ValueError``. Needs :func:`applies`."""
    if _kernel is None:
        raise RuntimeError("leanformer was installed without its C++ segment sums")
    w = values.new_ones(segment.shape) if weights is None else weights.to(values.dtype)
    return _kernel.segment_sum(values, segment, num_segments, w)
