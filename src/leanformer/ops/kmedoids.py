"""(Weighted) K-Medoids for token pooling (Token Pooling, Alg. 1, eqs. 12/16-17).

:func:`kmedoids_plan` picks one of three regimes (:mod:`leanformer.ops.cluster_regimes`):
:func:`kmedoids_opaque_compiled`, :func:`kmedoids_eager_cpu_kernel` and
:func:`kmedoids_batched_plan`; :func:`kmedoids_pooled` also pools the clusters, in the
C++ kernel's pass where it runs (:func:`kmedoids_pooled_eager_cpu_kernel`). Every way
gives the plan of the sums, up to float rounding of the distances. K-Medoids keeps its
centres among the tokens (medoid constraint).
"""

from __future__ import annotations

import torch
from torch import Tensor

from leanformer.ops import cluster_regimes, kmedoids_native
from leanformer.ops.cluster_init import starting_tokens
from leanformer.ops.cluster_plan import ClusterPlan, check_clustering_args, cluster_mean, identity_plan
from leanformer.ops.cluster_regimes import (
    detached,
    finite_examples,
    fresh,
    kernel_tokens,
    poison,
    register_plan_op,
    repeat_while_changing,
    weights_or_ones,
)
from leanformer.ops.medoid_distances import MedoidDistances, medoid_distances, nearest_medoids
from leanformer.ops.native import KERNEL_FLOAT_TYPES, use_kernel
from leanformer.ops.segment_sum import flat_rows, segment_sum
from leanformer.ops.token_distances import centred, token_sq_dists

# Marks "no token" in a per-cluster minimum over token indices: above every index.
_NO_TOKEN = torch.iinfo(torch.int64).max


@torch.no_grad()
def kmedoids_plan(
    x: Tensor,
    k: int,
    *,
    weights: Tensor | None = None,
    init: Tensor | None = None,
    max_iters: int = 5,
) -> ClusterPlan:
    """(Weighted) K-Medoids on ``x [B, N, C]`` -> :class:`ClusterPlan` with ``K = min(k, N)``.

    Algorithm 1 of the paper, batched: assignment to the initial medoids, then
    ``max_iters`` times a medoid update and a reassignment. ``init [B, K]``: initial
    medoid indices (see :func:`leanformer.ops.cluster_init.init_centers`; by default the
    top-K by ``weights``, or the first K tokens when unweighted). Ties go to the lowest
    token index (medoid update) and to the first medoid in medoid order (assignment).

    The medoid update minimises the *weighted* sum of distances to the members: eq. 17
    prints the unweighted one, which would not decrease the weighted objective (eq. 13).
    """
    check_clustering_args(x, k, weights)
    B, N, _ = x.shape
    if k >= N:
        return identity_plan(x, medoids=True)
    if cluster_regimes.opaque_when_compiled(x):
        return kmedoids_opaque_compiled(x, k, weights, init, max_iters)
    medoids = starting_tokens(init, weights, k, N, B, x.device)
    tokens, w = kernel_tokens(x, weights)
    if use_kernel(kmedoids_native.OP, tokens, w, medoids):
        return kmedoids_eager_cpu_kernel(tokens, w, medoids, max_iters)
    return kmedoids_batched_plan(x, weights, medoids, max_iters)


def kmedoids_opaque_compiled(
    x: Tensor, k: int, weights: Tensor | None, init: Tensor | None, max_iters: int
) -> ClusterPlan:
    """Traced for the CPU with many tokens: the eager plan as one opaque call."""
    assign, medoids = torch.ops.leanformer.kmedoids_plan(x.detach(), k, detached(weights), init, max_iters)
    return ClusterPlan(assign=assign, medoids=medoids, centers=None)


def kmedoids_eager_cpu_kernel(tokens: Tensor, w: Tensor, medoids: Tensor, max_iters: int) -> ClusterPlan:
    """Eager on the CPU: the iterations in C++, one example at a time, from the cluster
    means, the medoid table recomputed only where medoids moved, stopped at the fixed
    point (``tokens, w``: :func:`leanformer.ops.cluster_regimes.kernel_tokens`)."""
    tokens, w, _ = finite_examples(tokens, w)  # a bad example's NaN reaches cluster_mean
    assign, medoids = kmedoids_native.iterate_on_cpu(tokens, w, medoids, max_iters)
    return ClusterPlan(assign=assign, medoids=medoids, centers=None)


