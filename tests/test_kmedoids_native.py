"""The C++ K-Medoids iterations against the batched PyTorch plan they stand in for."""

from __future__ import annotations

import warnings

import pytest
import torch

from leanformer.ops import kmedoids_native
from leanformer.ops.cluster_init import init_centers
from leanformer.ops.kmedoids import kmedoids_plan
from leanformer.ops.native import KERNELS, MissingKernelWarning
from leanformer.ops.token_distances import centred
from native_kernels import (
    PLAN_SHAPES,
    assert_ties_go_to_the_first_copy,
    clustered,
    on_threads,
    plan_variants,
    starting_tokens,
    three_starts_at_one_point,
    without_kernel,
)


def _batched(monkeypatch: pytest.MonkeyPatch, *args, **kwargs):
    with without_kernel(monkeypatch, kmedoids_native):
        return kmedoids_plan(*args, **kwargs)


def test_without_the_kernel_plans_warn_once_and_still_plan(monkeypatch) -> None:
    x, w = clustered(2, 20, 4, seed=0, dtype=torch.float32)
    monkeypatch.setattr(KERNELS[kmedoids_native.OP], "extension", None)
    monkeypatch.setattr(KERNELS[kmedoids_native.OP], "warned", False)
    missing = "without its C\\+\\+ K-Medoids kernel"
    with pytest.warns(MissingKernelWarning, match=missing) as record:
        first = kmedoids_plan(x, 5, weights=w)
    assert record[0].filename == __file__  # it points at the caller of kmedoids_plan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = kmedoids_plan(x, 5, weights=w)
    assert torch.equal(first.assign, second.assign)


@plan_variants
@pytest.mark.parametrize(("b", "n", "c", "k"), PLAN_SHAPES)
def test_kernel_plans_equal_the_batched_plans(
    dtype: torch.dtype, b: int, n: int, c: int, k: int, start: str, monkeypatch
) -> None:
    """Weighted and unweighted, from the top-K start and from random starts (which move
    many medoids over several updates)."""
    x, w = clustered(b, n, c, seed=n + k, dtype=dtype)
    init = starting_tokens(start, k, n, b)
    moved = False
    for weights in (w, None):
        kernel = kmedoids_plan(x, k, weights=weights, init=init, max_iters=8)
        batched = _batched(monkeypatch, x, k, weights=weights, init=init, max_iters=8)
        assert torch.equal(kernel.assign, batched.assign)
        assert torch.equal(kernel.medoids, batched.medoids)
        moved |= not torch.equal(
            kernel.medoids, kmedoids_plan(x, k, weights=weights, init=init, max_iters=0).medoids
        )
    assert moved or start == "topk" or k == 1  # random starts must exercise the updates


def test_identical_medoids_keep_identical_distance_rows(monkeypatch) -> None:
    """A medoid that moves onto a copy of another medoid's token must tie with it exactly
    (the first in medoid order takes the tokens), although the caller's matrix product
    made the other's distances: with every token duplicated, any rounding difference
    between the two would send tokens to the second copy."""
    x, w = clustered(6, 20, 12, seed=3, dtype=torch.float32)
    x, w = torch.cat([x, x], dim=1), torch.cat([w, w], dim=1)  # token i + 20 is token i
    gen = torch.Generator().manual_seed(0)
    for k in (3, 9, 17):
        init = init_centers(None, k, num_tokens=40, batch=6, mode="random", generator=gen)
        kernel = kmedoids_plan(x, k, weights=w, init=init, max_iters=10)
        batched = _batched(monkeypatch, x, k, weights=w, init=init, max_iters=10)
        assert torch.equal(kernel.assign, batched.assign)
        assert torch.equal(kernel.medoids, batched.medoids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_initial_medoids_at_one_point_tie_from_the_first_assignment(dtype: torch.dtype) -> None:
    x, w, medoids = three_starts_at_one_point(dtype)
    assign, _ = kmedoids_native.iterate_on_cpu(x, w, medoids, 0)
    assert_ties_go_to_the_first_copy(assign)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(4))
def test_duplicates_and_weightless_tokens_give_the_plans_of_the_batched_update_from_means(
    dtype: torch.dtype, seed: int, monkeypatch
) -> None:
    """One token five times, a third of the weights 0: identical members tie exactly, and
    so do the members of weightless clusters. The kernel updates from the cluster means; so
    does the batched code forced to that form (its update from all pair distances rounds
    the distance between identical tokens above 0, and breaks such ties by weight).
    Ties of exact arithmetic between different tokens are broken by rounding, differently
    by the two (the kernel centres the tokens and sums their norms itself), and are left
    out: small integers, or a cluster of two tokens twice each, whose mean lies half-way
    between them (which is why only one token is repeated)."""
    from leanformer.ops import kmedoids

    g = torch.Generator().manual_seed(seed)
    b, n, c = 8, 24, 3
    x = torch.randn(b, n - 4, c, generator=g, dtype=dtype)
    repeated = int(torch.randint(n - 4, (1,), generator=g))
    x = torch.cat([x, x[:, [repeated] * 4]], dim=1)
    w = torch.rand(b, n, generator=g, dtype=dtype) * (torch.rand(b, n, generator=g) > 0.33)
    monkeypatch.setattr(kmedoids, "_update_from_means", lambda n, c, k: True)
    for k in (1, 5, 12, 23):
        init = init_centers(None, k, num_tokens=n, batch=b, mode="random", generator=g)
        for weights in (w, None):
            kernel = kmedoids_plan(x, k, weights=weights, init=init, max_iters=10)
            batched = _batched(monkeypatch, x, k, weights=weights, init=init, max_iters=10)
            assert torch.equal(kernel.assign, batched.assign)
            assert torch.equal(kernel.medoids, batched.medoids)


