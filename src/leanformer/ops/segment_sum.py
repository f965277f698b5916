"""Weighted sums of the rows that share a segment id, batched over examples.

``segment_sum(values [B, N, D], segment [B, N] in [0, S), weights [B, N])`` returns
``[B, S, D]`` with ``out[b, s] = sum_{i: segment[b, i] = s} weights[b, i] * values[b, i]``.
Empty segments are 0.

It runs as one ``embedding_bag`` (mode ``"sum"`` with per-sample weights) over the rows
sorted by segment: a single pass that reads every row once and multiplies by its weight
on the way. On CPU this measured 3.5-6x faster than ``index_add_`` of pre-multiplied rows
(which torch lowers to a ``scatter_add_`` with an index materialised over all D columns,
plus a separate multiply). Differentiable in ``values`` and ``weights`` (first order:
torch has no double backward for ``embedding_bag``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def flat_rows(index: Tensor, k: int) -> Tensor:
    """``index [B, N]`` in ``[0, K)`` -> ``[B * N]`` row indices into a ``[B * K, ...]`` buffer.

    ``index_select`` along dim 0 of a 2-D tensor copies whole rows, the fast CPU path;
    ``gather`` with an index expanded over channels is ~10x slower.
    """
    offsets = torch.arange(index.shape[0], device=index.device)[:, None] * k
    return (index + offsets).flatten()


def segment_sum(values: Tensor, segment: Tensor, num_segments: int, weights: Tensor | None = None) -> Tensor:
    """``[B, N, D]`` rows summed per segment of ``segment [B, N]`` -> ``[B, S, D]`` (see module doc).

    ``weights [B, N]`` scale each row (ones when None). Segment ids must lie in
    ``[0, num_segments)``; they are not checked here because the callers build them.
    """
    B, N, D = values.shape
    flat = flat_rows(segment, num_segments)
    # Rows in segment order; a stable sort keeps each segment's rows in token order.
    order = flat.argsort(stable=True)
    # Not bincount: on CUDA it reads the index range back to the host (a sync per call).
    counts = torch.zeros(B * num_segments, dtype=flat.dtype, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    offsets = counts.cumsum(0) - counts
    per_row = None if weights is None else weights.reshape(B * N)[order].to(values.dtype)
    out = F.embedding_bag(order, values.reshape(B * N, D), offsets, mode="sum", per_sample_weights=per_row)
    return out.view(B, num_segments, D)
