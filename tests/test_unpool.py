"""Dense outputs: ``unpool=True`` puts every reducer's output back on the full token grid.

Checked against a slow reference built independently of the code under test: each
reducer's own record of where its input tokens went (captured block by block with forward
hooks), the blocks composed by walking each token through them one by one, and a dropped
patch's nearest output token on the patch grid found by a Python loop over positions.
The reduced output of the same model gathered by that map is what the unpooled output
must be. Also: a budget that keeps every token gives exactly the unpatched host (timm and
Hugging Face), gradients reach the patch embedding, ``fullgraph`` compiles match eager,
the runtime switch and ``token_pooling.unpool(x)`` for a user's own head, and bad inputs.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import leanformer
from leanformer.models.registry import create_model
from leanformer.pooling.registry import list_methods
from leanformer.pooling.state import TokenPooling
from test_hosts import HOSTS, run

METHODS = [m for m in list_methods() if m != "none"]
PREFIX = 1  # deit_test's class token
PATCHES = 16  # deit_test: 16x16 images, patch 4


def _images(batch: int = 3) -> Tensor:
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(3))


def _budget(method: str) -> dict[str, Any]:
    # A tight budget, so the entry step of entrymerge runs and selections drop tokens.
    if method == "tome":
        return {"keep": {"r": 3}}
    return {"keep": [8, 4, 4] if method == "conv" else 0.6}


def _model(method: str, **kw: Any) -> nn.Module:
    torch.manual_seed(0)
    model = create_model("deit_test", pool=method, **_budget(method), **kw)
    with torch.no_grad():  # peaked attention: no near-ties for top-K or assignments to flip on
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


class _Calls:
    """Every reducer call of one forward, in order: (whether it takes the prefix tokens, its
    input tokens, its output tokens, its own record of where each input went, read as the
    call returns: entrymerge's first reducer runs twice and keeps one record over both)."""

    def __init__(self, pooling: TokenPooling) -> None:
        self.calls: list[tuple[bool, Tensor, Tensor, Tensor]] = []
        self.handles = [r.register_forward_hook(self._hook) for r in pooling.reducers.values()]

    def _hook(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        record = module.last_assign.clone()  # type: ignore[union-attr]
        sees_prefix = bool(getattr(module, "sees_prefix", False))
        self.calls.append((sees_prefix, args[0].detach().clone(), out[0].detach().clone(), record))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _slow_fill_on(assign: list[int], prefix: int, rows: int, cols: int) -> list[int]:
    """Each dropped patch (-1) given the output token whose patches' centre is nearest on
    the ``rows x cols`` grid (ties: the lower output index), one position at a time."""
    centres: dict[int, list[tuple[int, int]]] = {}
    for p in range(prefix, len(assign)):
        if assign[p] >= 0:
            centres.setdefault(assign[p], []).append(divmod(p - prefix, cols))
    out = list(assign)
    for p in range(prefix, len(assign)):
        if assign[p] < 0 and centres:
            r, c = divmod(p - prefix, cols)
            distances = {
                j: (r - sum(q[0] for q in v) / len(v)) ** 2 + (c - sum(q[1] for q in v) / len(v)) ** 2
                for j, v in centres.items()
            }
            out[p] = min(sorted(distances), key=lambda j: distances[j])
    return out


def _slow_map(calls: list[tuple[bool, Tensor, Tensor, Tensor]], batch: int) -> list[list[int]]:
    """Where each of the first block's tokens (prefix first) ended, token by token; a
    dropped patch shows the output token nearest to it on the 4x4 patch grid."""
    mapping = [list(range(PREFIX + PATCHES)) for _ in range(batch)]
    for sees_prefix, tokens, _, record in calls:
        for b in range(batch):
            step = [] if sees_prefix else list(range(PREFIX))
            for i in range(tokens.shape[1]):
                j = int(record[b, i])
                step.append(-1 if j < 0 else j + (0 if sees_prefix else PREFIX))
            mapping[b] = [-1 if t < 0 else step[t] for t in mapping[b]]
    side = math.isqrt(PATCHES)
    return [_slow_fill_on(m, PREFIX, side, side) for m in mapping]


@pytest.mark.parametrize("method", METHODS)
def test_unpooled_output_is_the_reduced_output_gathered_by_a_slow_map(method: str) -> None:
    x = _images()
    model = _model(method)
    pooling: TokenPooling = model.token_pooling  # type: ignore[assignment]
    pooling.trace_source = True
    calls = _Calls(pooling)
    with torch.no_grad():
        reduced = model.forward_features(x)
    calls.remove()
    assert reduced.shape[1] < PREFIX + PATCHES  # the budget really reduced
    mapping = _slow_map(calls.calls, x.shape[0])
    expected = torch.stack([reduced[b, mapping[b]] for b in range(x.shape[0])])

    pooling.trace_source = False
    pooling.unpool_output = True
    with torch.no_grad():
        dense = model.forward_features(x)
    assert dense.shape == (x.shape[0], PREFIX + PATCHES, reduced.shape[-1])
    torch.testing.assert_close(dense, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_unpool_of_a_traced_forward_equals_the_unpooled_forward(method: str) -> None:
    """``token_pooling.unpool(x)`` on what a traced forward left (a user's own head) gives
    what ``unpool=True`` gives; the head sees the same logits for the class token."""
    x = _images()
    dense_model = _model(method, unpool=True)
    with torch.no_grad():
        dense = dense_model.forward_features(x)
        dense_logits = dense_model(x)
    model = _model(method)
    model.token_pooling.trace_source = True  # type: ignore[union-attr]
    with torch.no_grad():
        reduced = model.forward_features(x)
        mine = model.token_pooling.unpool(reduced)  # type: ignore[operator]
    torch.testing.assert_close(mine, dense, rtol=0, atol=1e-6)
    if method != "conv":  # conv's weights are drawn per model: same seed, but checked above
        torch.testing.assert_close(dense_logits, model(x), rtol=1e-5, atol=1e-5)


def test_positions_mapped_to_one_token_show_the_same_features() -> None:
    x = _images(2)
    model = _model("powerbert", unpool=True)
    with torch.no_grad():
        dense = model.forward_features(x)
    pooling: TokenPooling = model.token_pooling  # type: ignore[assignment]
    assign = pooling.assignment(fill=False)
    filled = pooling.assignment(fill=True)
    assert assign is not None and filled is not None
    assert (assign < 0).any() and (filled >= 0).all()
    # Each position shows the output token it maps to; positions mapped to one token agree.
    for b in range(2):
        for i in range(PREFIX + PATCHES):
            for j in range(PREFIX + PATCHES):
                if filled[b, i] == filled[b, j]:
                    assert torch.equal(dense[b, i], dense[b, j])


@pytest.mark.parametrize("host", ["timm_cls", "timm_avg_no_cls", "timm_registers", "hf_vit", "hf_dinov2"])
def test_a_budget_that_keeps_every_token_gives_the_host_exactly(host: str) -> None:
    build, prefix = HOSTS[host]
    model = build()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = run(model, images)
        leanformer.apply_token_pooling(model, keep=1.0, method="merge", unpool=True)
        same = run(model, images)
        model.token_pooling.keep = 0.5
        dense = run(model, images)
    for a, b in zip(same, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert dense[1].shape == ref[1].shape == (2, prefix + 16, ref[1].shape[-1])
    assert (dense[1] - ref[1]).abs().max() > 1e-4  # the reduction really ran


@pytest.mark.parametrize("method", ["powerbert", "wkmedoids", "tome", "conv"])
def test_gradients_reach_the_patch_embedding_through_the_unpooled_output(method: str) -> None:
    model = _model(method, unpool=True).train()
    dense = model.forward_features(_images(2))
    (dense[:, PREFIX:] ** 2).mean().backward()
    grad = model.patch_embed.proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "method", ["powerbert", "tome"]
)  # a dropped-token fill; a merge that sees the prefix
def test_unpooled_model_compiles_fullgraph_and_matches_eager(method: str) -> None:
    model = _model(method, unpool=True)
    x = _images(2)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model.forward_features(x)
        compiled = torch.compile(model.forward_features, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)


def test_the_runtime_switch_and_an_empty_batch() -> None:
    model = _model("merge")
    pooling: TokenPooling = model.token_pooling  # type: ignore[assignment]
    x = _images(2)
    with torch.no_grad():
        assert model.forward_features(x).shape[1] < PREFIX + PATCHES
        pooling.unpool_output = True
        assert model.forward_features(x).shape[1] == PREFIX + PATCHES
        host = create_model("deit_test").eval()
        assert model.forward_features(x[:0]).shape == host.forward_features(x[:0]).shape
        pooling.keep = 0.3  # rebuilt reducers keep recording
        assert model.forward_features(x).shape[1] == PREFIX + PATCHES
        pooling.unpool_output = False
        assert model.forward_features(x).shape[1] < PREFIX + PATCHES


def test_bad_inputs_raise_clear_errors() -> None:
    model = _model("merge")
    pooling: TokenPooling = model.token_pooling  # type: ignore[assignment]
    x = _images(2)
    with torch.no_grad():
        reduced = model.forward_features(x)
    with pytest.raises(ValueError, match="trace_source = True"):
        pooling.unpool(reduced)
    pooling.trace_source = True
    with torch.no_grad():
        reduced = model.forward_features(x)
    with pytest.raises(ValueError, match="last block left"):
        pooling.unpool(reduced[:, :-1])
    with pytest.raises(ValueError, match="batch of 1"):
        pooling.unpool(reduced[:1])
    with pytest.raises(ValueError, match="unpool must be True or False"):
        pooling.unpool_output = "yes"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="unpool must be true or false"):
        create_model("deit_test", pool="merge", keep=0.5, unpool=1)
    with pytest.raises(ValueError, match="need a pooling method"):
        create_model("deit_test", unpool=True)


@pytest.mark.parametrize(("rows", "cols", "grid_known"), [(3, 5, True), (4, 4, True), (1, 7, False)])
def test_the_fill_of_dropped_patches_equals_a_slow_search(rows: int, cols: int, grid_known: bool) -> None:
    """Random maps: merged patches (a token's centre is its patches' mean), dropped ones,
    a row whose every patch was dropped (stays -1), and no grid (sequence order)."""
    from leanformer.pooling.dropped_fill import fill_from_nearest_position

    g = torch.Generator().manual_seed(rows * cols)
    prefix, outputs, n = 1, 5, rows * cols
    patches = torch.randint(-1, outputs - prefix, (6, n), generator=g)
    patches = torch.where(patches >= 0, patches + prefix, patches)  # into the non-prefix outputs
    patches[0] = -1
    assign = torch.cat([torch.zeros(6, prefix, dtype=torch.long), patches], dim=1)
    got = fill_from_nearest_position(
        assign, num_prefix=prefix, outputs=outputs, grid=(rows, cols) if grid_known else None
    )
    side = cols if grid_known else n
    expected = [_slow_fill_on(row, prefix, n // side if grid_known else 1, side) for row in assign.tolist()]
    assert got.tolist() == expected
    assert (got[0, prefix:] == -1).all() and (got[1:] >= 0).all()
