"""The C++ K-Means iterations against the batched PyTorch plan they stand in for."""

from __future__ import annotations

import warnings

import pytest
import torch

from leanformer.ops import kmeans_native
from leanformer.ops.clustering import init_centers, kmeans_plan
from leanformer.ops.native import MissingKernelWarning


def test_the_package_was_built_with_the_kernel() -> None:
    """`make venv` builds it; a build that failed would only show as slower plans."""
    assert kmeans_native.kernel_available(), (
        "leanformer.ops._kmeans_cpu is missing: reinstall with a C++ compiler "
        "(pip install --no-build-isolation -e .) and read the build's warnings"
    )


def _batched(monkeypatch: pytest.MonkeyPatch, *args, **kwargs):
    with monkeypatch.context() as m:
        m.setattr(kmeans_native, "_kernel", None)
        m.setattr(kmeans_native, "_warned", True)
        return kmeans_plan(*args, **kwargs)


def _clustered(b: int, n: int, c: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centres = 4 * torch.randn(b, max(2, n // 6), c, generator=g)
    members = torch.randint(0, centres.shape[1], (n,), generator=g)
    x = centres[:, members] + torch.randn(b, n, c, generator=g)
    return x.to(dtype), (torch.rand(b, n, generator=g) + 0.1).to(dtype)


def _assert_same_plan(kernel, batched, dtype: torch.dtype) -> None:
    assert torch.equal(kernel.assign, batched.assign)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(kernel.centers, batched.centers, **tol)
    assert kernel.centers.dtype == batched.centers.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("b", "n", "c", "k"),
    [(16, 65, 96, 56), (16, 64, 96, 8), (4, 197, 48, 98), (3, 120, 8, 117), (2, 300, 16, 150), (5, 9, 4, 1)],
)
@pytest.mark.parametrize("start", ["topk", "random"])
def test_kernel_plans_equal_the_batched_plans(
    dtype: torch.dtype, b: int, n: int, c: int, k: int, start: str, monkeypatch
) -> None:
    x, w = _clustered(b, n, c, seed=n + k, dtype=dtype)
    gen = torch.Generator().manual_seed(k)
    init = (
        None
        if start == "topk"
        else init_centers(None, k, num_tokens=n, batch=b, mode="random", generator=gen)
    )
    for weights in (w, None):
        for iters in (0, 1, 5, 20):
            kernel = kmeans_plan(x, k, weights=weights, init=init, max_iters=iters)
            batched = _batched(monkeypatch, x, k, weights=weights, init=init, max_iters=iters)
            _assert_same_plan(kernel, batched, dtype)


def test_far_from_the_origin_the_kernel_centres_as_the_batched_code(monkeypatch) -> None:
    x, w = _clustered(4, 80, 16, seed=3, dtype=torch.float32)
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


def test_threads_do_not_change_the_plan() -> None:
    x, w = _clustered(8, 65, 24, seed=1, dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kmeans_plan(x, 30, weights=w)
        torch.set_num_threads(2)
        two = kmeans_plan(x, 30, weights=w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.assign, two.assign) and torch.equal(one.centers, two.centers)


def test_the_kernel_leaves_its_inputs_alone() -> None:
    x, w = _clustered(2, 20, 3, seed=0, dtype=torch.float32)
    mean, seeds = x.mean(dim=1), w.topk(5, dim=1).indices
    copies = [t.clone() for t in (x, mean, w, seeds)]
    kmeans_native.iterate_on_cpu(x, mean, w, seeds, 5)
    for t, copy in zip((x, mean, w, seeds), copies, strict=True):
        assert torch.equal(t, copy)


def test_flop_counters_see_the_batched_plan(monkeypatch) -> None:
    """The kernel computes the batched plan's products, where a counter cannot see them:
    counted, the batched plan runs (and counts the same)."""
    from leanformer.bench.flops import flop_counter

    calls: list[int] = []
    real = kmeans_native.iterate_on_cpu
    monkeypatch.setattr(kmeans_native, "iterate_on_cpu", lambda *a: calls.append(1) or real(*a))
    x, w = _clustered(2, 40, 8, seed=2, dtype=torch.float32)
    kmeans_plan(x, 10, weights=w)
    assert calls == [1]
    with flop_counter() as counter:
        kmeans_plan(x, 10, weights=w)
    assert calls == [1] and counter.get_total_flops() > 2 * 2 * 40 * 10 * 8


def test_without_the_kernel_plans_warn_once_and_still_plan(monkeypatch) -> None:
    x, w = _clustered(2, 20, 4, seed=0, dtype=torch.float32)
    want = kmeans_plan(x, 5, weights=w)
    monkeypatch.setattr(kmeans_native, "_kernel", None)
    monkeypatch.setattr(kmeans_native, "_warned", False)
    with pytest.warns(MissingKernelWarning, match="without its C\\+\\+ K-Means kernel"):
        first = kmeans_plan(x, 5, weights=w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = kmeans_plan(x, 5, weights=w)
    for got in (first, second):
        _assert_same_plan(got, want, torch.float32)


def test_bad_kernel_inputs_raise_clear_errors(monkeypatch) -> None:
    x, w = _clustered(2, 10, 3, seed=0, dtype=torch.float32)
    mean, seeds = x.mean(dim=1), w.topk(4, dim=1).indices
    with pytest.raises(RuntimeError, match="one floating type"):
        kmeans_native.iterate_on_cpu(x, mean, w.double(), seeds, 5)
    with pytest.raises(RuntimeError, match=r"mean must be \[B, C\]"):
        kmeans_native.iterate_on_cpu(x, mean[:, 1:], w, seeds, 5)
    with pytest.raises(RuntimeError, match="int64"):
        kmeans_native.iterate_on_cpu(x, mean, w, seeds.int(), 5)
    repeated = seeds.clone()
    repeated[0, 1] = repeated[0, 0]
    with pytest.raises(ValueError, match="K distinct tokens"):
        kmeans_native.iterate_on_cpu(x, mean, w, repeated, 5)
    outside = seeds.clone()
    outside[1, 0] = 10
    with pytest.raises(ValueError, match="K distinct tokens"):
        kmeans_native.iterate_on_cpu(x, mean, w, outside, 5)
    nan = x.clone()
    nan[1, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="finite tokens and weights"):
        kmeans_native.iterate_on_cpu(nan, nan.mean(dim=1), w, seeds, 5)
    with pytest.raises(RuntimeError, match="must all be CPU tensors"):
        kmeans_native.iterate_on_cpu(x, mean, w.to("meta"), seeds, 5)
    monkeypatch.setattr(kmeans_native, "_kernel", None)
    with pytest.raises(RuntimeError, match="without its C\\+\\+ K-Means kernel"):
        kmeans_native.iterate_on_cpu(x, mean, w, seeds, 5)
