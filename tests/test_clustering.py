"""K-Means / K-Medoids (weighted or not) against slow per-example references, plus invariants."""

from __future__ import annotations

import itertools

import pytest
import torch

from leanformer.ops.attention import attention
from leanformer.ops.cluster_init import init_centers
from leanformer.ops.cluster_plan import ClusterPlan, cluster_mean, cluster_sizes, clustering_objective
from leanformer.ops.kmeans import kmeans_plan
from leanformer.ops.kmedoids import kmedoids_plan
from leanformer.ops.native import KERNELS, kernel_available
from leanformer.ops.token_distances import pairwise_sq_dists
from native_kernels import like_an_accelerator

# ----------------------------------------------------------------- slow references (loops)


def _sqd(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b) ** 2).sum())


def ref_kmedoids(x: torch.Tensor, k: int, w: list[float], init: list[int], iters: int):
    """One example, plain loops: assignment (medoids own their cluster), weighted medoid update."""
    n = x.shape[0]
    d = [[_sqd(x[i], x[j]) for j in range(n)] for i in range(n)]

    def assign(med: list[int]) -> list[int]:
        return [
            med.index(i) if i in med else min(range(k), key=lambda j: (d[i][med[j]], j)) for i in range(n)
        ]

    med = list(init)
    a = assign(med)
    for _ in range(iters):
        new = []
        for j in range(k):
            members = [i for i in range(n) if a[i] == j]
            new.append(min((sum(w[m] * d[i][m] for m in members), i) for i in members)[1])
        if new == med:
            break
        med = new
        a = assign(med)
    return a, med


def ref_kmeans(x: torch.Tensor, k: int, w: list[float], init: list[int], iters: int):
    n = x.shape[0]
    centers = [x[i].clone() for i in init]

    def assign() -> list[int]:
        return [min(range(k), key=lambda j: (_sqd(x[i], centers[j]), j)) for i in range(n)]

    a = assign()
    for j, i in enumerate(init):
        a[i] = j
    for _ in range(iters):
        for j in range(k):
            members = [i for i in range(n) if a[i] == j]
            total = sum(w[i] for i in members)
            if members and total > 0:
                centers[j] = sum(w[i] * x[i] for i in members) / total
        new = assign()
        if new == a:
            break
        a = new
    return a, torch.stack(centers)


def ref_weighted_means(x: torch.Tensor, a: list[int], w: list[float], k: int) -> torch.Tensor:
    out = []
    for j in range(k):
        members = [i for i in range(x.shape[0]) if a[i] == j]
        total = sum(w[i] for i in members)
        out.append(sum(w[i] * x[i] for i in members) / total)
    return torch.stack(out)


@pytest.fixture(autouse=True, params=["kernel", "batched"])
def eager_clustering(request, monkeypatch) -> str:
    """Every test runs twice: eager CPU K-Medoids and K-Means with their C++ iterations,
    and without them (the batched PyTorch code, as in a package built without a compiler)."""
    from leanformer.ops import kmeans_native, kmedoids_native

    for native in (kmedoids_native, kmeans_native):
        if request.param == "batched":
            monkeypatch.setattr(KERNELS[native.OP], "extension", None)
            monkeypatch.setattr(KERNELS[native.OP], "warned", True)
        else:
            assert kernel_available(native.OP), "the package was built without its C++ kernels"
    return request.param


def _data(b: int = 3, n: int = 13, c: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, c, generator=g, dtype=torch.float64)
    w = torch.rand(b, n, generator=g, dtype=torch.float64) + 0.1
    return x, w


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("channels", [5, 16])  # N = 13 > C: update from means; else from pairs
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("iters", [0, 1, 5])
@pytest.mark.parametrize("k", [1, 4, 9])
def test_kmedoids_matches_reference(weighted: bool, iters: int, k: int, channels: int) -> None:
    x, w = _data(c=channels)
    weights = w if weighted else None
    init = init_centers(w, k, num_tokens=x.shape[1], batch=x.shape[0])
    plan = kmedoids_plan(x, k, weights=weights, init=init, max_iters=iters)
    for b in range(x.shape[0]):
        wb = w[b].tolist() if weighted else [1.0] * x.shape[1]
        a, med = ref_kmedoids(x[b], k, wb, init[b].tolist(), iters)
        assert plan.assign[b].tolist() == a
        assert plan.medoids is not None and plan.medoids[b].tolist() == med
        torch.testing.assert_close(cluster_mean(x, plan, weights)[b], ref_weighted_means(x[b], a, wb, k))


