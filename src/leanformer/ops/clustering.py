"""K-Means, K-Medoids and their weighted variants for token pooling (Token Pooling, Alg. 1).

Clustering is split, as in ToMe, into a *plan* and its *application*:

- :func:`kmedoids_plan` / :func:`kmeans_plan` run the iterations without gradient and
  return a :class:`ClusterPlan` (the cluster of every token, plus the medoids or centres);
- :func:`cluster_mean` applies a plan as the weighted mean of every cluster, which is
  differentiable, so every input token receives a gradient (the paper returns cluster
  means for K-Medoids too, not the medoids themselves);
- :func:`cluster_sizes` sums token sizes per cluster (the "carry" of appendix E).

Shapes: tokens ``x [B, N, C]``, weights ``w [B, N]`` (positive), ``K`` clusters. Every
step is batched over examples and vectorised over tokens and clusters.

Objective (paper eq. 13): ``sum_i w_i min_j ||x_i - c_j||^2``. Unweighted variants
use ``w = 1``. K-Medoids keeps ``c_j`` among the tokens (medoid constraint).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from leanformer.ops.medoid_distances import MedoidDistances, medoids_first_order
from leanformer.ops.segment_sum import flat_rows, row_table, segment_sum

InitMode = Literal["topk", "random"]


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


def pairwise_sq_dists(x: Tensor, y: Tensor | None = None) -> Tensor:
    """Squared Euclidean distances ``[B, N, M]`` between ``x [B, N, C]`` and ``y [B, M, C]``.

    One batched matrix product (``|x|^2 + |y|^2 - 2 x.y``); clamped at 0 because rounding
    can make the expansion slightly negative for (near-)identical tokens.
    """
    xx = x.pow(2).sum(-1)
    yy = xx if y is None else y.pow(2).sum(-1)
    y = x if y is None else y
    # baddbmm fuses the -2 scale and the |y|^2 term into the one matrix product.
    d = torch.baddbmm(yy[:, None, :], x, y.transpose(1, 2), alpha=-2.0)
    return d.add_(xx[:, :, None]).clamp_min_(0.0)


def init_centers(
    scores: Tensor | None,
    k: int,
    *,
    num_tokens: int,
    batch: int,
    mode: InitMode = "topk",
    generator: torch.Generator | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Indices ``[B, K]`` of the initial centres.

    ``"topk"`` (the paper's default): the K tokens with the highest ``scores [B, N]``
    (significance scores); ties go to the lower index. ``"random"``: K distinct tokens
    uniformly at random from ``generator`` (appendix B's ablation).
    """
    if mode == "topk":
        if scores is None:
            raise ValueError("init='topk' needs scores (significance scores or weights)")
        return scores.topk(k, dim=1, sorted=True).indices
    if mode == "random":
        device = device if device is not None else (scores.device if scores is not None else None)
        noise = torch.rand(batch, num_tokens, generator=generator, device=device)
        return noise.topk(k, dim=1).indices
    raise ValueError(f"unknown init mode {mode!r}; expected 'topk' or 'random'")


def _check(x: Tensor, k: int, weights: Tensor | None) -> None:
    if x.dim() != 3:
        raise ValueError(f"tokens must be [B, N, C], got shape {tuple(x.shape)}")
    if not 0 < k <= x.shape[1]:
        raise ValueError(f"number of clusters must be in [1, N={x.shape[1]}], got {k}")
    if weights is not None and weights.shape != x.shape[:2]:
        raise ValueError(f"weights must be [B, N] = {tuple(x.shape[:2])}, got {tuple(weights.shape)}")


def _default_init(
    init: Tensor | None, weights: Tensor | None, k: int, num_tokens: int, batch: int, device: torch.device
) -> Tensor:
    """Given ``init [B, K]`` or, by default, the top-K by weight (the first K when unweighted).

    A given ``init`` must hold K distinct token indices per example. That is checked on
    CPU only: elsewhere reading the verdict back would be a device sync on every call.
    """
    if init is not None:
        if init.shape != (batch, k):
            raise ValueError(f"init must be [B, K] = {(batch, k)}, got {tuple(init.shape)}")
        if init.device.type == "cpu" and k > 0:
            low, high = torch.aminmax(init)
            if int(low) < 0 or int(high) >= num_tokens:
                raise ValueError(f"init must hold token indices in [0, N={num_tokens})")
            # K distinct indices mark K tokens; a repeated one marks fewer.
            marked = torch.zeros(batch, num_tokens, dtype=torch.uint8).scatter_(1, init, 1)
            if int(marked.sum()) != batch * k:
                raise ValueError("init must hold K distinct token indices per example")
        return init
    if weights is not None:
        return weights.topk(k, dim=1).indices
    return torch.arange(k, device=device).expand(batch, k)


