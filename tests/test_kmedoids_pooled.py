"""``kmedoids_pooled``: the plan and its cluster means from one kernel pass, against
``kmedoids_plan`` followed by ``cluster_mean`` (the differentiable way)."""

from __future__ import annotations

import pytest
import torch

from leanformer.ops import kmedoids_native
from leanformer.ops.cluster_plan import cluster_mean
from leanformer.ops.kmedoids import kmedoids_plan, kmedoids_pooled
from native_kernels import clustered, starting_tokens, without_kernel


def _two_steps(x: torch.Tensor, k: int, weights: torch.Tensor | None, init: torch.Tensor | None):
    plan = kmedoids_plan(x, k, weights=weights, init=init, max_iters=6)
    return plan, cluster_mean(x, plan, weights)


def _recording_kernel(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = kmedoids_native.iterate_and_pool_on_cpu
    monkeypatch.setattr(kmedoids_native, "iterate_and_pool_on_cpu", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("start", ["topk", "random"])
@pytest.mark.parametrize(("b", "n", "c", "k"), [(4, 65, 24, 40), (3, 197, 16, 98), (2, 30, 5, 1)])
def test_one_pass_gives_the_plan_and_the_means_bit_for_bit(
    dtype: torch.dtype, start: str, b: int, n: int, c: int, k: int, monkeypatch
) -> None:
    """Weighted, unweighted, and with clusters whose members all weigh 0 (their plain
    mean); tokens as a block hands them over, ``x[:, 1:]`` of a contiguous tensor."""
    calls = _recording_kernel(monkeypatch)
    full, w = clustered(b, n + 1, c, seed=n + k, dtype=dtype)
    x, w = full[:, 1:], w[:, 1:].clone()
    w[:, : n // 3] = 0.0
    init = starting_tokens(start, k, n, b)
    for weights in (w, None):
        plan, pooled = kmedoids_pooled(x, k, weights=weights, init=init, max_iters=6)
        want_plan, want = _two_steps(x, k, weights, init)
        assert torch.equal(plan.assign, want_plan.assign)
        assert torch.equal(plan.medoids, want_plan.medoids)
        assert pooled.dtype == dtype and torch.equal(pooled, want)
    assert len(calls) == 2


def test_without_the_kernel_the_same_values(monkeypatch) -> None:
    x, w = clustered(3, 50, 12, seed=1, dtype=torch.float32)
    plan, pooled = kmedoids_pooled(x, 20, weights=w)
    with without_kernel(monkeypatch, kmedoids_native):
        plan_py, pooled_py = kmedoids_pooled(x, 20, weights=w)
    assert torch.equal(plan.assign, plan_py.assign)
    torch.testing.assert_close(pooled, pooled_py, rtol=1e-6, atol=1e-6)


def test_with_a_gradient_to_compute_the_means_stay_differentiable(monkeypatch) -> None:
    """Tokens or weights that need a gradient take cluster_mean: the gradient reaches every
    token, and the weights (but those of one-token clusters, whose share is always 1)."""
    calls = _recording_kernel(monkeypatch)
    x0, w0 = clustered(2, 40, 8, seed=2, dtype=torch.float64)
    with torch.no_grad():
        _, want = kmedoids_pooled(x0, 12, weights=w0)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    _, pooled = kmedoids_pooled(x, 12, weights=w)
    assert pooled.requires_grad
    # embedding_bag's sums: the same terms in the same order, rounded alike but for the
    # fused multiply-adds of the kernel's AVX2 and AVX-512 variants.
    torch.testing.assert_close(pooled.detach(), want, rtol=1e-14, atol=1e-14)
    pooled.square().sum().backward()
    assert x.grad is not None and bool((x.grad.abs().sum(-1) > 0).all())
    assert w.grad is not None and bool((w.grad != 0).any())
    assert len(calls) == 1  # the no_grad call only


def test_half_precision_and_k_at_least_n_take_the_two_steps(monkeypatch) -> None:
    calls = _recording_kernel(monkeypatch)
    x, w = clustered(2, 30, 6, seed=3, dtype=torch.float32)
    plan, pooled = kmedoids_pooled(x.bfloat16(), 10, weights=w)
    want_plan, want = _two_steps(x.bfloat16(), 10, w, None)
    assert torch.equal(plan.assign, want_plan.assign) and torch.equal(pooled, want)
    plan, pooled = kmedoids_pooled(x, 30, weights=w)
    assert torch.equal(plan.assign, torch.arange(30).expand(2, 30)) and torch.equal(pooled, x)
    assert calls == []


def test_bad_inputs_raise_as_the_plan_does() -> None:
    x, w = clustered(2, 30, 6, seed=4, dtype=torch.float32)
    with pytest.raises(ValueError):
        kmedoids_pooled(x, 0, weights=w)
    with pytest.raises(ValueError):
        kmedoids_pooled(x, 5, weights=w[:, :10])
    # A NaN stays in its example: the other's plan and means are its own, the bad one's NaN.
    nan = x.clone()
    nan[0, 3, 0] = float("nan")
    plan, pooled = kmedoids_pooled(nan, 5, weights=w)
    clean_plan, clean = kmedoids_pooled(x, 5, weights=w)
    assert torch.equal(plan.assign[1], clean_plan.assign[1]) and torch.equal(pooled[1], clean[1])
    assert torch.isnan(pooled[0]).all()


@pytest.mark.parametrize("weighted", [True, False])
def test_compiled_one_opaque_call_equals_eager(weighted: bool) -> None:
    """Compiled for the CPU (many tokens), the plan and the means are one opaque op in a
    whole graph, with the eager values."""
    x, w = clustered(4, 197, 32, seed=5, dtype=torch.float32)
    weights = w if weighted else None

    def pool(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        plan, pooled = kmedoids_pooled(x, 98, weights=weights)
        return plan.assign, pooled

    graphs: list[str] = []

    def recording(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm.code)
        return gm.forward

    eager = pool(x)
    compiled = torch.compile(pool, fullgraph=True, backend=recording)(x)
    torch._dynamo.reset()
    assert len(graphs) == 1 and "leanformer.kmedoids_pooled" in graphs[0]
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


def test_the_pooled_op_declares_what_it_returns() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 40, 8, generator=g), torch.rand(2, 40, generator=g) + 0.1
    init = torch.stack([torch.randperm(40, generator=g)[:5] for _ in range(2)]).int()
    for iters in (0, 3):
        torch.library.opcheck(torch.ops.leanformer.kmedoids_pooled, (x, 5, w, init, iters))
        torch.library.opcheck(torch.ops.leanformer.kmedoids_pooled, (x, 5, None, None, iters))
