"""``inputmerge`` and ``entrymerge``: ToMe's bipartite merging placed before an attention.

``inputmerge`` merges at each block's input, before its attention; ``entrymerge`` merges
the embedded patches once before the first block (on that block's budget, when the
budget is tight), then after each block's attention as ``merge`` does. The patched
model is compared with the same computation written out by hand: the timm blocks' own
weights, attention as an explicit softmax with the ``log(size)`` key bias, and the
merges where each method places them.
Also: identity at keep-all, batched == per-example, gradients against the reference,
torch.compile, and the errors for places a method cannot reduce.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import timm
import torch
from torch import Tensor, nn

import leanformer
from leanformer.models.registry import create_model
from leanformer.ops.cluster_plan import weighted_segment_mean
from leanformer.ops.merging import bipartite_merge_plan
from leanformer.patch.api import apply_reducers
from leanformer.pooling.budgets import Budget, budget_to_count
from leanformer.pooling.methods.conv import ConvDownsample
from leanformer.pooling.reducer import compose_assignments
from leanformer.pooling.registry import build_reducers

KEEP = 0.6
# method -> the place it reduces at
PLACES = {"inputmerge": "input", "entrymerge": "entry"}
METHODS = list(PLACES)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = create_model("deit_test", depth=3, img_size=32).double().eval()
    with torch.no_grad():  # peaked weights, so a misplaced merge changes the output clearly
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def _attention(block: nn.Module, x: Tensor, sizes: Tensor) -> Tensor:
    attn = block.attn
    B, N, C = x.shape
    h = attn.num_heads
    q, k, v = attn.qkv(x).reshape(B, N, 3, h, C // h).permute(2, 0, 3, 1, 4)
    logits = (q @ k.transpose(-2, -1)) / math.sqrt(C // h) + sizes.log()[:, None, None, :]
    out = logits.softmax(dim=-1) @ v
    return attn.proj(out.transpose(1, 2).reshape(B, N, C))


def _merged(x: Tensor, sizes: Tensor, budget: Budget) -> tuple[Tensor, Tensor]:
    """Bipartite merging of every token but the class token down to the budget's count."""
    patches, patch_sizes = x[:, 1:], sizes[:, 1:]
    k = budget_to_count(budget, patches.shape[1])
    assign = bipartite_merge_plan(patches, k, sizes=patch_sizes)
    patches, patch_sizes = weighted_segment_mean(patches, patch_sizes, assign, k)
    return torch.cat([x[:, :1], patches], dim=1), torch.cat([sizes[:, :1], patch_sizes], dim=1)


def _reference(model: nn.Module, images: Tensor, method: str, keep: float | Sequence[Budget]) -> Tensor:
    """The model's logits with ``method``'s merges written out, sizes carried:
    ``inputmerge`` merges before every block's attention; ``entrymerge`` before the first
    block (on its budget) and then after every block's attention."""
    budgets = [keep] * len(model.blocks) if isinstance(keep, float) else list(keep)
    x = model.norm_pre(model._pos_embed(model.patch_embed(images)))
    sizes = x.new_ones(x.shape[:2])
    if method == "entrymerge":
        x, sizes = _merged(x, sizes, _entry_count(x.shape[1] - 1, budgets))
    for block, budget in zip(model.blocks, budgets, strict=True):
        if method == "inputmerge":
            x, sizes = _merged(x, sizes, budget)
        x = x + _attention(block, block.norm1(x), sizes)
        if method == "entrymerge":
            x, sizes = _merged(x, sizes, budget)
        x = x + block.mlp(block.norm2(x))
    return model.forward_head(model.norm(x))


def _entry_count(n: int, budgets: Sequence[Budget]) -> int:
    """entrymerge's step before the first block: the first block's count when the blocks'
    budgets alone leave at most 38% of the ``n`` patches after the last block, none (all
    ``n`` kept) from 46%, and linearly from one to the other in between."""
    counts = [n]
    for budget in budgets:
        counts.append(budget_to_count(budget, counts[-1]))
    left, first = counts[-1] / n, counts[1]
    if left <= 0.38:
        return first
    if left >= 0.46:
        return n
    return math.floor(first + (left - 0.38) / (0.46 - 0.38) * (n - first) + 0.5)


