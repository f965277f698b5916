"""K-Means, K-Medoids and their weighted variants for token pooling (Token Pooling, Alg. 1).

Clustering is split, as in ToMe, into a *plan* and its *application*:

- :func:`kmedoids_plan` / :func:`kmeans_plan` run the iterations without gradient and
  return a :class:`ClusterPlan` (the cluster of every token, plus the medoids or centres);
- :func:`cluster_mean` applies a plan as the weighted mean of every cluster, which is
  differentiable, so every input token receives a gradient (the paper returns cluster
  means for K-Medoids too, not the medoids themselves);
- :func:`cluster_sizes` sums token sizes per cluster (the "carry" of appendix E).

Shapes: tokens ``x [B, N, C]``, weights ``w [B, N]`` (positive), ``K`` clusters. Every
step is batched over examples and vectorised over tokens and clusters. A converged
example needs no masking: a K-Means or K-Medoids state that no longer changes is a fixed
point of the next iteration too, so the iterations may stop there, where knowing it
costs no device sync (:func:`_repeat_while_changing`), with the plan of all
``max_iters``. Reading a value back is free only on the CPU, and only in eager code:

- **eager on the CPU** the plans read values back where that saves work: they stop at
  the fixed point, and K-Medoids runs its iterations in C++
  (:mod:`leanformer.ops.kmedoids_native`, when the package was built with it), where
  an iteration is a few loops per example instead of about a hundred small batched
  operations;
- **compiled for the CPU** a plan of many tokens is one opaque call into that eager code
  (``torch.ops.leanformer.kmedoids_plan`` / ``kmeans_plan``), so it costs what it costs
  eager; a small one is traced, each iteration in a :func:`torch.cond` branch that is
  skipped once an iteration changed nothing (:func:`_opaque_when_compiled`). Either way
  the graph stays whole (``torch.compile(fullgraph=True)``);
- **on an accelerator**, eager or compiled, nothing is read back: every iteration runs,
  a converged example staying at its fixed point.

Objective (paper eq. 13): ``sum_i w_i min_j ||x_i - c_j||^2``. Unweighted variants
use ``w = 1``. K-Medoids keeps ``c_j`` among the tokens (medoid constraint). ``K >= N``
is the identity plan (token ``i`` alone in cluster ``i``), whatever the data, as in the
layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from leanformer.ops import kmeans_native
from leanformer.ops.hashed_noise import uniform_noise
from leanformer.ops.kmedoids_native import (
    iterate_and_pool_on_cpu,
    iterate_on_cpu,
    kernel_available,
    warn_once_without_kernel,
)
from leanformer.ops.medoid_distances import MedoidDistances, medoid_distances, nearest_medoids
from leanformer.ops.native import counting, eager_cpu_inference
from leanformer.ops.segment_sum import flat_rows, segment_sum
from leanformer.ops.token_distances import centred, pairwise_sq_dists, token_sq_dists
from leanformer.ops.token_selection import gather_tokens

InitMode = Literal["topk", "random"]

# Marks "no token" in a per-cluster minimum over token indices: above every index.
_NO_TOKEN = torch.iinfo(torch.int64).max
# Compiled for the CPU, plans of at least this many tokens (batch x tokens) are opaque
# calls into the eager code (see _opaque_when_compiled).
_OPAQUE_FROM_TOKENS = 512


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
        # A plan's medoids are int64 whatever integer type init came in (it may return them).
        return init.long()
    if weights is not None:
        return weights.topk(k, dim=1).indices
    return torch.arange(k, device=device).expand(batch, k)


def _reads_back(t: Tensor) -> bool:
    """Whether reading a value of ``t`` on the host is free: in eager mode on CPU. Elsewhere
    it would be a device sync on every call, or a graph break under ``torch.compile``."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _opaque_when_compiled(x: Tensor) -> bool:
    """Whether the plan for tokens ``x [B, N, C]``, traced for the CPU, is one opaque call
    into the eager code (which may read values back), rather than traced itself.

    Traced, the iterations run the plain step (the medoid table recomputed, every cluster
    scored) in fused kernels, skipped after the fixed point by :func:`torch.cond`; the
    eager code (for K-Medoids, the C++ iterations) does less work, plus the call's own
    overhead. Timed as compiled plans alone, the two are close below a few hundred tokens
    and the opaque call wins clearly from ``_OPAQUE_FROM_TOKENS`` on (docs/BENCHMARKS.md,
    "Compiled and eager, small models and batch 1").
    """
    B, N, _ = x.shape
    return _compiling_for_cpu(x) and B * N >= _OPAQUE_FROM_TOKENS


