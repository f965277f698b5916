"""Every token reducer compiles with ``torch.compile(fullgraph=True)`` in eval mode and gives
the eager result, in our DeiT and through the timm patch.

``fullgraph=True`` fails on any host synchronisation (``.item()``, a Python branch on a
tensor value, a value-dependent shape) and on objects created mid-forward (a
``torch.Generator``), so compiling is the check that a forward is ready for accelerators.
Outputs are compared too: a compiled model that runs can still be wrong (inductor once
read the wrong rows through ``as_strided``, see ``benchmarks/repro_inductor_as_strided.py``,
and once returned NaN for ``merge`` through the timm patch).

One model holds every method, one per block (conv first: it needs the token grid), so
one capture covers them all. That model is compiled with the ``aot_eager`` backend: the
same full-graph capture and functionalised graph as inductor, without generating code.
Inductor itself, which compiles a C++ kernel per fused operation (minutes on an empty
cache for all ten methods), runs on one method of each family through the timm patch.
Weights are drawn at std 0.3: attention is peaked, so top-K choices and cluster
assignments have no near-ties that rounding could flip.
"""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

from leanformer.models.registry import create_model
from leanformer.patch.api import apply_reducers, apply_token_pooling
from leanformer.pooling.registry import build_reducers, list_methods
from tiny_vit import tiny_vit

CLUSTERING = ("kmeans", "kmedoids", "wkmeans", "wkmedoids")
# conv halves the 8x8 grid to 4x4; every other method then removes one or two tokens.
SCHEDULE = (
    "conv",
    "kmeans",
    "kmedoids",
    "wkmeans",
    "wkmedoids",
    "powerbert",
    "random",
    "importance",
    "merge",
    "stepmerge",
)


def _reducers(
    methods: tuple[str, ...], num_tokens: int, dim: int, grid: tuple[int, int]
) -> list[nn.Module | None]:
    reducers: list[nn.Module | None] = []
    n = num_tokens
    for method in methods:
        keep = n // 4 if method == "conv" else n - (2 if method in CLUSTERING else 1)
        options = {"max_iters": 2} if method in CLUSTERING else {}
        (reducer,) = build_reducers(
            method=method, keep=[keep], depth=1, num_tokens=n, dim=dim, grid_size=grid, carry=True, **options
        )
        assert reducer is not None
        reducers.append(reducer)
        n = keep
    return [*reducers, None]  # a last block attends with the carried sizes


def _peaked(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def _compare(model: nn.Module, x: torch.Tensor, backend: str = "inductor") -> None:
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend=backend)(x)
    assert torch.isfinite(eager).all()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)