def test_not_a_number_stays_in_its_example_and_overflow_no_crash(monkeypatch) -> None:
    """The kernel refuses NaN (test_native_kernels); the plan gives the other examples
    their own plans instead of failing the batch (a NaN image's output is NaN anyway)."""
    x, w = clustered(3, 12, 4, seed=2, dtype=torch.float32)
    clean = kmedoids_plan(x, 4, weights=w)
    bad = x.clone()
    bad[1, 5, 2] = float("nan")
    bad_w = w.clone()
    bad_w[2, 0] = float("nan")
    for tokens, weights, damaged in ((bad, w, 1), (x, bad_w, 2)):
        plan = kmedoids_plan(tokens, 4, weights=weights)
        others = [i for i in range(3) if i != damaged]
        assert torch.equal(plan.assign[others], clean.assign[others])
        assert torch.equal(plan.medoids[others], clean.medoids[others])
    # Finite tokens whose squared norms overflow float32: every score is +inf, and the
    # cluster's first member is its medoid, as in the batched code.
    huge = torch.tensor([[[2e19, 0.0], [-2e19, 0.0], [0.0, 2e19], [0.0, -2e19]]])
    plan = kmedoids_plan(huge, 1, init=torch.tensor([[2]]))
    assert plan.medoids.tolist() == _batched(monkeypatch, huge, 1, init=torch.tensor([[2]])).medoids.tolist()


def test_plans_do_not_depend_on_the_thread_count() -> None:
    """Examples run in parallel, each in one task: the plan is the same with 1 or 2 threads."""
    x, w = clustered(9, 80, 24, seed=1, dtype=torch.float32)
    one, two = (on_threads(t, lambda: kmedoids_plan(x, 30, weights=w)) for t in (1, 2))
    assert torch.equal(one.assign, two.assign) and torch.equal(one.medoids, two.medoids)


def _inputs(b: int = 2, n: int = 10, c: int = 3, k: int = 4):
    x, w = clustered(b, n, c, seed=0, dtype=torch.float32)
    return x, w, w.topk(k, dim=1).indices


def test_the_kernel_leaves_its_inputs_alone() -> None:
    x, w, medoids = _inputs()
    copies = [t.clone() for t in (x, w, medoids)]
    kmedoids_native.iterate_on_cpu(x, w, medoids, 5)
    for t, copy in zip((x, w, medoids), copies, strict=True):
        assert torch.equal(t, copy)


def test_the_kernel_table_is_the_python_table() -> None:
    """Zero iterations: the plan is the assignment to the initial medoids, from the tokens
    the kernel centres and the table it makes, which must be the ones centred() and
    medoid_distances make. Far from the origin, so uncentred distances would round apart."""
    from leanformer.ops.medoid_distances import medoid_distances, nearest_medoids

    for seed in range(5):
        x, w = clustered(3, 150, 24, seed=seed, dtype=torch.float32)
        x = x + 1e3
        xc = centred(x)
        sq = torch.linalg.vector_norm(xc, dim=-1).square()
        medoids = w.topk(60, dim=1).indices
        assign, same = kmedoids_native.iterate_on_cpu(x, w, medoids, 0)
        assert torch.equal(same, medoids)
        assert torch.equal(assign, nearest_medoids(medoid_distances(xc, sq, medoids), medoids, 150))


def test_flop_counters_count_the_distances_the_kernel_computes(monkeypatch) -> None:
    """Five tokens on a line, medoids 0 and 3: the first update moves medoid 0 to token 1
    (the middle of 0, 1, 2) and keeps 3 (a two-token tie), the second changes nothing.
    Counted: the initial K x (N - K) = 2 x 3 table, then the moved medoid's row (3
    distances) and the column its old token takes (2), C multiply-adds each."""
    from leanformer.bench.flops import flop_counter

    c = 4
    x = torch.tensor([0.0, 1.0, 2.0, 10.0, 11.0])[None, :, None].expand(1, 5, c).contiguous()
    init = torch.tensor([[0, 3]])
    with flop_counter() as counter:
        plan = kmedoids_plan(x, 2, init=init)
    assert plan.medoids.tolist() == [[1, 3]]
    assert counter.get_total_flops() == 2 * (2 * 3 + 3 + 2) * c
    with flop_counter() as counter:  # no update, no recomputed distance
        kmedoids_plan(x, 2, init=init, max_iters=0)
    assert counter.get_total_flops() == 2 * (2 * 3) * c