@pytest.mark.parametrize("b", [1, 2])
def test_kmedoids_matches_reference_for_every_k(b: int) -> None:
    """Every K from 1 to N - 1 (K = N is the identity plan, tested below)."""
    x, w = _data(b=b, n=6, c=3, seed=7)
    for k in range(1, 6):
        init = init_centers(w, k, num_tokens=6, batch=b)
        plan = kmedoids_plan(x, k, weights=w, init=init)
        assert plan.medoids is not None
        for e in range(b):
            a, med = ref_kmedoids(x[e], k, w[e].tolist(), init[e].tolist(), 5)
            assert plan.assign[e].tolist() == a
            assert plan.medoids[e].tolist() == med


@pytest.mark.parametrize("channels", [3, 32])
@pytest.mark.parametrize("k", [2, 18, 23])
def test_kmedoids_matches_reference_when_many_medoids_move(k: int, channels: int) -> None:
    """Random starts move many medoids, in several updates (k = 23 of 25 tokens leaves
    almost only medoids); with N = 25 > C = 3 only the moved medoids' distances are
    computed, with C = 32 all pairs."""
    x, w = _data(b=4, n=25, c=channels, seed=5)
    gen = torch.Generator().manual_seed(1)
    init = init_centers(None, k, num_tokens=25, batch=4, mode="random", generator=gen)
    plan = kmedoids_plan(x, k, weights=w, init=init, max_iters=10)
    moved = 0
    for b in range(4):
        a, med = ref_kmedoids(x[b], k, w[b].tolist(), init[b].tolist(), 10)
        assert plan.assign[b].tolist() == a
        assert plan.medoids is not None and plan.medoids[b].tolist() == med
        moved += len(set(med) - set(init[b].tolist()))
    assert moved > 0


def test_duplicate_tokens_and_weightless_clusters_tie_to_the_lowest_index() -> None:
    """Identical members cost exactly alike, and so do the members of a cluster whose
    weights are all 0: the reference's tie rule (lowest index) must hold, not rounding."""
    x, w = _data(b=4, n=30, c=3, seed=8)
    x[:, 25:30] = x[:, 5:6]  # token 5 six times
    w[:, 25:30] = w[:, 5:6]
    w[:, :4] = 0.0
    gen = torch.Generator().manual_seed(4)
    for k in (3, 8, 14):
        init = init_centers(None, k, num_tokens=30, batch=4, mode="random", generator=gen)
        for weights in (None, w):
            plan = kmedoids_plan(x, k, weights=weights, init=init, max_iters=10)
            for b in range(4):
                wb = [1.0] * 30 if weights is None else w[b].tolist()
                a, med = ref_kmedoids(x[b], k, wb, init[b].tolist(), 10)
                assert plan.assign[b].tolist() == a
                assert plan.medoids is not None and plan.medoids[b].tolist() == med


def test_a_cluster_of_weight_zero_takes_its_lowest_index_as_medoid() -> None:
    """Every member costs 0; a member nearer the others (token 2) must not win on that."""
    x = torch.tensor([[[10.3, 0.0], [10.1, 0.0], [10.0, 0.0], [0.0, 0.0], [0.2, 0.0], [-0.1, 0.0]]])
    w = torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0, 1.0]])
    plan = kmedoids_plan(x, 2, weights=w, init=torch.tensor([[2, 4]]))
    assert plan.medoids is not None and plan.medoids.tolist() == [[0, 3]]
    assert ref_kmedoids(x[0], 2, w[0].tolist(), [2, 4], 5)[1] == [0, 3]