@pytest.fixture(params=["traced", "opaque"])
def cpu_plans(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a CPU graph holds the clusterings and the attention scores: traced (these
    small inputs, by default) or as opaque calls into the eager code (large inputs; here
    forced by thresholds of 1)."""
    if request.param == "opaque":
        from leanformer.ops import cluster_regimes, received

        monkeypatch.setattr(cluster_regimes, "OPAQUE_FROM_TOKENS", 1)
        monkeypatch.setattr(received, "_OPAQUE_FROM_LOGITS", 1)
    return str(request.param)


def test_schedule_covers_every_method() -> None:
    # inputmerge's and entrymerge's reducers are merge's, placed before an attention:
    # tests/test_merge_positions.py compiles those placements.
    # tome compiles in test_twenty_patched_models_compile_in_one_process_and_a_new_budget_recompiles_once.
    assert set(SCHEDULE) == set(list_methods()) - {"none", "inputmerge", "entrymerge", "tome"}


@pytest.mark.slow
def test_every_method_compiles_fullgraph_and_matches_eager_in_our_deit(cpu_plans: str) -> None:
    model = create_model("deit_test", depth=len(SCHEDULE) + 1, img_size=32)
    apply_reducers(model, _reducers(SCHEDULE, 64, 32, (8, 8)))
    _compare(_peaked(model), torch.randn(3, 3, 32, 32), backend="aot_eager")


@pytest.mark.slow
def test_reducers_compile_fullgraph_and_match_eager_through_the_timm_patch(cpu_plans: str) -> None:
    """Inductor's code on the host's own block forward around our reducers: merge (which
    once returned NaN compiled here), a clustering and a selection method."""
    methods = ("merge", "wkmedoids", "powerbert")
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        depth=len(methods) + 1,
        img_size=64,
        patch_size=8,
        embed_dim=48,
        num_heads=3,
        num_classes=5,
    )
    apply_reducers(model, _reducers(methods, 64, 48, (8, 8)))
    _compare(_peaked(model), torch.randn(3, 3, 64, 64))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["kmeans", "wkmedoids"])
def test_dynamic_shapes_compile_fullgraph_and_a_new_budget_recompiles(method: str, cpu_plans: str) -> None:
    """``dynamic=True`` (batch and image sizes symbolic): the keep ratio was read as a
    symbolic float, whose token count could not enter the clusterings' loops. A budget
    changed on a reducer afterwards must recompile, not reuse the old count."""
    # Two iterations: the loops see the symbolic count as five would, in less tracing.
    model = apply_token_pooling(_peaked(tiny_vit()), keep=0.5, method=method, max_iters=2)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        # Two shapes, then a new budget: each compiles its own graph here (the clusterings'
        # counts specialise the sizes), so a third shape would only add time.
        for batch, size in ((2, (16, 16)), (3, (8, 32))):
            x = torch.randn(batch, 3, *size)
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-5)
        model.token_pooling.reducer(1).keep = 0.25
        x = torch.randn(2, 3, 16, 16)
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-5)
        assert model.token_pooling.sizes.shape[1] == 1 + 1  # 16 -> 8 -> 2 -> 1


@pytest.mark.slow
@pytest.mark.parametrize("num_queries", [None, 3])
def test_perceiver_with_a_fixed_query_count_compiles_fullgraph(num_queries: int | None) -> None:
    """Every query, or the first ``num_queries`` (query masking), is a static shape: one graph."""
    model = _peaked(create_model("visual_perceiver_test"))
    torch._dynamo.reset()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        eager = model(x, num_queries=num_queries)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x, num_queries=num_queries)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_dynamic_query_selection_cannot_be_one_graph_but_compiles_with_breaks() -> None:
    """DQS keeps a number of queries per input that depends on the input: no full graph
    exists by design, and torch.compile without fullgraph still gives the eager result."""
    model = _peaked(create_model("visual_perceiver_test"))
    torch._dynamo.reset()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        eager = model(x, dqs_threshold=0.5)
        with pytest.raises(Exception, match="data-dependent"):
            torch.compile(model, fullgraph=True, backend="aot_eager")(x, dqs_threshold=0.5)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")(x, dqs_threshold=0.5)
    assert model.last_kept_counts is not None and int(model.last_kept_counts.min()) < 8  # some dropped
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)


@pytest.mark.slow
# Dynamo's default limit, whatever another test of this process raised it to.
@torch._dynamo.config.patch(recompile_limit=8)
def test_twenty_patched_models_compile_in_one_process_and_a_new_budget_recompiles_once() -> None:
    """Patched models of one host class share its forward code; torch.compile allows 8
    graphs per code object (``recompile_limit``), so a ninth (method, budget) once failed
    with ``fullgraph=True``. Each patched model now compiles on its own, and changing its
    budget at run time compiles it once more, not on every call."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    x = torch.randn(2, 3, 16, 16)
    compiled = []
    # Methods whose graphs are quick to capture (the clusterings' loops are slow to trace,
    # and the tests above compile them): the recompile budget is the same for every method.
    for method in ("tome", "merge", "stepmerge", "powerbert"):
        for keep in (0.9, 0.8, 0.7, 0.6, 0.5):
            model = apply_token_pooling(_peaked(tiny_vit()), keep=keep, method=method)
            compiled.append((model, torch.compile(model, fullgraph=True, backend=counter)))
    assert torch._dynamo.config.recompile_limit == 8  # the default, not raised to let this pass
    with torch.no_grad():
        for model, fast in compiled:
            torch.testing.assert_close(fast(x), model(x), rtol=0, atol=1e-4)
        # One graph per model. (stepmerge's round fraction, a float on its reducers, once
        # became a symbolic value after merge's models had another one, and restarted the
        # trace: a 21st graph. Rounds are now sized with ints, which stay constants.)
        first_pass = counter.frame_count
        assert first_pass == 20
        for _, fast in compiled:  # every graph is reused
            fast(x)
        assert counter.frame_count == first_pass
        model, fast = compiled[0]
        model.token_pooling.keep = 0.5
        for _ in range(3):
            torch.testing.assert_close(fast(x), model(x), rtol=0, atol=1e-4)
        assert counter.frame_count == first_pass + 1
