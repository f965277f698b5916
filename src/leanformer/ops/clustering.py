"""K-Means, K-Medoids and their weighted variants for token pooling (Token Pooling, Alg. 1).

Clustering is split, as in ToMe, into a *plan* and its *application*:

- :func:`kmedoids_plan` / :func:`kmeans_plan` run the iterations without gradient and
  return a :class:`ClusterPlan` (the cluster of every token, plus the medoids or centres);
- :func:`cluster_mean` applies a plan as the weighted mean of every cluster, which is
  differentiable, so every input token receives a gradient (the paper returns cluster
  means for K-Medoids too, not the medoids themselves);
- :func:`cluster_sizes` sums token sizes per cluster (the "carry" of appendix E).

Shapes: tokens ``x [B, N, C]``, weights ``w [B, N]`` (positive), ``K`` clusters. Every
step is batched over examples and vectorised over tokens and clusters, and runs a fixed
number of iterations with no host synchronisation, so the plans compile with
``torch.compile(fullgraph=True)``. A converged example needs no masking: a K-Means or
K-Medoids state that no longer changes is a fixed point of the next iteration too.

Objective (paper eq. 13): ``sum_i w_i min_j ||x_i - c_j||^2``. Unweighted variants
use ``w = 1``. K-Medoids keeps ``c_j`` among the tokens (medoid constraint). ``K >= N``
is the identity plan (token ``i`` alone in cluster ``i``), whatever the data, as in the
layers.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from leanformer.ops.hashed_noise import uniform_noise
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


def pairwise_sq_dists(x: Tensor, y: Tensor | None = None, *, y_sq_norms: Tensor | None = None) -> Tensor:
    """Squared Euclidean distances ``[B, N, M]`` between ``x [B, N, C]`` and ``y [B, M, C]``.

    One batched matrix product (``|x|^2 + |y|^2 - 2 x.y``); clamped at 0 because rounding
    can make the expansion slightly negative for (near-)identical tokens. The expansion
    cancels badly when the tokens sit far from the origin compared with their spread:
    pass tokens centred per example (:func:`centred`), which leaves distances unchanged.
    ``y_sq_norms [B, M]``: ``|y|^2`` when the caller has it already.
    """
    xx = (x * x).sum(-1)
    if y is None:
        y, yy = x, xx
    else:
        yy = (y * y).sum(-1) if y_sq_norms is None else y_sq_norms
    # baddbmm fuses the -2 scale and the |y|^2 term into the one matrix product.
    d = torch.baddbmm(yy[:, None, :], x, y.transpose(1, 2), alpha=-2.0)
    return d.add_(xx[:, :, None]).clamp_min_(0.0)


def centred(x: Tensor) -> Tensor:
    """``x [B, N, C]`` minus each example's mean token, in float32 at least.

    Distances between tokens do not change, but their float32 rounding does: the
    expansion ``|x|^2 + |y|^2 - 2 x.y`` loses the digits of ``|x - y|^2`` that lie below
    the rounding of ``|x|^2``. Half-precision tokens are widened, so ``|x|^2`` cannot
    overflow either.
    """
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x - x.mean(dim=1, keepdim=True)


def token_sq_dists(x: Tensor) -> Tensor:
    """Squared distances ``[B, N, N]`` between the tokens of ``x [B, N, C]`` (centred).

    Exactly symmetric with a zero diagonal: the two members of an unweighted 2-token
    cluster then cost exactly the same as each other's medoid, and the tie goes to the
    lower index as in a per-example reference.
    """
    d = pairwise_sq_dists(x)
    d = torch.minimum(d, d.transpose(1, 2))
    d.diagonal(dim1=1, dim2=2).zero_()
    return d


def init_centers(
    scores: Tensor | None,
    k: int,
    *,
    num_tokens: int,
    batch: int,
    mode: InitMode = "topk",
    generator: torch.Generator | None = None,
    seed: int | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Indices ``[B, K]`` of the initial centres.

    ``"topk"`` (the paper's default): the K tokens with the highest ``scores [B, N]``
    (significance scores); ties go to the lower index. ``"random"``: K distinct tokens
    uniformly at random from ``generator``, or from counter-based noise when ``seed`` is
    given (appendix B's ablation; see :mod:`leanformer.ops.hashed_noise`).
    """
    if mode == "topk":
        if scores is None:
            raise ValueError("init='topk' needs scores (significance scores or weights)")
        return scores.topk(k, dim=1, sorted=True).indices
    if mode == "random":
        device = device if device is not None else (scores.device if scores is not None else None)
        noise = uniform_noise(batch, num_tokens, generator=generator, seed=seed, device=device)
        return noise.topk(k, dim=1).indices
    raise ValueError(f"unknown init mode {mode!r}; expected 'topk' or 'random'")


