"""(Weighted) K-Means for token pooling (Token Pooling, eqs. 10-11 / 14-15).

:func:`kmeans_plan` picks one of three regimes (:mod:`leanformer.ops.cluster_regimes`):
:func:`kmeans_opaque_compiled`, :func:`kmeans_eager_cpu_kernel` and
:func:`kmeans_batched_plan`, which give one plan up to the float rounding of the
distances.
"""

from __future__ import annotations

import torch
from torch import Tensor

from leanformer.ops import cluster_regimes, kmeans_native
from leanformer.ops.cluster_init import starting_tokens
from leanformer.ops.cluster_plan import (
    ClusterPlan,
    check_clustering_args,
    identity_plan,
    weighted_segment_mean,
)
from leanformer.ops.cluster_regimes import (
    detached,
    finite_examples,
    kernel_tokens,
    poison,
    register_plan_op,
    repeat_while_changing,
    weights_or_ones,
)
from leanformer.ops.native import use_kernel
from leanformer.ops.token_distances import centred, pairwise_sq_dists
from leanformer.ops.token_selection import gather_tokens


@torch.no_grad()
def kmeans_plan(
    x: Tensor,
    k: int,
    *,
    weights: Tensor | None = None,
    init: Tensor | None = None,
    max_iters: int = 5,
) -> ClusterPlan:
    """(Weighted) K-Means (eqs. 10-11 / 14-15) on ``x [B, N, C]`` -> :class:`ClusterPlan`.

    ``init [B, K]``: indices of the tokens that seed the centres; each seed starts in its
    own cluster, so none starts empty. Then ``max_iters`` times: centre update (weighted
    mean of the members) and reassignment to the nearest centre. A cluster that loses all
    its members keeps its previous centre (standard Lloyd); it is then empty in the plan
    and :func:`leanformer.ops.cluster_plan.cluster_mean` returns that centre. ``K >= N``
    is the identity plan.
    """
    check_clustering_args(x, k, weights)
    B, N, _ = x.shape
    if k >= N:
        return identity_plan(x, medoids=False)
    if cluster_regimes.opaque_when_compiled(x):
        return kmeans_opaque_compiled(x, k, weights, init, max_iters)
    seeds = starting_tokens(init, weights, k, N, B, x.device)
    tokens, w = kernel_tokens(x, weights)
    if use_kernel(kmeans_native.OP, tokens, w, seeds):
        return kmeans_eager_cpu_kernel(x, tokens, w, seeds, max_iters)
    return kmeans_batched_plan(x, weights, seeds, max_iters)


def kmeans_opaque_compiled(
    x: Tensor, k: int, weights: Tensor | None, init: Tensor | None, max_iters: int
) -> ClusterPlan:
    """Traced for the CPU with many tokens: the eager plan as one opaque call."""
    assign, centers = torch.ops.leanformer.kmeans_plan(x.detach(), k, detached(weights), init, max_iters)
    return ClusterPlan(assign=assign, medoids=None, centers=centers)


def kmeans_eager_cpu_kernel(
    x: Tensor, tokens: Tensor, w: Tensor, seeds: Tensor, max_iters: int
) -> ClusterPlan:
    """Eager on the CPU: the iterations in C++, one example at a time, stopped at the fixed
    point (``tokens, w``: :func:`leanformer.ops.cluster_regimes.kernel_tokens` of ``x``)."""
    tokens, w, bad = finite_examples(tokens, w)
    assign, centers = kmeans_native.iterate_on_cpu(tokens, w, seeds, max_iters)
    return ClusterPlan(assign=assign, medoids=None, centers=poison(centers, bad).to(x.dtype))


def kmeans_batched_plan(x: Tensor, weights: Tensor | None, seeds: Tensor, max_iters: int) -> ClusterPlan:
    """Every example at once in tensor operations (accelerators, traced graphs, and the CPU
    without the kernel), from the tokens ``seeds [B, K]``."""
    B, _, _ = x.shape
    k = seeds.shape[1]
    xc = centred(x.detach())
    w = weights_or_ones(x, weights, xc.dtype)
    centers = gather_tokens(xc, seeds)
    # The tokens' |x|^2, the same for every assignment; computed as pairwise_sq_dists
    # would, so the distances keep their rounding.
    sq_norms = (xc * xc).sum(-1)
    assign = _nearest_center(xc, centers, sq_norms)
    assign = assign.scatter(1, seeds, torch.arange(k, device=x.device).expand(B, k))

    def iteration(centers: Tensor, assign: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        means, w_sum = weighted_segment_mean(xc, w, assign, k)
        kept = w_sum > 0
        # Where reading it back is free, a pass over the centres is saved when none is empty.
        none_empty = cluster_regimes.reads_back(kept) and bool(kept.all())
        centers = means if none_empty else torch.where(kept[..., None], means, centers)
        new_assign = _nearest_center(xc, centers, sq_norms)
        return centers, new_assign, (new_assign != assign).any()

    centers, assign = repeat_while_changing(iteration, (centers, assign), max_iters)
    # Back from centred coordinates to the tokens' own.
    offset = x.detach().to(xc.dtype).mean(dim=1, keepdim=True)
    return ClusterPlan(assign=assign, medoids=None, centers=(centers + offset).to(x.dtype))


def _nearest_center(x: Tensor, centers: Tensor, x_sq_norms: Tensor) -> Tensor:
    """``x [B, N, C]`` (``x_sq_norms [B, N]``: its ``|x|^2``), ``centers [B, K, C]`` -> the
    nearest centre of every token ``[B, N]`` (the first on ties)."""
    # min(...).indices: the same first minimum as argmin, in half the time on CPU.
    return pairwise_sq_dists(x, centers, x_sq_norms=x_sq_norms).min(dim=2).indices


register_plan_op("kmeans_plan", kmeans_plan, medoids=False)