def _compiling_for_cpu(t: Tensor) -> bool:
    """Whether ``t`` is being traced for the CPU (where a graph branch costs no device sync)."""
    return t.device.type == "cpu" and torch.compiler.is_compiling()


def _repeat_while_changing(
    step: Callable[..., tuple[Tensor, ...]], state: tuple[Tensor, ...], max_iters: int
) -> tuple[Tensor, ...]:
    """``max_iters`` times ``state = step(*state)``; ``step`` returns the new state and, last,
    whether it changed (a 0-d bool tensor).

    Once a step changes nothing the state is a fixed point, so the remaining steps are
    skipped where that costs no device sync, with the result of running them all: eager on
    the CPU by reading the flag, and compiled for the CPU by a branch in the graph
    (:func:`torch.cond`, which then skips the remaining steps' work). Elsewhere (an
    accelerator, where the branch would read the flag back) and under a FLOP counter every
    step runs.
    """
    if max_iters < 1:
        return state
    # Under a FLOP counter every step runs, as on an accelerator: a counted cost is then a
    # function of the token counts alone, not of where these images happened to converge
    # (the solver of GFLOPs budgets counts other images than the user's).
    if _reads_back(state[0]) and not counting():
        for _ in range(max_iters):
            *new, changed = step(*state)
            state = tuple(new)
            if not bool(changed):
                break
        return state
    if not _compiling_for_cpu(state[0]):
        for _ in range(max_iters):
            state = step(*state)[:-1]
        return state

    def run(*state_and_flag: Tensor) -> tuple[Tensor, ...]:
        return step(*state_and_flag[:-1])

    def stay(*state_and_flag: Tensor) -> tuple[Tensor, ...]:
        # A branch's outputs may not alias its inputs.
        return tuple(t.clone() for t in state_and_flag)

    active = torch.ones((), dtype=torch.bool, device=state[0].device)
    for _ in range(max_iters):
        *new, active = torch.cond(active, run, stay, (*state, active))
        state = tuple(new)
    return state


def _fresh(t: Tensor) -> Tensor:
    """A contiguous tensor of its own: an opaque op's outputs may not alias its inputs (a
    plan can return its ``init``) nor be views with other strides than declared."""
    return t.clone(memory_format=torch.contiguous_format)


def _plan_as_op(name: str, *, medoids: bool) -> None:
    """Register :func:`kmedoids_plan` (``medoids``) or :func:`kmeans_plan` as the custom op
    ``leanformer::<name>``: one opaque call, run eagerly, returning ``(assign [B, N],
    medoids [B, K])`` or ``(assign, centers [B, K, C])``."""

    def run(
        x: Tensor, k: int, weights: Tensor | None, init: Tensor | None, max_iters: int
    ) -> tuple[Tensor, Tensor]:
        plan_fn = kmedoids_plan if medoids else kmeans_plan
        plan = plan_fn(x, k, weights=weights, init=init, max_iters=max_iters)
        second = plan.medoids if medoids else plan.centers
        assert second is not None
        return _fresh(plan.assign), _fresh(second)

    def shapes(
        x: Tensor, k: int, weights: Tensor | None, init: Tensor | None, max_iters: int
    ) -> tuple[Tensor, Tensor]:
        B, N, C = x.shape
        second = x.new_empty(B, min(k, N), dtype=torch.int64) if medoids else x.new_empty(B, min(k, N), C)
        return x.new_empty(B, N, dtype=torch.int64), second

    torch.library.custom_op(f"leanformer::{name}", run, mutates_args=()).register_fake(shapes)