def _check(x: Tensor, k: int, weights: Tensor | None) -> None:
    if x.dim() != 3:
        raise ValueError(f"tokens must be [B, N, C], got shape {tuple(x.shape)}")
    if k < 1:
        raise ValueError(f"number of clusters must be at least 1, got {k}")
    if weights is not None and weights.shape != x.shape[:2]:
        raise ValueError(f"weights must be [B, N] = {tuple(x.shape[:2])}, got {tuple(weights.shape)}")


def _default_init(
    init: Tensor | None, weights: Tensor | None, k: int, num_tokens: int, batch: int, device: torch.device
) -> Tensor:
    """Given ``init [B, K]`` or, by default, the top-K by weight (the first K when unweighted).

    A given ``init`` must hold K distinct token indices per example. That is checked only
    where reading the verdict back is free (:func:`_reads_back`).
    """
    if init is not None:
        if init.shape != (batch, k):
            raise ValueError(f"init must be [B, K] = {(batch, k)}, got {tuple(init.shape)}")
        if _reads_back(init):
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


def _reads_back(t: Tensor) -> bool:
    """Whether reading a value of ``t`` on the host is free: in eager mode on CPU. Elsewhere
    it would be a device sync on every call, or a graph break under ``torch.compile``."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _settled(new: Tensor, old: Tensor) -> bool:
    """Whether every example is at its fixed point (``new`` equals ``old``), asked only where
    the answer reads back for free (:func:`_reads_back`); elsewhere the iterations run to
    ``max_iters``. The plan is the same either way: a state that no longer changes is a
    fixed point."""
    return _reads_back(new) and torch.equal(new, old)


def _identity_plan(x: Tensor, *, medoids: bool) -> ClusterPlan:
    """Every token alone in its own cluster, in token order (what ``K >= N`` asks for)."""
    B, N, _ = x.shape
    own = torch.arange(N, device=x.device).expand(B, N)
    if medoids:
        return ClusterPlan(assign=own, medoids=own, centers=None)
    return ClusterPlan(assign=own, medoids=None, centers=x.detach())


def _weights(x: Tensor, weights: Tensor | None, dtype: torch.dtype) -> Tensor:
    if weights is None:
        return torch.ones(x.shape[:2], dtype=dtype, device=x.device)
    return weights.detach().to(dtype)


def _first_argmin(values: Tensor, assign: Tensor, k: int) -> Tensor:
    """Per cluster, the member token with the smallest ``values``; ties go to the lowest index.

    ``values, assign [B, N]`` -> token indices ``[B, K]``. Two segment-min reductions
    instead of a ``[B, K, N]`` masked matrix. Every cluster must be non-empty.
    """
    B, N = values.shape
    inf = torch.full((B, k), float("inf"), dtype=values.dtype, device=values.device)
    best = inf.scatter_reduce(1, assign, values, reduce="amin", include_self=True)
    index = torch.arange(N, device=values.device).expand(B, N)
    candidate = torch.where(values == best.gather(1, assign), index, N)
    init = torch.full((B, k), N, dtype=index.dtype, device=values.device)
    return init.scatter_reduce(1, assign, candidate, reduce="amin", include_self=True)


def _medoid_rows(xc: Tensor, sq_norms: Tensor, medoids: Tensor, every_pair: Tensor | None) -> Tensor:
    """Squared distances ``[B, P, N]`` from the tokens at ``medoids [B, P]`` to every token.

    Picked from ``every_pair [B, N, N]`` when given, else computed: ``P x N`` distances,
    one matrix product. ``xc [B, N, C]``: centred tokens, ``sq_norms = |xc|^2 [B, N]``.
    """
    B, N, C = xc.shape
    if every_pair is not None:
        # Whole rows by index_select (a gather with an index expanded over N is ~10x slower).
        return every_pair.view(B * N, N).index_select(0, flat_rows(medoids, N)).view(B, -1, N)
    table, step = row_table(xc)
    centres = table.index_select(0, flat_rows(medoids, step)).view(B, -1, C)
    return pairwise_sq_dists(centres, xc, y_sq_norms=sq_norms)


def _moved_rows(rows: Tensor, xc: Tensor, sq_norms: Tensor, old: Tensor, new: Tensor) -> Tensor:
    """``rows [B, K, N]`` of the ``old`` medoids -> those of the ``new`` ones, in place,
    computing only the rows of medoids that moved (eager CPU only: it reads back how many
    moved).

    Few move once the tokens have settled into clusters: 1-14% in the first update on
    ``deit_fashion``, fewer later, so this costs a fraction of ``K x N`` distances.
    """
    B, k, N = rows.shape
    moved = new != old
    most = int(moved.sum(dim=1).max())
    # Every example's moved slots first; examples with fewer also recompute unmoved slots,
    # whose rows are written back only where the medoid moved.
    slots = moved.to(torch.uint8).sort(dim=1, descending=True, stable=True).indices[:, :most]
    flat = flat_rows(slots, k)
    table = rows.view(B * k, N)
    fresh = _medoid_rows(xc, sq_norms, new.gather(1, slots), None).view(B * most, N)
    keep = moved.gather(1, slots).view(B * most, 1)
    table.index_copy_(0, flat, torch.where(keep, fresh, table.index_select(0, flat)))
    return rows


def _assign_to_medoids(rows: Tensor, medoids: Tensor) -> Tensor:
    """``rows [B, K, N]`` (distances from every medoid), ``medoids [B, K]`` -> ``assign [B, N]``
    (eqs. 10/16).

    Every token goes to its nearest medoid, the first in medoid order on ties; a medoid
    always belongs to its own cluster, even when another medoid duplicates it, so no
    cluster is empty.
    """
    B, k, _ = rows.shape
    assign = rows.min(dim=1).indices  # the first minimum
    return assign.scatter(1, medoids, torch.arange(k, device=medoids.device).expand(B, k))


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
    B, N, C = xc.shape
    total = w.new_zeros(B, k).scatter_add_(1, assign, w)
    own_total = total.gather(1, assign)
    # Weights normalised per cluster first: the means are then one segment sum.
    means = segment_sum(xc, assign, k, w / own_total.clamp_min(torch.finfo(w.dtype).tiny))
    own_mean = means.view(B * k, C).index_select(0, flat_rows(assign, k)).view(B, N, C)
    score = sq_norms - 2.0 * own_mean.mul_(xc).sum(-1)
    members = torch.zeros_like(total).scatter_add_(1, assign, torch.ones_like(w)).gather(1, assign)
    tied = ((members == 2) & (own_total - w == w)) | (own_total == 0)
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
    medoid indices (see :func:`init_centers`; by default the top-K by ``weights``, or the
    first K tokens when unweighted). Ties go to the lowest token index (medoid update) and
    to the first medoid in medoid order (assignment).

    The medoid update minimises the *weighted* sum of distances to the members: eq. 17
    prints the unweighted one, which would not decrease the weighted objective (eq. 13).
    With more tokens than channels (N > C) it runs on cluster means (O(N C) per update)
    and needs distances from the medoids only: eager on CPU, those of the initial medoids
    and then of the ones that move; elsewhere, where counting the moved ones would cost a
    device sync or a graph break, all N x N distances once, the medoids' rows picked from
    them. With N <= C, sums over all N x N distances cost less than the means' O(N C)
    passes. Every way gives the plan of the sums, up to float rounding of the distances.
    """
    _check(x, k, weights)
    B, N, C = x.shape
    if k >= N:
        return _identity_plan(x, medoids=True)
    medoids = _default_init(init, weights, k, N, B, x.device)
    xc = centred(x.detach())
    w = _weights(x, weights, xc.dtype)
    from_means = N > C
    sq_norms = (xc * xc).sum(-1) if from_means else xc.new_empty(0)  # unused with N <= C
    every_pair = None if from_means and _reads_back(xc) else token_sq_dists(xc)
    rows = _medoid_rows(xc, sq_norms, medoids, every_pair)
    assign = _assign_to_medoids(rows, medoids)
    for _ in range(max_iters):
        if from_means:
            new_medoids = _medoids_from_means(xc, sq_norms, w, assign, k)
        else:
            assert every_pair is not None
            new_medoids = _medoids_from_pairs(every_pair, assign, w, k)
        if _settled(new_medoids, medoids):
            break
        if every_pair is None:
            rows = _moved_rows(rows, xc, sq_norms, medoids, new_medoids)
        else:
            rows = _medoid_rows(xc, sq_norms, new_medoids, every_pair)
        medoids = new_medoids
        assign = _assign_to_medoids(rows, medoids)
    return ClusterPlan(assign=assign, medoids=medoids, centers=None)


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