def _images(batch: int = 3) -> Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


# 64 patches at a keep ratio of 0.6. inputmerge: 38 reach the first attention, then 23
# and 14 (a ToMe-style merge would run the first attention on all 64). entrymerge: 38
# reach the first attention, then 23, 14 and 8 after the three attentions. With token
# counts, entrymerge's first block meets its count before its attention and merges
# nothing after it. At 0.75 the blocks alone leave 27 of 64 (42%): the entry step keeps
# 56, between 48 (the first block's count) and 64; then 42, 32 and 24.
@pytest.mark.parametrize(
    ("method", "keep", "tokens_out"),
    [
        ("inputmerge", KEEP, 14),
        ("entrymerge", KEEP, 8),
        ("entrymerge", 0.75, 24),
        ("inputmerge", [40, 30, 12], 12),
        ("entrymerge", [40, 30, 12], 12),
    ],
)
def test_matches_the_merges_written_out_by_hand(
    method: str, keep: float | list[int], tokens_out: int
) -> None:
    model = _model()
    images = _images()
    with torch.no_grad():
        expected = _reference(model, images, method, keep)
        plain = model(images)
        leanformer.apply_token_pooling(model, keep=keep, method=method, carry=True)
        got = model(images)
    assert model.token_pooling.reduce_at == PLACES[method]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    assert (got - plain).abs().max() > 1e-3  # the merges really changed the result
    assert model.token_pooling.sizes.shape == (3, 1 + tokens_out)


def test_entry_count_by_hand() -> None:
    # 64 patches; the blocks leave 27 (0.75 per block, three blocks): 42% of them.
    assert _entry_count(64, [0.75] * 3) == 56
    assert _entry_count(64, [0.6] * 3) == 38  # 14 left (22%): the first block's count
    assert _entry_count(64, [0.9] * 3) == 64  # 47 left (73%): no entry step


def test_a_loose_budget_is_merge_exactly() -> None:
    """Where the blocks alone leave 46% of the patches or more, entrymerge is merge, to the bit."""
    images = _images()
    with torch.no_grad():
        merged = leanformer.apply_token_pooling(_model(), keep=0.9, method="merge", carry=True)(images)
        model = leanformer.apply_token_pooling(_model(), keep=0.9, method="entrymerge", carry=True)
        entry = model(images)
        plain = _model()(images)
    assert torch.equal(entry, merged)
    assert (entry - plain).abs().max() > 1e-3
    assert model.token_pooling.sizes.shape == (3, 1 + 47)  # 64 -> 58 -> 52 -> 47


def test_entry_needs_reducers_with_a_known_count() -> None:
    class Halve(nn.Module):
        needs_received = False

        def forward(self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None):
            return tokens[:, ::2], None if sizes is None else sizes[:, ::2]

    with pytest.raises(ValueError, match=r"reduce_at='entry' .* output_count\(n\) and a count= argument"):
        apply_reducers(_model(), [Halve(), None, None], reduce_at="entry")

    class HalveWithCount(Halve):
        def output_count(self, n: int) -> int:
            return (n + 1) // 2

    # output_count alone passes a runtime Protocol check; the missing count= is caught at
    # install, not at the first budget tight enough to run the entry step.
    with pytest.raises(ValueError, match=r"count= argument .* reducers of blocks \[0, 2\] lack"):
        apply_reducers(_model(), [HalveWithCount(), None, HalveWithCount()], reduce_at="entry")

    class Counted(HalveWithCount):
        def forward(self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None, count=None):
            k = self.output_count(tokens.shape[1]) if count is None else count
            return tokens[:, :k], None if sizes is None else sizes[:, :k]

    model = apply_reducers(_model(), [Counted()] * 3, reduce_at="entry")
    with torch.no_grad():
        model(_images())  # 64 -> 32 before the first block (8 left: 12%), then 16, 8, 4
    assert model.token_pooling.entry_count(64) == 32

    class NoFlag(nn.Module):  # count= and output_count, but no needs_received: not a reducer
        def forward(self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None, count=None):
            return tokens, sizes

        def output_count(self, n: int) -> int:
            return n

    with pytest.raises(TypeError, match=r"reducer for block 1 \(NoFlag\) is not a TokenReducer"):
        apply_reducers(_model(), [None, NoFlag(), None], reduce_at="entry")