def _first_argmin(values: Tensor, assign: Tensor, k: int, index: Tensor) -> Tensor:
    """Per cluster, the member with the smallest ``values``; ties go to the lowest ``index``.

    ``values, assign, index [B, N]`` -> ``[B, K]`` values of ``index`` (every token's
    own index, which need not be its position). Two segment-min reductions instead of a
    ``[B, K, N]`` masked matrix. Every cluster must be non-empty.
    """
    B, N = values.shape
    inf = torch.full((B, k), float("inf"), dtype=values.dtype, device=values.device)
    best = inf.scatter_reduce(1, assign, values, reduce="amin", include_self=True)
    candidate = torch.where(values == best.gather(1, assign), index, N)
    init = torch.full((B, k), N, dtype=index.dtype, device=values.device)
    return init.scatter_reduce(1, assign, candidate, reduce="amin", include_self=True)


def _nearest_medoid(rows: Tensor) -> Tensor:
    """``rows [B, K, M]`` (distances from K medoids to M tokens) -> ``[B, M]`` in ``[0, K)``.

    The nearest medoid of every token, the first in medoid order on ties. Reduces over
    the medoid axis, which is not the innermost one, so the minimum is vectorised across
    tokens. ``argmin`` over that axis measured 2x slower than this ``amin`` + "first
    index reaching it" pass, and 1.5x slower over a column gather.
    """
    k = rows.shape[1]
    best = rows.amin(dim=1, keepdim=True)
    # 0 where a medoid reaches the minimum, 1 elsewhere; times k plus the medoid's position
    # makes the smallest key the first minimal medoid. float32 at least: integers stay exact.
    key_dtype = torch.promote_types(rows.dtype, torch.float32)
    order = torch.arange(k, dtype=key_dtype, device=rows.device)[None, :, None]
    key = (rows - best).sign_().to(key_dtype).mul_(k).add_(order)
    return key.amin(dim=1).long()


def _assign_to_medoids(dists: Tensor, medoids: Tensor, examples: Tensor | None = None) -> Tensor:
    """``dists [B, N, N]`` (exactly symmetric), ``medoids [E, K]`` of ``examples [E]``
    (all B when None) -> ``assign [E, N]``.

    Nearest medoid (first in medoid order on ties). A medoid always belongs to its own
    cluster, even when another medoid is an exact duplicate of it: clusters then stay
    non-empty and every medoid is a member of its cluster. Reads the medoids' *rows*
    (contiguous copies; equal to their columns by symmetry).
    """
    B, N, _ = dists.shape
    E, k = medoids.shape
    rows = dists.view(B * N, N).index_select(0, flat_rows(medoids, N, examples)).view(E, k, N)
    assign = _nearest_medoid(rows)
    return assign.scatter(1, medoids, torch.arange(k, device=medoids.device).expand(E, k))


def _some(t: Tensor, examples: Tensor) -> Tensor:
    """The rows ``examples`` of ``t`` (``t`` itself when that is all of them)."""
    return t if examples.numel() == t.shape[0] else t.index_select(0, examples)


def _iterate(
    dists: MedoidDistances,
    assign: Tensor,
    medoids: Tensor,
    w: Tensor,
    order: Tensor,
    position: Tensor,
    *,
    max_iters: int,
    check_convergence: bool,
) -> None:
    """K-Medoids iterations in medoids-first positions; updates ``assign [B, N]`` and
    ``medoids [B, K]`` in place.

    Examples are independent. With ``check_convergence`` (CPU), an example whose medoids
    or clusters no longer change is at its fixed point and drops out: the later
    iterations run on the others only.
    """
    B, k = medoids.shape
    active = torch.arange(B, device=assign.device)
    for _ in range(max_iters):
        a, m = _some(assign, active), _some(medoids, active)
        # The weighted sum of the rows of a cluster's members is every token's weighted
        # distance to that cluster: within[e, j, i] = sum_{i' in j} w_i' d(i', i), the
        # eq. 17 cost of i as the medoid of j. Entries of other clusters are not read
        # (they may be +inf: see MedoidDistances).
        everyone = active.numel() == B
        within = segment_sum(dists.matrix, a, k, _some(w, active), examples=None if everyone else active)
        cost = within.gather(1, a[:, None, :]).squeeze(1)  # [E, N], for the token's own cluster
        # Ties go to the lowest token index (not position).
        new_m = _some(position, active).gather(1, _first_argmin(cost, a, k, index=_some(order, active)))
        if check_convergence:
            moved = (new_m != m).any(dim=1).nonzero().squeeze(1)
            if moved.numel() == 0:
                return
            if moved.numel() < active.numel():
                active, a, m, new_m = active[moved], a[moved], m[moved], new_m[moved]
            # A demoted medoid gets assigned and may share a cluster with an initial medoid.
            demoted = torch.zeros_like(dists.known)
            demoted[active] = torch.zeros_like(a, dtype=torch.bool).scatter_(1, m, new_m != m)
            dists.reveal(demoted)
        new_a = _assign_to_medoids(dists.matrix, new_m, active)
        # The same clusters as before this update: the next update would return these
        # medoids again, so these examples are at their fixed point (it saves that update).
        unsettled = (new_a != a).any(dim=1)
        medoids.index_copy_(0, active, new_m)
        assign.index_copy_(0, active, new_a)
        if check_convergence:
            active = active[unsettled]
            if active.numel() == 0:
                return


