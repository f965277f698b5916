"""The C++ K-Means iterations against the batched PyTorch plan they stand in for."""

from __future__ import annotations

import warnings

import pytest
import torch

from leanformer.ops import kmeans_native
from leanformer.ops.cluster_init import init_centers
from leanformer.ops.kmeans import kmeans_plan
from leanformer.ops.native import KERNELS, MissingKernelWarning
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
    with without_kernel(monkeypatch, kmeans_native):
        return kmeans_plan(*args, **kwargs)


def _assert_same_plan(kernel, batched, dtype: torch.dtype) -> None:
    assert torch.equal(kernel.assign, batched.assign)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(kernel.centers, batched.centers, **tol)
    assert kernel.centers.dtype == batched.centers.dtype == dtype


@plan_variants
@pytest.mark.parametrize(("b", "n", "c", "k"), PLAN_SHAPES)
def test_kernel_plans_equal_the_batched_plans(
    dtype: torch.dtype, b: int, n: int, c: int, k: int, start: str, monkeypatch
) -> None:
    x, w = clustered(b, n, c, seed=n + k, dtype=dtype)
    init = starting_tokens(start, k, n, b)
    for weights in (w, None):
        for iters in (0, 1, 5, 20):
            kernel = kmeans_plan(x, k, weights=weights, init=init, max_iters=iters)
            batched = _batched(monkeypatch, x, k, weights=weights, init=init, max_iters=iters)
            _assert_same_plan(kernel, batched, dtype)


def test_far_from_the_origin_the_kernel_centres_as_the_batched_code(monkeypatch) -> None:
    x, w = clustered(4, 80, 16, seed=3, dtype=torch.float32)
    x = x + 1e3
    kernel = kmeans_plan(x, 20, weights=w)
    batched = _batched(monkeypatch, x, 20, weights=w)
    assert torch.equal(kernel.assign, batched.assign)
    torch.testing.assert_close(kernel.centers, batched.centers, rtol=1e-6, atol=1e-3)


def test_clusters_that_lose_their_weight_keep_their_centres(monkeypatch) -> None:
    """Weightless tokens: a cluster of only such tokens keeps its centre (standard Lloyd);
    a seed far from everything loses its members and is left empty, as in the batched code."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 30, 4, generator=g, dtype=torch.float64)
    w = torch.rand(3, 30, generator=g, dtype=torch.float64) * (torch.rand(3, 30, generator=g) > 0.5)
    init = init_centers(None, 9, num_tokens=30, batch=3, mode="random", generator=g)
    kernel = kmeans_plan(x, 9, weights=w, init=init, max_iters=10)
    batched = _batched(monkeypatch, x, 9, weights=w, init=init, max_iters=10)
    _assert_same_plan(kernel, batched, torch.float64)
    counts = torch.zeros(3, 9).scatter_add_(1, kernel.assign, torch.ones(3, 30))
    assert (counts == 0).any() or (w == 0).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_centres_at_one_point_tie_to_the_first(dtype: torch.dtype) -> None:
    x, w, seeds = three_starts_at_one_point(dtype)
    assign, _ = kmeans_native.iterate_on_cpu(x, w, seeds, 0)
    assert_ties_go_to_the_first_copy(assign)


def test_threads_do_not_change_the_plan() -> None:
    x, w = clustered(8, 65, 24, seed=1, dtype=torch.float32)
    one, two = (on_threads(t, lambda: kmeans_plan(x, 30, weights=w)) for t in (1, 2))
    assert torch.equal(one.assign, two.assign) and torch.equal(one.centers, two.centers)


def test_the_kernel_leaves_its_inputs_alone() -> None:
    x, w = clustered(2, 20, 3, seed=0, dtype=torch.float32)
    seeds = w.topk(5, dim=1).indices
    copies = [t.clone() for t in (x, w, seeds)]
    kmeans_native.iterate_on_cpu(x, w, seeds, 5)
    for t, copy in zip((x, w, seeds), copies, strict=True):
        assert torch.equal(t, copy)


def test_flop_counters_count_the_kernel_as_the_batched_plan_under_a_counter(monkeypatch) -> None:
    """Counted, the kernel runs, and its op's formula counts the products the batched plan
    makes under a counter: the initial assignment and one per iteration, every one of
    ``max_iters`` (here the plan settles before)."""
    from leanformer.bench.flops import flop_counter

    calls: list[int] = []
    real = kmeans_native.iterate_on_cpu
    monkeypatch.setattr(kmeans_native, "iterate_on_cpu", lambda *a: calls.append(1) or real(*a))
    x, w = clustered(2, 40, 8, seed=2, dtype=torch.float32)
    kmeans_plan(x, 10, weights=w)
    assert calls == [1]
    with flop_counter() as counter:
        kmeans_plan(x, 10, weights=w, max_iters=20)
    assert calls == [1, 1]
    assert counter.get_total_flops() == 21 * 2 * (2 * 40 * 10 * 8)
    with without_kernel(monkeypatch, kmeans_native), flop_counter() as batched:
        kmeans_plan(x, 10, weights=w, max_iters=20)
    assert calls == [1, 1] and batched.get_total_flops() == counter.get_total_flops()


def test_without_the_kernel_plans_warn_once_and_still_plan(monkeypatch) -> None:
    x, w = clustered(2, 20, 4, seed=0, dtype=torch.float32)
    want = kmeans_plan(x, 5, weights=w)
    monkeypatch.setattr(KERNELS[kmeans_native.OP], "extension", None)
    monkeypatch.setattr(KERNELS[kmeans_native.OP], "warned", False)
    with pytest.warns(MissingKernelWarning, match="without its C\\+\\+ K-Means kernel") as record:
        first = kmeans_plan(x, 5, weights=w)
    assert record[0].filename == __file__  # it points at the caller of kmeans_plan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = kmeans_plan(x, 5, weights=w)
    for got in (first, second):
        _assert_same_plan(got, want, torch.float32)