def test_each_placement_differs_from_merge_and_from_the_other() -> None:
    images = _images()
    with torch.no_grad():
        outputs = [
            leanformer.apply_token_pooling(_model(), keep=KEEP, method=m, carry=True)(images)
            for m in ("merge", *METHODS)
        ]
    for i in range(len(outputs)):
        for j in range(i):
            assert (outputs[i] - outputs[j]).abs().max() > 1e-3


@pytest.mark.parametrize("method", METHODS)
def test_gradients_match_the_reference(method: str) -> None:
    model = _model()
    images = _images().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(_reference(model, images, method, KEEP).square().sum(), images)
    leanformer.apply_token_pooling(model, keep=KEEP, method=method, carry=True)
    (g,) = torch.autograd.grad(model(images).square().sum(), images)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-9)
    assert g.abs().max() > 0


@pytest.mark.parametrize("method", METHODS)
def test_keep_all_is_the_plain_model_and_batched_equals_per_example(method: str) -> None:
    images = _images(4)
    model = _model()
    with torch.no_grad():
        plain = model(images)
        leanformer.apply_token_pooling(model, keep=1.0, method=method, carry=True)
        torch.testing.assert_close(model(images), plain, rtol=0, atol=1e-12)
        model.token_pooling.keep = KEEP
        batched = model(images)
        single = torch.cat([model(images[i : i + 1]) for i in range(len(images))])
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-10)


def _first_block_plan(model: nn.Module, images: Tensor, method: str) -> Tensor:
    """``[B, 64]``: the token of the first block's output that each patch went into, by hand."""
    x = model.norm_pre(model._pos_embed(model.patch_embed(images)))
    sizes = x.new_ones(x.shape[:2])
    patches = x[:, 1:]
    first = bipartite_merge_plan(patches, budget_to_count(KEEP, patches.shape[1]))
    if method == "inputmerge":
        return first
    x, sizes = _merged(x, sizes, KEEP)
    x = x + _attention(model.blocks[0], model.blocks[0].norm1(x), sizes)
    second = bipartite_merge_plan(x[:, 1:], budget_to_count(KEEP, x.shape[1] - 1), sizes=sizes[:, 1:])
    return torch.stack([second[b, first[b]] for b in range(len(first))])  # slow and plain


@pytest.mark.parametrize("method", METHODS)
def test_the_first_blocks_record_maps_every_patch_to_its_output_token(method: str) -> None:
    model = _model()
    images = _images()
    with torch.no_grad():
        expected = _first_block_plan(model, images, method)
        leanformer.apply_token_pooling(model, keep=KEEP, method=method, carry=True)
        reducer = model.token_pooling.reducer(0)
        reducer.record = True
        model(images)
    assert reducer.last_assign.shape == (3, 64)
    torch.testing.assert_close(reducer.last_assign, expected, rtol=0, atol=0)
    # entrymerge: 64 patches -> 38 before the attention -> 23 after it
    assert int(reducer.last_assign.max()) == (37 if method == "inputmerge" else 22)