_plan_as_op("kmedoids_plan", medoids=True)
_plan_as_op("kmeans_plan", medoids=False)


@torch.library.custom_op("leanformer::kmedoids_pooled", mutates_args=())
def _kmedoids_pooled_op(
    x: Tensor, k: int, weights: Tensor | None, init: Tensor | None, max_iters: int
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`kmedoids_pooled` as one opaque call, run eagerly (without a gradient)."""
    plan, pooled = kmedoids_pooled(x, k, weights=weights, init=init, max_iters=max_iters)
    assert plan.medoids is not None
    # The pooled tokens are a new contiguous tensor whichever way they were made (a copy
    # would cost a pass over them).
    return _fresh(plan.assign), _fresh(plan.medoids), pooled


@_kmedoids_pooled_op.register_fake
def _(
    x: Tensor, k: int, weights: Tensor | None, init: Tensor | None, max_iters: int
) -> tuple[Tensor, Tensor, Tensor]:
    B, N, C = x.shape
    k = min(k, N)
    return x.new_empty(B, N, dtype=torch.int64), x.new_empty(B, k, dtype=torch.int64), x.new_empty(B, k, C)


def _identity_plan(x: Tensor, *, medoids: bool) -> ClusterPlan:
    """Every token alone in its own cluster, in token order (what ``K >= N`` asks for)."""
    B, N, _ = x.shape
    own = torch.arange(N, device=x.device).expand(B, N)
    if medoids:
        return ClusterPlan(assign=own, medoids=own, centers=None)
    return ClusterPlan(assign=own, medoids=None, centers=x.detach())


def _detached(weights: Tensor | None) -> Tensor | None:
    return None if weights is None else weights.detach()


def _weights(x: Tensor, weights: Tensor | None, dtype: torch.dtype) -> Tensor:
    if weights is None:
        return torch.ones(x.shape[:2], dtype=dtype, device=x.device)
    return weights.detach().to(dtype)


def _kernel_inputs(x: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """What the C++ clusterings take: the tokens widened as :func:`centred` widens them
    (the kernels centre them themselves), and the weights in the tokens' type; and which
    examples ``[B]`` hold a NaN or inf.

    The kernels refuse non-finite values, which would fail the whole batch for one bad
    image: such an example is clustered as zeros of weight 1 instead (any plan will do),
    and the caller makes its float outputs NaN (:func:`_poison`), so the NaN stays
    confined to its own example, as with every other method.
    """
    tokens = x.detach().to(torch.promote_types(x.dtype, torch.float32))
    w = _weights(x, weights, tokens.dtype)
    bad = ~(tokens.isfinite().flatten(1).all(dim=1) & w.isfinite().all(dim=1))
    tokens = torch.where(bad[:, None, None], torch.zeros((), dtype=tokens.dtype), tokens)
    w = torch.where(bad[:, None], torch.ones((), dtype=w.dtype), w)
    return tokens, w, bad


def _poison(values: Tensor, bad: Tensor) -> Tensor:
    """``values [B, ...]`` with the examples ``bad [B]`` set to NaN (see :func:`_kernel_inputs`)."""
    nan = torch.full((), float("nan"), dtype=values.dtype)
    return torch.where(bad.view(-1, *([1] * (values.dim() - 1))), nan, values)


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
    It takes one of two exact forms (:func:`_update_from_means`): from the cluster means,
    O(N C) per update, or from all N x N distances, O(N^2). The assignment needs only the
    distances between the medoids and the other tokens
    (:mod:`leanformer.ops.medoid_distances`): picked from the N x N distances, or
    computed. Eager on the CPU the iterations run in C++ (from the cluster means, the
    table recomputed only where medoids moved; :mod:`leanformer.ops.kmedoids_native`).
    Every way gives the plan of the sums, up to float rounding of the distances.
    """
    _check(x, k, weights)
    B, N, C = x.shape
    if k >= N:
        return _identity_plan(x, medoids=True)
    if _opaque_when_compiled(x):
        assign, medoids = torch.ops.leanformer.kmedoids_plan(
            x.detach(), k, _detached(weights), init, max_iters
        )
        return ClusterPlan(assign=assign, medoids=medoids, centers=None)
    medoids = _default_init(init, weights, k, N, B, x.device)
    if _reads_back(x):
        if kernel_available():
            # Eager on the CPU: the iterations in C++, one example at a time.
            tokens, w, _ = _kernel_inputs(x, weights)  # a bad example's NaN reaches cluster_mean
            assign, medoids = iterate_on_cpu(tokens, w, medoids, max_iters)
            return ClusterPlan(assign=assign, medoids=medoids, centers=None)
        warn_once_without_kernel()
    xc = centred(x.detach())
    w = _weights(x, weights, xc.dtype)
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
    medoids, assign = _repeat_while_changing(iteration, (medoids, assign), max_iters)
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
    so compiled for the CPU (for as many tokens as :func:`_opaque_when_compiled` sends
    to the eager plan). Otherwise the plan is applied by :func:`cluster_mean`, which is
    differentiable.
    """
    _check(x, k, weights)
    B, N, _ = x.shape
    w_grad = weights is not None and weights.requires_grad
    needs_graph = torch.is_grad_enabled() and (x.requires_grad or w_grad)
    if k < N and not needs_graph and x.dtype in (torch.float32, torch.float64):
        if _opaque_when_compiled(x):
            assign, medoids, pooled = torch.ops.leanformer.kmedoids_pooled(x, k, weights, init, max_iters)
            return ClusterPlan(assign=assign, medoids=medoids, centers=None), pooled
        if kernel_available() and eager_cpu_inference(x, weights, init):
            medoids = _default_init(init, weights, k, N, B, x.device)
            tokens, w, bad = _kernel_inputs(x, weights)
            assign, medoids, pooled = iterate_and_pool_on_cpu(tokens, w, medoids, max_iters)
            pooled = _poison(pooled, bad)
            return ClusterPlan(assign=assign, medoids=medoids, centers=None), pooled
    plan = kmedoids_plan(x, k, weights=weights, init=init, max_iters=max_iters)
    return plan, cluster_mean(x, plan, weights)


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


def _nearest_center(x: Tensor, centers: Tensor, x_sq_norms: Tensor) -> Tensor:
    """``x [B, N, C]`` (``x_sq_norms [B, N]``: its ``|x|^2``), ``centers [B, K, C]`` -> the
    nearest centre of every token ``[B, N]`` (the first on ties)."""
    # min(...).indices: the same first minimum as argmin, in half the time on CPU.
    return pairwise_sq_dists(x, centers, x_sq_norms=x_sq_norms).min(dim=2).indices


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
    B, N, _ = x.shape
    if k >= N:
        return _identity_plan(x, medoids=False)
    if _opaque_when_compiled(x):
        assign, centers = torch.ops.leanformer.kmeans_plan(x.detach(), k, _detached(weights), init, max_iters)
        return ClusterPlan(assign=assign, medoids=None, centers=centers)
    seeds = _default_init(init, weights, k, N, B, x.device)
    if _reads_back(x) and kmeans_native.applies():
        # Eager on the CPU: the iterations in C++, one example at a time.
        tokens, w, bad = _kernel_inputs(x, weights)
        assign, centers = kmeans_native.iterate_on_cpu(tokens, w, seeds, max_iters)
        return ClusterPlan(assign=assign, medoids=None, centers=_poison(centers, bad).to(x.dtype))
    xc = centred(x.detach())
    w = _weights(x, weights, xc.dtype)
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
        none_empty = _reads_back(kept) and bool(kept.all())
        centers = means if none_empty else torch.where(kept[..., None], means, centers)
        new_assign = _nearest_center(xc, centers, sq_norms)
        return centers, new_assign, (new_assign != assign).any()

    centers, assign = _repeat_while_changing(iteration, (centers, assign), max_iters)
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