@pytest.mark.parametrize("weighted", [False, True])
def test_distances_for_moved_medoids_only_give_the_plan_of_all_pairs(weighted: bool, monkeypatch) -> None:
    """Eager CPU (C++) recomputes the distances of the medoids that moved; compiled and
    accelerator runs compute them afresh. Same plans, on data where many medoids move."""
    x, w = _data(b=5, n=60, c=3, seed=9)
    weights = w if weighted else None
    gen = torch.Generator().manual_seed(3)
    plans = {}
    for k in (4, 20, 45):
        init = init_centers(None, k, num_tokens=60, batch=5, mode="random", generator=gen)
        plans[k] = (init, kmedoids_plan(x, k, weights=weights, init=init, max_iters=8))
        start = kmedoids_plan(x, k, weights=weights, init=init, max_iters=0)
        assert not torch.equal(plans[k][1].medoids, start.medoids)
    like_an_accelerator(monkeypatch)
    for k, (init, moved_only) in plans.items():
        every_pair = kmedoids_plan(x, k, weights=weights, init=init, max_iters=8)
        assert torch.equal(every_pair.assign, moved_only.assign)
        assert torch.equal(every_pair.medoids, moved_only.medoids)


@pytest.mark.parametrize("weighted", [False, True])
def test_medoid_updates_from_means_and_from_pairs_agree(weighted: bool) -> None:
    """The two forms of eq. 12 pick the same medoids, with N > C and with N < C."""
    from leanformer.ops.kmedoids import _medoids_from_means, _medoids_from_pairs
    from leanformer.ops.token_distances import token_sq_dists

    for n, c in ((50, 3), (20, 40)):
        x, w = _data(b=6, n=n, c=c, seed=c)
        w = w if weighted else torch.ones_like(w)
        xc = x - x.mean(dim=1, keepdim=True)
        for k in (2, 7, n // 2, n - 1):
            assign = torch.randint(0, k, (6, n), generator=torch.Generator().manual_seed(k))
            assign[:, :k] = torch.arange(k)  # no empty cluster
            from_means = _medoids_from_means(xc, (xc * xc).sum(-1), w, assign, k)
            assert torch.equal(from_means, _medoids_from_pairs(token_sq_dists(xc), assign, w, k))


@pytest.mark.parametrize("k", [300, 450, 590])
def test_large_n_plans_agree_every_way(k: int, monkeypatch) -> None:
    """High-resolution sizes (600 tokens): eager (the C++ iterations, which recompute the
    medoid table where medoids moved), the table recomputed every update, and the update
    from all N x N distances give one plan."""
    from leanformer.ops import kmedoids

    x, w = _data(b=2, n=600, c=8, seed=k)
    init = init_centers(
        None, k, num_tokens=600, batch=2, mode="random", generator=torch.Generator().manual_seed(k)
    )
    plans = [kmedoids_plan(x, k, weights=w, init=init)]
    with monkeypatch.context() as m:
        like_an_accelerator(m)
        plans.append(kmedoids_plan(x, k, weights=w, init=init))
    with monkeypatch.context() as m:
        m.setattr(kmedoids, "_update_from_means", lambda n, c, k: False)
        plans.append(kmedoids_plan(x, k, weights=w, init=init))
    start = kmedoids_plan(x, k, weights=w, init=init, max_iters=0)
    assert not torch.equal(plans[0].medoids, start.medoids)  # medoids did move
    for other in plans[1:]:
        assert torch.equal(other.assign, plans[0].assign)
        assert torch.equal(other.medoids, plans[0].medoids)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("iters", [0, 1, 5])
def test_kmeans_matches_reference(weighted: bool, iters: int) -> None:
    x, w = _data(seed=1)
    k = 4
    weights = w if weighted else None
    init = init_centers(w, k, num_tokens=x.shape[1], batch=x.shape[0])
    plan = kmeans_plan(x, k, weights=weights, init=init, max_iters=iters)
    for b in range(x.shape[0]):
        wb = w[b].tolist() if weighted else [1.0] * x.shape[1]
        a, centers = ref_kmeans(x[b], k, wb, init[b].tolist(), iters)
        assert plan.assign[b].tolist() == a
        assert plan.centers is not None
        torch.testing.assert_close(plan.centers[b], centers)


def test_iterations_past_the_fixed_point_change_nothing() -> None:
    """The plans run a fixed number of iterations (no early exit): once an example has
    converged, further iterations must leave it where it is."""
    x, w = _data(b=4, n=20)
    for fn in (kmedoids_plan, kmeans_plan):
        settled = fn(x, 6, weights=w, max_iters=30)
        more = fn(x, 6, weights=w, max_iters=60)
        assert torch.equal(settled.assign, more.assign)


def test_batched_equals_per_sample() -> None:
    x, w = _data(b=4, n=16)
    for fn in (kmedoids_plan, kmeans_plan):
        full = fn(x, 5, weights=w)
        for b in range(4):
            one = fn(x[b : b + 1], 5, weights=w[b : b + 1])
            assert torch.equal(full.assign[b : b + 1], one.assign)
            torch.testing.assert_close(
                cluster_mean(x, full, w)[b : b + 1], cluster_mean(x[b : b + 1], one, w[b : b + 1])
            )


@pytest.mark.parametrize("iters", [1, 2, 3, 8])
def test_examples_that_settle_early_drop_out_without_changing_the_others(iters: int) -> None:
    """An example at its fixed point stays put while the others go on iterating (up to
    ``max_iters``): every example's plan is the one it gets alone."""
    x, w = _data(b=6, n=40, c=4, seed=11)
    gen = torch.Generator().manual_seed(2)
    init = init_centers(None, 12, num_tokens=40, batch=6, mode="random", generator=gen)
    # Example 0 starts at its own fixed point: it settles before any other.
    init[0] = kmedoids_plan(x[:1], 12, weights=w[:1], init=init[:1], max_iters=50).medoids[0]
    full = kmedoids_plan(x, 12, weights=w, init=init, max_iters=iters)
    one_step = kmedoids_plan(x, 12, weights=w, init=init, max_iters=1)
    settled = kmedoids_plan(x, 12, weights=w, init=init, max_iters=50)
    assert torch.equal(one_step.medoids[0], init[0])
    assert not torch.equal(one_step.medoids[1:], settled.medoids[1:])  # the others still move
    for b in range(6):
        one = kmedoids_plan(x[b : b + 1], 12, weights=w[b : b + 1], init=init[b : b + 1], max_iters=iters)
        assert torch.equal(full.assign[b], one.assign[0])
        assert torch.equal(full.medoids[b], one.medoids[0])


def _halve(x: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step with a fixed point (0) that counts how often it ran."""
    half = x // 2
    return half, steps + 1, (half != x).any()


@pytest.mark.parametrize("where", ["eager", "compiled", "accelerator"])
def test_repeating_stops_after_the_first_step_that_changes_nothing(where: str, monkeypatch) -> None:
    """5 -> 2 -> 1 -> 0 -> 0: the fourth step changes nothing, and no step runs after it,
    eager (the flag read back) and compiled for the CPU (a branch in the graph); where
    neither is free (an accelerator) every step runs, with the same result."""
    from leanformer.ops import cluster_regimes

    def repeat(x: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return cluster_regimes.repeat_while_changing(_halve, (x, steps), 10)

    if where == "accelerator":
        like_an_accelerator(monkeypatch)
    fn = torch.compile(repeat, fullgraph=True, backend="aot_eager") if where == "compiled" else repeat
    x, steps = fn(torch.tensor([5]), torch.tensor(0))
    torch._dynamo.reset()
    assert x.item() == 0 and steps.item() == (10 if where == "accelerator" else 4)


@pytest.mark.parametrize(
    ("fn", "n", "c", "k", "seed"),
    [(kmedoids_plan, 24, 3, 8, 15), (kmedoids_plan, 12, 16, 6, 55), (kmeans_plan, 24, 3, 8, 40)],
    ids=["kmedoids-means-form", "kmedoids-pairs-form", "kmeans"],
)
@pytest.mark.parametrize("iters", [2, 10])
@pytest.mark.parametrize("opaque", [True, False], ids=["opaque", "traced"])
def test_compiled_plans_equal_eager(
    fn, n: int, c: int, k: int, seed: int, iters: int, opaque: bool, monkeypatch
) -> None:
    """Compiled for the CPU, a plan is one opaque call into the eager code (many tokens) or
    traced with its iterations in ``torch.cond`` branches (few): either way the plan of
    ``max_iters``, stopped while the plan still changes (2) or past its fixed point
    (10), in one graph. Tokens close to a line, seeds found by search: the plan changes
    in the first 4-7 iterations."""
    from leanformer.ops import cluster_regimes

    monkeypatch.setattr(cluster_regimes, "OPAQUE_FROM_TOKENS", 1 if opaque else 10**9)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, n, c, generator=g)
    x[..., 1:] *= 0.05
    w = torch.rand(3, n, generator=g) + 0.1

    def plan(x: torch.Tensor, w: torch.Tensor) -> ClusterPlan:
        return fn(x, k, weights=w, max_iters=iters)

    eager = plan(x, w)
    assert not torch.equal(eager.assign, fn(x, k, weights=w, max_iters=1).assign)  # it moves
    graphs: list[str] = []

    def recording(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm.code)
        return gm.forward

    compiled = torch.compile(plan, fullgraph=True, backend=recording)(x, w)
    torch._dynamo.reset()
    assert len(graphs) == 1
    assert (f"leanformer.{fn.__name__}" in graphs[0]) == opaque
    assert ("torch.ops.higher_order.cond" in graphs[0]) == (not opaque)
    assert torch.equal(compiled.assign, eager.assign)
    if eager.medoids is not None:
        assert compiled.medoids is not None and torch.equal(compiled.medoids, eager.medoids)
    else:
        assert compiled.centers is not None and eager.centers is not None
        torch.testing.assert_close(compiled.centers, eager.centers, rtol=0, atol=1e-6)


def test_the_plan_ops_declare_what_they_return() -> None:
    """The opaque ops' fake kernels (shapes, dtypes, strides) against their real outputs,
    with an int32 ``init`` returned unchanged (0 iterations) and with the default starts."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 40, 8, generator=g), torch.rand(2, 40, generator=g) + 0.1
    init = torch.stack([torch.randperm(40, generator=g)[:5] for _ in range(2)]).int()
    for op in (torch.ops.leanformer.kmedoids_plan, torch.ops.leanformer.kmeans_plan):
        for iters in (0, 3):
            torch.library.opcheck(op, (x, 5, w, init, iters))
            torch.library.opcheck(op, (x, 5, None, None, iters))
    assert kmedoids_plan(x, 5, init=init, max_iters=0).medoids.dtype == torch.int64


# -------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("fn", [kmedoids_plan, kmeans_plan])
@pytest.mark.parametrize("weighted", [False, True])
def test_objective_never_increases(fn, weighted: bool) -> None:
    x, w = _data(b=4, n=30, c=3, seed=2)
    weights = w if weighted else None
    init = init_centers(
        None, 7, num_tokens=30, batch=4, mode="random", generator=torch.Generator().manual_seed(0)
    )
    objectives = [
        clustering_objective(x, fn(x, 7, weights=weights, init=init, max_iters=t), weights) for t in range(7)
    ]
    for before, after in itertools.pairwise(objectives):
        assert (after <= before + 1e-9).all()
    assert (objectives[-1] < objectives[0]).any()  # the iterations did something


def test_medoids_are_members_of_their_cluster_and_clusters_non_empty() -> None:
    x, w = _data(b=3, n=25)
    x[:, 10:15] = x[:, 0:5]  # exact duplicates: ties at distance 0
    init = torch.tensor([[0, 10, 1, 11, 2, 3], [0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 0]])
    plan = kmedoids_plan(x, 6, weights=w, init=init, max_iters=5)
    assert plan.medoids is not None
    for b in range(3):
        for j, m in enumerate(plan.medoids[b].tolist()):
            assert plan.assign[b, m] == j
        assert set(plan.assign[b].tolist()) == set(range(6))
    assert torch.isfinite(cluster_mean(x, plan, w)).all()


def test_weighted_mean_and_sizes() -> None:
    x = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [10.0, 10.0]]])
    plan = ClusterPlan(assign=torch.tensor([[0, 0, 1]]), medoids=torch.tensor([[0, 2]]), centers=None)
    w = torch.tensor([[1.0, 3.0, 5.0]])
    torch.testing.assert_close(cluster_mean(x, plan, w), torch.tensor([[[1.5, 0.0], [10.0, 10.0]]]))
    torch.testing.assert_close(cluster_mean(x, plan), torch.tensor([[[1.0, 0.0], [10.0, 10.0]]]))
    sizes = torch.tensor([[2.0, 1.0, 4.0]])
    torch.testing.assert_close(cluster_sizes(sizes, plan, batch=1, num_tokens=3), torch.tensor([[3.0, 4.0]]))
    torch.testing.assert_close(cluster_sizes(None, plan, batch=1, num_tokens=3), torch.tensor([[2.0, 1.0]]))
    # Members of weight 0 only: plain mean rather than a division by zero.
    torch.testing.assert_close(
        cluster_mean(x, plan, torch.tensor([[0.0, 0.0, 1.0]]))[0, 0], torch.tensor([1.0, 0.0])
    )