def kmedoids_batched_plan(x: Tensor, weights: Tensor | None, medoids: Tensor, max_iters: int) -> ClusterPlan:
    """Every example at once in tensor operations (accelerators, traced graphs, and the CPU
    without the kernel), from ``medoids [B, K]``.

    The medoid update takes one of two exact forms (:func:`_update_from_means`): from the
    cluster means, O(N C) per update, or from all N x N distances, O(N^2). The assignment
    needs only the distances between the medoids and the other tokens
    (:mod:`leanformer.ops.medoid_distances`): picked from the N x N distances, or computed.
    """
    _, N, C = x.shape
    k = medoids.shape[1]
    xc = centred(x.detach())
    w = weights_or_ones(x, weights, xc.dtype)
    every_pair = None if _update_from_means(N, C, k) else token_sq_dists(xc)
    sq_norms = xc.new_empty(0)  # |x|^2, needed by the update from means and its table
    if every_pair is None:
        sq_norms = _sq_norms(xc)

    def iteration(medoids: Tensor, assign: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if every_pair is None:
            new_medoids = _medoids_from_means(xc, sq_norms, w, assign, k)
        else:
            new_medoids = _medoids_from_pairs(every_pair, assign, w, k)
        table = _medoid_table(xc, sq_norms, new_medoids, every_pair)
        changed = (new_medoids != medoids).any()
        return new_medoids, nearest_medoids(table, new_medoids, N), changed

    assign = nearest_medoids(_medoid_table(xc, sq_norms, medoids, every_pair), medoids, N)
    medoids, assign = repeat_while_changing(iteration, (medoids, assign), max_iters)
    return ClusterPlan(assign=assign, medoids=medoids, centers=None)


def kmedoids_pooled(
    x: Tensor,
    k: int,
    *,
    weights: Tensor | None = None,
    init: Tensor | None = None,
    max_iters: int = 5,
) -> tuple[ClusterPlan, Tensor]:
    """:func:`kmedoids_plan` and the pooled tokens ``cluster_mean(x, plan, weights)``
    ``[B, K, C]``, the same values either way.

    Where nothing needs a gradient and the tokens are float32 or float64, the C++ kernel
    makes both in one pass over each example, eager on the CPU, and one opaque call does
    so compiled for the CPU (for as many tokens as
    :func:`leanformer.ops.cluster_regimes.opaque_when_compiled` sends to the eager plan).
    Otherwise the plan is applied by :func:`cluster_mean`, which is differentiable.
    """
    check_clustering_args(x, k, weights)
    B, N, _ = x.shape
    w_grad = weights is not None and weights.requires_grad
    needs_graph = torch.is_grad_enabled() and (x.requires_grad or w_grad)
    if k < N and not needs_graph and x.dtype in KERNEL_FLOAT_TYPES:
        if cluster_regimes.opaque_when_compiled(x):
            assign, medoids, pooled = torch.ops.leanformer.kmedoids_pooled(x, k, weights, init, max_iters)
            return ClusterPlan(assign=assign, medoids=medoids, centers=None), pooled
        if cluster_regimes.reads_back(x):  # else no kernel: nothing to prepare for it
            medoids = starting_tokens(init, weights, k, N, B, x.device)
            tokens, w = kernel_tokens(x, weights)
            if use_kernel(kmedoids_native.OP, tokens, w, medoids):
                return kmedoids_pooled_eager_cpu_kernel(tokens, w, medoids, max_iters)
    plan = kmedoids_plan(x, k, weights=weights, init=init, max_iters=max_iters)
    return plan, cluster_mean(x, plan, weights)


def kmedoids_pooled_eager_cpu_kernel(
    tokens: Tensor, w: Tensor, medoids: Tensor, max_iters: int
) -> tuple[ClusterPlan, Tensor]:
    """:func:`kmedoids_eager_cpu_kernel` that also pools each example's clusters while its
    tokens are still in the core's cache."""
    tokens, w, bad = finite_examples(tokens, w)
    assign, medoids, pooled = kmedoids_native.iterate_and_pool_on_cpu(tokens, w, medoids, max_iters)
    return ClusterPlan(assign=assign, medoids=medoids, centers=None), poison(pooled, bad)


def _first_argmin(values: Tensor, assign: Tensor, k: int) -> Tensor:
    """Per cluster, the member token with the smallest ``values``; ties go to the lowest index.

    ``values, assign [B, N]`` -> token indices ``[B, K]``. Two segment-min reductions
    instead of a ``[B, K, N]`` masked matrix. A cluster with no member gets ``_NO_TOKEN``.
    """
    B, N = values.shape
    inf = torch.full((B, k), float("inf"), dtype=values.dtype, device=values.device)
    best = inf.scatter_reduce(1, assign, values, reduce="amin", include_self=True)
    index = torch.arange(N, device=values.device).expand(B, N)
    candidate = torch.where(values == best.gather(1, assign), index, _NO_TOKEN)
    init = torch.full((B, k), _NO_TOKEN, dtype=index.dtype, device=values.device)
    return init.scatter_reduce(1, assign, candidate, reduce="amin", include_self=True)


def _update_from_means(num_tokens: int, channels: int, k: int) -> bool:
    """Whether K-Medoids updates its medoids from the cluster means rather than from all
    N x N distances (both exact): with more tokens than channels, where a pass over the
    N x N distances reads more than one over the tokens; or when at most a quarter of the
    tokens go, where the N x N product would cost over five times the ``K x (N - K)`` one
    that the means need instead. Elsewhere (N <= C, half the tokens kept) the means form
    measured up to 1.4x slower on CPU where many medoids move."""
    return num_tokens > channels or 4 * (num_tokens - k) <= num_tokens


def _medoid_table(
    xc: Tensor, sq_norms: Tensor, medoids: Tensor, every_pair: Tensor | None
) -> MedoidDistances:
    """Distances between ``medoids [B, K]`` and the other tokens: computed (one ``K x (N - K)``
    product), or the medoids' rows of ``every_pair [B, N, N]``, all N columns kept (the
    medoids' own columns do no harm: the assignment puts a medoid in its own cluster)."""
    if every_pair is None:
        return medoid_distances(xc, sq_norms, medoids)
    B, N, _ = every_pair.shape
    # Whole rows by index_select (a gather with an index expanded over N is ~10x slower).
    rows = every_pair.view(B * N, N).index_select(0, flat_rows(medoids, N)).view(B, -1, N)
    return MedoidDistances(torch.arange(N, device=rows.device).expand(B, N), rows)


def _sq_norms(xc: Tensor) -> Tensor:
    """``|x|^2`` of every token of ``xc [B, N, C]`` -> ``[B, N]``, for K-Medoids' table and
    its update from means. One fused reduction: a third of the time of
    ``(xc * xc).sum(-1)`` on CPU."""
    return torch.linalg.vector_norm(xc, dim=-1).square()


def _medoids_from_means(xc: Tensor, sq_norms: Tensor, w: Tensor, assign: Tensor, k: int) -> Tensor:
    """The new medoid of every cluster (eqs. 12/17) from the cluster means -> ``[B, K]``.

    A cluster's medoid is the member ``i`` with the least ``sum_{i' in cluster} w_i'
    |x_i' - x_i|^2``. That sum is ``W |x_i - m|^2`` plus a constant of the cluster (``m``
    its weighted mean, ``W`` its total weight), so the medoid is the member nearest the
    weighted mean, found in O(N C); members are ranked by ``|x_i|^2 - 2 x_i.m``.

    Exact ties go to the lowest index, as with the sums themselves: identical members
    score alike; the two members of a two-token cluster of equal weights cost each other's
    distance, a tie the rounding of the mean would break at random, so both score 0; so
    does every member of a cluster of total weight 0.
    """
    B, _, C = xc.shape
    total = w.new_zeros(B, k).scatter_add_(1, assign, w)
    members = torch.zeros_like(total).scatter_add_(1, assign, torch.ones_like(w))
    own_total = total.gather(1, assign)
    # Weights normalised per cluster first: the means are then one segment sum.
    means = segment_sum(xc, assign, k, w / own_total.clamp_min(torch.finfo(w.dtype).tiny))
    own_mean = means.view(B * k, C).index_select(0, flat_rows(assign, k)).view(xc.shape)
    score = sq_norms - 2.0 * own_mean.mul_(xc).sum(-1)
    own_members = members.gather(1, assign)
    tied = ((own_members == 2) & (own_total - w == w)) | (own_total == 0)
    return _first_argmin(torch.where(tied, 0.0, score), assign, k)


def _medoids_from_pairs(every_pair: Tensor, assign: Tensor, w: Tensor, k: int) -> Tensor:
    """The new medoid of every cluster (eqs. 12/17) from all pair distances -> ``[B, K]``.

    ``within[b, j, i] = sum_{i' in cluster j} w_i' d(i', i)`` is the cost of token ``i``
    as the medoid of cluster ``j`` (O(N^2) per update); each cluster takes the member
    with the least cost of its own cluster, the lowest index on ties (the two members of
    a two-token cluster of equal weights tie exactly: ``every_pair`` is symmetric).
    """
    within = segment_sum(every_pair, assign, k, w)  # [B, K, N]
    own_cost = within.gather(1, assign[:, None, :]).squeeze(1)  # [B, N]
    return _first_argmin(own_cost, assign, k)


register_plan_op("kmedoids_plan", kmedoids_plan, medoids=True)


@torch.library.custom_op("leanformer::kmedoids_pooled", mutates_args=())
def _kmedoids_pooled_op(
    x: Tensor, k: int, weights: Tensor | None, init: Tensor | None, max_iters: int
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`kmedoids_pooled` as one opaque call, run eagerly (without a gradient)."""
    plan, pooled = kmedoids_pooled(x, k, weights=weights, init=init, max_iters=max_iters)
    assert plan.medoids is not None
    # The pooled tokens are a new contiguous tensor whichever way they were made (a copy
    # would cost a pass over them).
    return fresh(plan.assign), fresh(plan.medoids), pooled


@_kmedoids_pooled_op.register_fake
def _(
    x: Tensor, k: int, weights: Tensor | None, init: Tensor | None, max_iters: int
) -> tuple[Tensor, Tensor, Tensor]:
    B, N, C = x.shape
    k = min(k, N)
    return x.new_empty(B, N, dtype=torch.int64), x.new_empty(B, k, dtype=torch.int64), x.new_empty(B, k, C)