def _nearest_center(x: Tensor, centers: Tensor) -> Tensor:
    """``x [B, N, C]``, ``centers [B, K, C]`` -> the nearest centre of every token ``[B, N]``
    (the first on ties)."""
    return pairwise_sq_dists(x, centers).argmin(dim=2)


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
    and :func:`cluster_mean` returns that centre. ``K >= N`` is the identity plan.
    """
    _check(x, k, weights)
    B, N, C = x.shape
    if k >= N:
        return _identity_plan(x, medoids=False)
    seeds = _default_init(init, weights, k, N, B, x.device)
    xc = centred(x.detach())
    w = _weights(x, weights, xc.dtype)
    table, step = row_table(xc)
    centers = table.index_select(0, flat_rows(seeds, step)).view(B, k, C)
    assign = _nearest_center(xc, centers).scatter(1, seeds, torch.arange(k, device=x.device).expand(B, k))
    for _ in range(max_iters):
        means, w_sum = weighted_segment_mean(xc, w, assign, k)
        centers = torch.where(w_sum[..., None] > 0, means, centers)
        new_assign = _nearest_center(xc, centers)
        if _settled(new_assign, assign):
            break
        assign = new_assign
    # Back from centred coordinates to the tokens' own.
    offset = x.detach().to(xc.dtype).mean(dim=1, keepdim=True)
    return ClusterPlan(assign=assign, medoids=None, centers=(centers + offset).to(x.dtype))


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