def test_kmeans_cluster_emptied_mid_run_keeps_its_centre_on_every_path(monkeypatch) -> None:
    """A cluster that loses every member keeps its previous centre; eager CPU (the C++
    iterations, or the batched code, which skips that guard when no cluster is empty)
    gives the plan of the path that always applies it."""
    from leanformer.ops import kmeans, kmeans_native

    emptied = []
    segment_mean = kmeans.weighted_segment_mean

    def watched(*args):
        means, w_sum = segment_mean(*args)
        emptied.append(bool((w_sum == 0).any()))
        return means, w_sum

    monkeypatch.setattr(kmeans, "weighted_segment_mean", watched)
    g = torch.Generator().manual_seed(1379)  # found by search: a cluster empties on the way
    x = torch.randn(1, 10, 2, generator=g, dtype=torch.float64)
    init = torch.tensor([[0, 5, 2, 6]])
    with monkeypatch.context() as m:  # the batched code, whose steps can be watched
        m.setattr(KERNELS[kmeans_native.OP], "extension", None)
        m.setattr(KERNELS[kmeans_native.OP], "warned", True)
        kmeans_plan(x, 4, init=init, max_iters=10)
    assert any(emptied) and not all(emptied)
    for iters in range(1, 11):  # stopped at every iteration, the emptied one included
        plan = kmeans_plan(x, 4, init=init, max_iters=iters)
        with monkeypatch.context() as m:
            like_an_accelerator(m)
            guarded = kmeans_plan(x, 4, init=init, max_iters=iters)
        assert torch.equal(plan.assign, guarded.assign)
        assert torch.equal(plan.centers, guarded.centers)


