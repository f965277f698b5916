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


def pairwise_sq_dists(x: Tensor, y: Tensor | None = None) -> Tensor:
    """Squared Euclidean distances ``[B, N, M]`` between ``x [B, N, C]`` and ``y [B, M, C]``.

    One batched matrix product (``|x|^2 + |y|^2 - 2 x.y``); clamped at 0 because rounding
    can make the expansion slightly negative for (near-)identical tokens. The expansion
    cancels badly when the tokens sit far from the origin compared with their spread:
    pass tokens centred per example (:func:`centred`), which leaves distances unchanged.
    """
    xx = (x * x).sum(-1)
    yy = xx if y is None else (y * y).sum(-1)
    y = x if y is None else y
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

    A given ``init`` must hold K distinct token indices per example. That is checked in
    eager mode on CPU only: elsewhere reading the verdict back would be a device sync on
    every call (and a graph break under ``torch.compile``).
    """
    if init is not None:
        if init.shape != (batch, k):
            raise ValueError(f"init must be [B, K] = {(batch, k)}, got {tuple(init.shape)}")
        if init.device.type == "cpu" and not torch.compiler.is_compiling():
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


def _settled(new: Tensor, old: Tensor) -> bool:
    """Whether every example is at its fixed point (``new`` equals ``old``), asked only in
    eager mode on CPU, where reading the answer costs nothing; elsewhere the iterations
    run to ``max_iters`` (a device sync or a graph break would cost more than they save).
    The plan is the same either way: a state that no longer changes is a fixed point."""
    if new.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    return torch.equal(new, old)


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


def _assign_to_medoids(dists: Tensor, medoids: Tensor) -> Tensor:
    """``dists [B, N, N]`` (symmetric), ``medoids [B, K]`` -> ``assign [B, N]`` (eqs. 10/16).

    Every token goes to its nearest medoid, the first in medoid order on ties; a medoid
    always belongs to its own cluster, even when another medoid duplicates it, so no
    cluster is empty. Reads the medoids' rows (their columns, by symmetry).
    """
    B, N, _ = dists.shape
    k = medoids.shape[1]
    # Whole rows by index_select (a gather with an index expanded over N is ~10x slower).
    to_medoids = dists.view(B * N, N).index_select(0, flat_rows(medoids, N)).view(B, k, N)
    assign = to_medoids.min(dim=1).indices  # the first minimum
    return assign.scatter(1, medoids, torch.arange(k, device=medoids.device).expand(B, k))


def _update_medoids(dists: Tensor, assign: Tensor, w: Tensor, k: int) -> Tensor:
    """The new medoid of every cluster (eqs. 12/17) -> token indices ``[B, K]``.

    ``within[b, j, i] = sum_{i' in cluster j} w_i' d(i', i)`` is the cost of token ``i``
    as the medoid of cluster ``j``; each cluster takes the member with the least cost of
    its own cluster. This is the *weighted* sum: eq. 17 prints the unweighted one,
    which would not decrease the weighted objective (eq. 13).
    """
    within = segment_sum(dists, assign, k, w)  # [B, K, N]
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

    Algorithm 1 of the paper, batched: distances between the tokens once, assignment to
    the initial medoids, then ``max_iters`` times a medoid update and a reassignment.
    ``init [B, K]``: initial medoid indices (see :func:`init_centers`; by default the
    top-K by ``weights``, or the first K tokens when unweighted). Ties go to the lowest
    token index (medoid update) and to the first medoid in medoid order (assignment).
    """
    _check(x, k, weights)
    B, N, _ = x.shape
    if k >= N:
        return _identity_plan(x, medoids=True)
    medoids = _default_init(init, weights, k, N, B, x.device)
    dists = token_sq_dists(centred(x.detach()))
    w = _weights(x, weights, dists.dtype)
    assign = _assign_to_medoids(dists, medoids)
    for _ in range(max_iters):
        new_medoids = _update_medoids(dists, assign, w, k)
        if _settled(new_medoids, medoids):
            break
        medoids = new_medoids
        assign = _assign_to_medoids(dists, medoids)
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