@torch.no_grad()
def kmedoids_plan(
    x: Tensor,
    k: int,
    *,
    weights: Tensor | None = None,
    init: Tensor | None = None,
    max_iters: int = 5,
    check_convergence: bool = True,
) -> ClusterPlan:
    """(Weighted) K-Medoids on ``x [B, N, C]`` -> :class:`ClusterPlan` with ``K = k``.

    ``init [B, K]``: initial medoid indices (see :func:`init_centers`; by default the
    top-K by ``weights``, or the first K tokens when unweighted). One iteration = medoid
    update (eqs. 12/17) then reassignment (eqs. 10/16), both read from one token-token
    matrix (no per-iteration distances); its entries between two initial medoids are
    computed only once one of them is demoted (:mod:`leanformer.ops.medoid_distances`).
    The weighted objective (eq. 13) is minimised: the new medoid of a cluster is the
    member with the smallest *weighted* sum of squared distances to the members (eq. 17
    prints the unweighted sum, which would not decrease eq. 13). Ties go to the lowest
    token index.

    ``check_convergence``: stop once the medoids (or the clusters) no longer change, and
    compute the medoid-to-medoid distances on demand. The result is the same either way
    (a converged state is a fixed point); both cost device-to-host syncs on
    accelerators, so the layers only do this on CPU. With it, each example stops at its
    own fixed point and the later iterations run on the others only.
    """
    _check(x, k, weights)
    B, N, _ = x.shape
    x = x.detach()
    w = torch.ones(B, N, dtype=x.dtype, device=x.device) if weights is None else weights.detach().to(x.dtype)
    init = _default_init(init, weights, k, N, B, x.device)
    # Work in medoids-first order (see ops/medoid_distances.py): the distances between
    # initial medoids are computed only for those that get demoted.
    order = medoids_first_order(init, N)
    position = torch.empty_like(order).scatter_(1, order, torch.arange(N, device=x.device).expand(B, N))
    table, step = row_table(x)
    xs = table.index_select(0, flat_rows(order, step)).view(x.shape)
    w = w.gather(1, order)
    # Revealing rows on demand reads a count back to the host, as the convergence test does.
    dists = MedoidDistances(xs, k, reveal_all=not check_convergence)
    medoids = torch.arange(k, device=x.device).expand(B, k).contiguous()  # positions in that order
    # The initial medoids own positions 0..K-1; the others go to the nearest of them.
    assign = torch.cat([medoids, _nearest_medoid(dists.matrix[:, :k, k:])], dim=1)
    _iterate(
        dists, assign, medoids, w, order, position, max_iters=max_iters, check_convergence=check_convergence
    )
    return ClusterPlan(
        assign=torch.empty_like(assign).scatter_(1, order, assign),
        medoids=order.gather(1, medoids),
        centers=None,
    )


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


@torch.no_grad()
def kmeans_plan(
    x: Tensor,
    k: int,
    *,
    weights: Tensor | None = None,
    init: Tensor | None = None,
    max_iters: int = 5,
    check_convergence: bool = True,
) -> ClusterPlan:
    """(Weighted) K-Means (eqs. 10-11 / 14-15) on ``x [B, N, C]`` -> :class:`ClusterPlan`.

    ``init [B, K]``: indices of the tokens that seed the centres. One iteration = centre
    update (weighted mean of the members) then reassignment; ``max_iters`` iterations at
    most. A cluster that loses all its members keeps its previous centre (standard
    Lloyd); it is then empty in the plan and :func:`cluster_mean` returns that centre.
    """
    _check(x, k, weights)
    B, N, C = x.shape
    x = x.detach()
    w = torch.ones(B, N, dtype=x.dtype, device=x.device) if weights is None else weights.detach().to(x.dtype)
    init = _default_init(init, weights, k, N, B, x.device)
    table, step = row_table(x)
    centers = table.index_select(0, flat_rows(init, step)).view(B, k, C)
    # Seeds own their cluster (as for K-Medoids), so no cluster starts empty.
    assign = (
        pairwise_sq_dists(x, centers)
        .argmin(2)
        .scatter(1, init, torch.arange(k, device=x.device).expand(B, k))
    )
    for _ in range(max_iters):
        means, w_sum = weighted_segment_mean(x, w, assign, k)
        centers = torch.where(w_sum[..., None] > 0, means, centers)
        new_assign = pairwise_sq_dists(x, centers).argmin(2)
        if check_convergence and torch.equal(new_assign, assign):
            break
        assign = new_assign
    return ClusterPlan(assign=assign, medoids=None, centers=centers)


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