def test_empty_kmeans_cluster_returns_its_centre() -> None:
    x = torch.tensor([[[0.0], [0.1], [5.0]]])
    centers = torch.tensor([[[0.05], [99.0]]])
    plan = ClusterPlan(assign=torch.tensor([[0, 0, 0]]), medoids=None, centers=centers)
    out = cluster_mean(x, plan)
    torch.testing.assert_close(out, torch.tensor([[[5.1 / 3], [99.0]]]))


@pytest.mark.parametrize("fn", [kmedoids_plan, kmeans_plan])
@pytest.mark.parametrize("extra", [0, 3])
def test_k_at_least_n_is_the_identity_plan(fn, extra: int) -> None:
    """K = N keeps every token as it is, and K > N asks for no reduction either (as the
    layers clamp K), whatever the data: here near-duplicate tokens far from the origin,
    which K-Means once merged, leaving an empty cluster filled with a stale centre."""
    g = torch.Generator().manual_seed(0)
    x = 1e3 + torch.randn(2, 8, 4, generator=g)
    x[:, 5] = x[:, 2] + 1e-4  # a near duplicate of token 2
    w = torch.rand(2, 8, generator=g) + 0.1
    plan = fn(x, 8 + extra, weights=w)
    assert plan.num_clusters == 8
    assert torch.equal(plan.assign, torch.arange(8).expand(2, 8))
    torch.testing.assert_close(cluster_mean(x, plan, w), x, rtol=0, atol=0)
    torch.testing.assert_close(cluster_sizes(None, plan, batch=2, num_tokens=8), torch.ones(2, 8))