def test_places_a_method_cannot_reduce_at_are_refused() -> None:
    with pytest.raises(ValueError, match=r"inputmerge.*reduces at each block's input.*reduce_at='mlp'"):
        leanformer.apply_token_pooling(_model(), keep=0.5, method="inputmerge", reduce_at="mlp")
    entry_words = (
        "reduces after each block's attention and, when the budget is tight, once before the first block"
    )
    with pytest.raises(ValueError, match=rf"entrymerge.*{entry_words}.*reduce_at='input'"):
        leanformer.apply_token_pooling(_model(), keep=0.5, method="entrymerge", reduce_at="input")
    with pytest.raises(ValueError, match="reduce_at must be one of attn, mlp, input, entry"):
        leanformer.apply_token_pooling(_model(), keep=0.5, method="merge", reduce_at="before")  # type: ignore[arg-type]
    reducers = build_reducers(
        method="wkmedoids", keep=0.5, depth=3, num_tokens=64, dim=32, grid_size=(8, 8), carry=True
    )
    for place in ("input", "entry"):
        with pytest.raises(ValueError, match=f"reduce_at='{place}'.*no attention scores exist yet"):
            apply_reducers(_model(), reducers, reduce_at=place)  # type: ignore[arg-type]
    # the same places, asked for explicitly, are accepted
    for method, place in PLACES.items():
        leanformer.apply_token_pooling(_model(), keep=0.5, method=method, reduce_at=place)  # type: ignore[arg-type]


@pytest.mark.slow
# entrymerge at 0.75: a partial step before the first block (56 of 64 patches kept).
@pytest.mark.parametrize(("method", "keep"), [*((m, KEEP) for m in METHODS), ("entrymerge", 0.75)])
def test_compiles_fullgraph_and_matches_eager_through_the_timm_patch(method: str, keep: float) -> None:
    torch.manual_seed(0)
    tiny = {"depth": 3, "img_size": 64, "patch_size": 8, "embed_dim": 48, "num_classes": 5}
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **tiny).eval()
    leanformer.apply_token_pooling(model, keep=keep, method=method, carry=True)
    x = torch.randn(3, 3, 64, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)


def test_conv_refuses_an_entry_step_it_cannot_size() -> None:
    """A 2x2 conv keeps one count per grid. Where the entry step asks for that count it runs;
    where it asks for another (its fade) the error says so, instead of keeping conv's own."""
    torch.manual_seed(0)
    tight = create_model("deit_test", depth=3, img_size=32).eval()  # 8x8 -> 16 left: full step
    conv = ConvDownsample(dim=32, grid_size=(8, 8), carry=True)
    apply_reducers(tight, [conv, None, None], reduce_at="entry")
    with torch.no_grad():
        tight(torch.randn(2, 3, 32, 32))
    assert tight.token_pooling.sizes.shape == (2, 1 + 4)  # 64 -> 16 -> 4

    fading = create_model("deit_test", depth=3, img_size=12).eval()  # 3x3 -> 4 left (44%): 8 asked
    apply_reducers(fading, [ConvDownsample(dim=32, grid_size=(3, 3)), None, None], reduce_at="entry")
    with pytest.raises(ValueError, match=r"conv downsampling keeps 4 of 9 tokens .* cannot keep 8"):
        fading(torch.randn(2, 3, 12, 12))
    with pytest.raises(ValueError, match=r"keeps 16 of 64 tokens .* cannot keep 40"):
        conv(torch.randn(2, 64, 32), None, None, count=40)


def test_composed_records_against_a_loop() -> None:
    first = torch.tensor([[0, 2, -1, 1, 2], [1, 1, 0, -1, -1]])
    second = torch.tensor([[1, -1, 0], [0, 0, -1]])
    expected = [[-1 if f < 0 else int(second[b, f]) for f in row] for b, row in enumerate(first.tolist())]
    assert compose_assignments(first, second).tolist() == expected
    # the first step kept nothing, so the second has nothing to map
    none_kept = torch.full((2, 5), -1)
    assert compose_assignments(none_kept, second[:, :0]).tolist() == none_kept.tolist()


def test_the_record_of_an_entry_step_that_keeps_nothing_drops_every_patch() -> None:
    records = {}
    for method in ("merge", "entrymerge"):
        model = leanformer.apply_token_pooling(_model(), keep=[0, 5, 5], method=method, carry=True)
        model.token_pooling.reducer(0).record = True
        with torch.no_grad():
            model(_images())
        records[method] = model.token_pooling.reducer(0).last_assign
    assert records["entrymerge"].tolist() == records["merge"].tolist() == torch.full((3, 64), -1).tolist()
