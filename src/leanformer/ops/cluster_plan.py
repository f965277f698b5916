"""A clustering's *plan* and its *application*, shared by K-Means and K-Medoids.

Clustering is split, as in ToMe, into a plan and its application:

- :func:`leanformer.ops.kmedoids.kmedoids_plan` / :func:`leanformer.ops.kmeans.kmeans_plan`
  run the iterations without gradient and return a :class:`ClusterPlan` (the cluster of
  every token, plus the medoids or centres);
- :func:`cluster_mean` applies a plan as the weighted mean of every cluster, which is
  differentiable, so every input token receives a gradient (the paper returns cluster
  means for K-Medoids too, not the medoids themselves);
- :func:`cluster_sizes` sums token sizes per cluster (the "carry" of appendix E).

Shapes: tokens ``x [B, N, C]``, weights ``w [B, N]`` (positive), ``K`` clusters. Objective
(paper eq. 13): ``sum_i w_i min_j ||x_i - c_j||^2``; unweighted variants use ``w = 1``.
``K >= N`` is the identity plan (token ``i`` alone in cluster ``i``), whatever the data.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from leanformer.ops.segment_sum import segment_sum


class ClusterPlan(NamedTuple):
    """Result of a clustering run (no gradient).

    ``assign [B, N]`` (int64 in ``[0, K)``): the cluster of every token.
    ``medoids [B, K]`` (int64 token indices): K-Medoids centres, None for K-Means.
    ``centers [B, K, C]``: K-Means centres (detached), None for K-Medoids.
    """

    assign: Tensor
    medoids: Tensor | None
    centers: Tensor | None

    @property
    def num_clusters(self) -> int:
        if self.medoids is not None:
            return self.medoids.shape[1]
        assert self.centers is not None
        return self.centers.shape[1]


def check_clustering_args(x: Tensor, k: int, weights: Tensor | None) -> None:
    """Refuse tokens that are not ``[B, N, C]``, ``k < 1`` and weights that are not ``[B, N]``."""
    if x.dim() != 3:
        raise ValueError(f"tokens must be [B, N, C], got shape {tuple(x.shape)}")
    if k < 1:
        raise ValueError(f"number of clusters must be at least 1, got {k}")
    if weights is not None and weights.shape != x.shape[:2]:
        raise ValueError(f"weights must be [B, N] = {tuple(x.shape[:2])}, got {tuple(weights.shape)}")


def identity_plan(x: Tensor, *, medoids: bool) -> ClusterPlan:
    """Every token alone in its own cluster, in token order (what ``K >= N`` asks for)."""
    B, N, _ = x.shape
    own = torch.arange(N, device=x.device).expand(B, N)
    if medoids:
        return ClusterPlan(assign=own, medoids=own, centers=None)
    return ClusterPlan(assign=own, medoids=None, centers=x.detach())


def weighted_segment_mean(x: Tensor, w: Tensor, assign: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Weighted mean of every segment: ``x [B, N, C]``, ``w [B, N]``, ``assign [B, N]`` in ``[0, K)``.

    Returns ``([B, K, C] means, [B, K] total weights)``; an empty segment has mean 0 and
    weight 0. A segment sum (not a one-hot matmul) keeps this O(N C); differentiable in
    ``x`` and ``w``.
    """
    B, _, _ = x.shape
    w_sum = w.new_zeros(B, k).scatter_add_(1, assign, w)
    total = segment_sum(x, assign, k, w)
    return total / w_sum.clamp_min(torch.finfo(w.dtype).tiny)[..., None], w_sum


def cluster_mean(x: Tensor, plan: ClusterPlan, weights: Tensor | None = None) -> Tensor:
    """Apply ``plan``: ``x [B, N, C]`` -> weighted mean of every cluster ``[B, K, C]``.

    Differentiable in ``x`` (and in ``weights``), so every token gets a gradient. A
    cluster whose members all weigh 0 (e.g. tokens of size 0) uses their plain mean; an
    empty cluster (possible in K-Means only) returns its centre, a constant.
    """
    B, N, _ = x.shape
    k = plan.num_clusters
    assign = plan.assign
    w = x.new_ones(B, N) if weights is None else weights.to(x.dtype)
    w_sum = w.new_zeros(B, k).scatter_add_(1, assign, w)
    own_sum = w_sum.gather(1, assign)
    # All-zero clusters (e.g. tokens of size 0) use the plain mean of their members.
    counts = w.new_zeros(B, k).scatter_add_(1, assign, torch.ones_like(w))
    w = torch.where(
        own_sum > 0, w / own_sum.clamp_min(torch.finfo(w.dtype).tiny), 1.0 / counts.gather(1, assign)
    )
    # Normalising the [B, N] weights first turns the segment mean into one segment sum.
    means = segment_sum(x, assign, k, w)
    if plan.centers is None:
        return means  # K-Medoids: every cluster holds at least its medoid
    return torch.where(counts[..., None] > 0, means, plan.centers.to(x.dtype))


def cluster_sizes(sizes: Tensor | None, plan: ClusterPlan, *, batch: int, num_tokens: int) -> Tensor:
    """Token sizes after pooling: ``[B, K]`` sums of the member sizes (ones when None)."""
    assign = plan.assign
    k = plan.num_clusters
    if sizes is None:
        sizes = torch.ones(batch, num_tokens, device=assign.device)
    return sizes.new_zeros(batch, k).scatter_add_(1, assign, sizes)


def clustering_objective(x: Tensor, plan: ClusterPlan, weights: Tensor | None = None) -> Tensor:
    """Eq. 13 per example ``[B]``: ``sum_i w_i ||x_i - c_{a(i)}||^2`` for the plan's centres."""
    B, N, C = x.shape
    if plan.medoids is not None:
        centers = x.gather(1, plan.medoids[..., None].expand(B, plan.num_clusters, C))
    else:
        assert plan.centers is not None
        centers = plan.centers
    own = centers.gather(1, plan.assign[..., None].expand(B, N, C))
    w = x.new_ones(B, N) if weights is None else weights.to(x.dtype)
    return (w * (x - own).pow(2).sum(-1)).sum(-1)