def test_gradients_reach_every_token() -> None:
    x, w = _data(b=2, n=12)
    x.requires_grad_(True)
    w.requires_grad_(True)
    for fn in (kmedoids_plan, kmeans_plan):
        plan = fn(x, 4, weights=w)
        out = cluster_mean(x, plan, w)
        (gx,) = torch.autograd.grad((out * torch.randn_like(out)).sum(), x)
        assert (gx.abs().sum(-1) > 0).all()
    plan = kmedoids_plan(x, 4, weights=w)
    assert torch.autograd.gradcheck(lambda a, b: cluster_mean(a, plan, b), (x, w))


def test_pairwise_sq_dists_matches_cdist() -> None:
    x, _ = _data(b=2, n=9)
    y, _ = _data(b=2, n=4, seed=3)
    torch.testing.assert_close(pairwise_sq_dists(x), torch.cdist(x, x) ** 2)
    torch.testing.assert_close(pairwise_sq_dists(x, y), torch.cdist(x, y) ** 2)
    assert (pairwise_sq_dists(x) >= 0).all()


def test_two_member_tie_goes_to_the_lower_index_in_float32() -> None:
    """Unweighted 2-member cluster: both members cost d(a, b), so the lower index wins."""
    g = torch.Generator().manual_seed(2)
    B, C = 64, 384
    a = torch.randn(B, 1, C, generator=g)
    b = a + 0.1 * torch.randn(B, 1, C, generator=g)
    far = 10.0 + torch.randn(B, 1, C, generator=g)
    x = torch.cat([a, b, far], dim=1)  # tokens 0 and 1 close together, token 2 far away
    init = torch.tensor([[2, 1]]).expand(B, 2)  # token 0 joins medoid 1's cluster
    plan = kmedoids_plan(x, 2, init=init, max_iters=1)
    assert torch.equal(plan.medoids, torch.tensor([[2, 0]]).expand(B, 2))
    assert torch.equal(plan.assign, torch.tensor([[1, 1, 0]]).expand(B, 3))


def test_carry_sizes_make_pooling_duplicates_exact() -> None:
    """Pooling exact duplicates and carrying their count leaves attention unchanged (appendix E)."""
    g = torch.Generator().manual_seed(0)
    unique = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    x = torch.cat([unique, unique[:, :3]], dim=1)  # tokens 5, 6, 7 repeat tokens 0, 1, 2
    plan = kmedoids_plan(x, 5, init=torch.arange(5).expand(2, 5))
    pooled = cluster_mean(x, plan)
    sizes = cluster_sizes(None, plan, batch=2, num_tokens=8)
    torch.testing.assert_close(pooled, unique)
    torch.testing.assert_close(sizes, torch.tensor([[2.0, 2, 2, 1, 1]] * 2, dtype=sizes.dtype))
    q = torch.randn(2, 1, 4, 8, generator=g, dtype=torch.float64)
    full, _ = attention(q, x[:, None], x[:, None])
    carried, _ = attention(q, pooled[:, None], pooled[:, None], sizes=sizes)
    torch.testing.assert_close(carried, full)


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_raise() -> None:
    x, w = _data(b=2, n=6)
    with pytest.raises(ValueError, match="number of clusters"):
        kmedoids_plan(x, 0)
    with pytest.raises(ValueError, match="number of clusters"):
        kmeans_plan(x, 0)
    with pytest.raises(ValueError, match=r"\[B, N, C\]"):
        kmedoids_plan(x[0], 2)
    with pytest.raises(ValueError, match="weights must be"):
        kmedoids_plan(x, 2, weights=w[:, :3])
    with pytest.raises(ValueError, match="init must be"):
        kmedoids_plan(x, 2, init=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="distinct"):
        kmedoids_plan(x, 2, init=torch.tensor([[0, 1], [3, 3]]))
    with pytest.raises(ValueError, match=r"\[0, N=6\)"):
        kmedoids_plan(x, 2, init=torch.tensor([[0, 6], [3, 4]]))
    with pytest.raises(ValueError, match="distinct"):
        kmeans_plan(x, 2, init=torch.tensor([[5, 5], [3, 4]]))
    with pytest.raises(ValueError, match="unknown init mode"):
        init_centers(w, 2, num_tokens=6, batch=2, mode="kmeans++")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs scores"):
        init_centers(None, 2, num_tokens=6, batch=2)


def _assign(x: torch.Tensor, medoids: torch.Tensor) -> torch.Tensor:
    from leanformer.ops.medoid_distances import medoid_distances, nearest_medoids

    return nearest_medoids(medoid_distances(x, (x * x).sum(-1), medoids), medoids, x.shape[1])


def test_assignment_ties_go_to_the_first_medoid_in_medoid_order() -> None:
    # Token 0 is exactly as far from token 1 as from token 2.
    x = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [-1.0, 0.0]]])
    assert torch.equal(_assign(x, torch.tensor([[2, 1]])), torch.tensor([[0, 1, 0]]))
    assert torch.equal(_assign(x, torch.tensor([[1, 2]])), torch.tensor([[0, 0, 1]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_assignment_equals_argmin_over_medoid_columns(dtype: torch.dtype) -> None:
    """Against plain argmin (first minimum), with K > 256 so bfloat16 could not count the medoids."""
    g = torch.Generator().manual_seed(3)
    B, N, K = 2, 600, 300
    x = torch.randn(B, N, 4, generator=g).round().to(dtype)  # integer grid: many exact ties
    medoids = torch.rand(B, N, generator=g).topk(K, dim=1).indices
    d = pairwise_sq_dists(x)
    expected = d.gather(2, medoids[:, None, :].expand(B, N, K)).argmin(dim=2)
    expected.scatter_(1, medoids, torch.arange(K).expand(B, K))
    assert torch.equal(_assign(x, medoids), expected)


def test_kmedoids_with_float16_tokens_whose_norm_overflows() -> None:
    """|x|^2 = inf in float16: distances are taken in float32, so token 2 still finds that
    it is nearer to token 1 (299^2) than to token 0 (300^2), and nothing turns NaN."""
    x = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [300.0, 0.0], [0.5, 0.0]]]).half()
    plan = kmedoids_plan(x, 2, init=torch.tensor([[0, 1]]), max_iters=0)
    assert torch.equal(plan.assign, torch.tensor([[0, 1, 1, 0]]))
    plan = kmedoids_plan(x, 2, init=torch.tensor([[0, 1]]))
    assert plan.medoids is not None and int(plan.medoids.max()) < 4


@pytest.mark.parametrize("fn", [kmedoids_plan, kmeans_plan])
def test_float32_plan_matches_float64_far_from_the_origin(fn) -> None:
    """Well-separated clusters whose centres lie at norm 1e3: |x|^2 ~ 1e6 rounds in float32
    to about 0.06, more than the distances inside a cluster (~0.1). Distances are taken on
    centred tokens, so float32 still finds float64's plan."""
    g = torch.Generator().manual_seed(0)
    B, K, per, C = 4, 6, 8, 16
    far = torch.nn.functional.normalize(torch.randn(B, 1, 1, C, generator=g, dtype=torch.float64), dim=-1)
    centres = 1e3 * far + torch.randn(B, K, 1, C, generator=g, dtype=torch.float64)
    x = (centres + 0.05 * torch.randn(B, K, per, C, generator=g, dtype=torch.float64)).view(B, K * per, C)
    w = torch.rand(B, K * per, generator=g, dtype=torch.float64) + 0.5
    init = torch.randperm(K * per, generator=g)[:K].expand(B, K)
    exact = fn(x, K, weights=w, init=init)
    single = fn(x.float(), K, weights=w.float(), init=init)
    assert torch.equal(single.assign, exact.assign)
    if exact.medoids is not None:
        assert torch.equal(single.medoids, exact.medoids)
    else:
        torch.testing.assert_close(single.centers, exact.centers.float(), rtol=0, atol=1e-3)


@pytest.mark.parametrize("fn", [kmedoids_plan, kmeans_plan])
def test_stopping_at_the_fixed_point_gives_the_plan_of_every_iteration(fn, monkeypatch) -> None:
    """Eager CPU runs stop once nothing changes; accelerator runs always do ``max_iters``
    iterations (the plain ones, as where values cannot be read back). Both must give the
    same plan, example by example (K-Means centres to float64 rounding: the C++ K-Means
    sums each example's mean token itself, in its own order)."""
    x, w = _data(b=6, n=40, c=4, seed=11)
    gen = torch.Generator().manual_seed(2)
    init = init_centers(None, 12, num_tokens=40, batch=6, mode="random", generator=gen)
    stopped = [fn(x, 12, weights=w, init=init, max_iters=t) for t in (1, 3, 20)]
    like_an_accelerator(monkeypatch)
    for t, early in zip((1, 3, 20), stopped, strict=True):
        full = fn(x, 12, weights=w, init=init, max_iters=t)
        assert torch.equal(early.assign, full.assign)
        if full.medoids is not None:
            assert torch.equal(early.medoids, full.medoids)
        else:
            torch.testing.assert_close(early.centers, full.centers, rtol=1e-12, atol=1e-12)
