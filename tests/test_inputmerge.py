"""``inputmerge``: ToMe's bipartite merging at each block's input, before its attention.

The patched model is compared with the same computation written out by hand: the
timm blocks' own weights, attention as an explicit softmax with the ``log(size)`` key
bias, and the merge before every block (the first block's too). Also: identity at
keep-all, batched == per-example, gradients against the reference, torch.compile, and
the errors for places a method cannot reduce.
"""

from __future__ import annotations

import math

import pytest
import timm
import torch
from torch import Tensor, nn

import leanformer
from leanformer.layers.budgets import budget_to_count
from leanformer.layers.token_pooling import build_reducers
from leanformer.models.registry import create_model
from leanformer.ops.clustering import weighted_segment_mean
from leanformer.ops.merging import bipartite_merge_plan
from leanformer.patch.timm import apply_reducers

KEEP = 0.6


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


def _reference(model: nn.Module, images: Tensor, keep: float) -> Tensor:
    """The model's logits with every block merging its input tokens (never the class
    token) down to ``round(keep * n)`` by bipartite matching, sizes carried."""
    x = model.norm_pre(model._pos_embed(model.patch_embed(images)))
    sizes = x.new_ones(x.shape[:2])
    for block in model.blocks:
        patches, patch_sizes = x[:, 1:], sizes[:, 1:]
        k = budget_to_count(keep, patches.shape[1])
        assign = bipartite_merge_plan(patches, k, sizes=patch_sizes)
        patches, patch_sizes = weighted_segment_mean(patches, patch_sizes, assign, k)
        x = torch.cat([x[:, :1], patches], dim=1)
        sizes = torch.cat([sizes[:, :1], patch_sizes], dim=1)
        x = x + _attention(block, block.norm1(x), sizes)
        x = x + block.mlp(block.norm2(x))
    return model.forward_head(model.norm(x))


def _images(batch: int = 3) -> Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def test_matches_merging_before_every_attention_by_hand() -> None:
    model = _model()
    images = _images()
    with torch.no_grad():
        expected = _reference(model, images, KEEP)
        plain = model(images)
        leanformer.apply_token_pooling(model, keep=KEEP, method="inputmerge", carry=True)
        got = model(images)
    assert model.token_pooling.reduce_at == "input"
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    assert (got - plain).abs().max() > 1e-3  # the merges really changed the result
    # 64 patches: 38 reach the first attention, then 23 and 14 (a ToMe-style merge would
    # run the first attention on all 64)
    assert model.token_pooling.sizes.shape == (3, 1 + 14)


def test_differs_from_merge_between_attention_and_mlp() -> None:
    images = _images()
    with torch.no_grad():
        a = leanformer.apply_token_pooling(_model(), keep=KEEP, method="inputmerge", carry=True)(images)
        b = leanformer.apply_token_pooling(_model(), keep=KEEP, method="merge", carry=True)(images)
    assert (a - b).abs().max() > 1e-3


def test_gradients_match_the_reference() -> None:
    model = _model()
    images = _images().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(_reference(model, images, KEEP).square().sum(), images)
    leanformer.apply_token_pooling(model, keep=KEEP, method="inputmerge", carry=True)
    (g,) = torch.autograd.grad(model(images).square().sum(), images)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-9)
    assert g.abs().max() > 0


def test_keep_all_is_the_plain_model_and_batched_equals_per_example() -> None:
    images = _images(4)
    model = _model()
    with torch.no_grad():
        plain = model(images)
        leanformer.apply_token_pooling(model, keep=1.0, method="inputmerge", carry=True)
        torch.testing.assert_close(model(images), plain, rtol=0, atol=1e-12)
        model.token_pooling.keep = KEEP
        batched = model(images)
        single = torch.cat([model(images[i : i + 1]) for i in range(len(images))])
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-10)


def test_places_a_method_cannot_reduce_at_are_refused() -> None:
    with pytest.raises(ValueError, match=r"inputmerge.*reduces at each block's input.*reduce_at='mlp'"):
        leanformer.apply_token_pooling(_model(), keep=0.5, method="inputmerge", reduce_at="mlp")
    with pytest.raises(ValueError, match="reduce_at must be one of attn, mlp, input"):
        leanformer.apply_token_pooling(_model(), keep=0.5, method="merge", reduce_at="before")  # type: ignore[arg-type]
    reducers = build_reducers(
        method="wkmedoids", keep=0.5, depth=3, num_tokens=64, dim=32, grid_size=(8, 8), carry=True
    )
    with pytest.raises(ValueError, match="no attention scores exist yet"):
        apply_reducers(_model(), reducers, reduce_at="input")
    # the same place, asked for explicitly, is accepted
    leanformer.apply_token_pooling(_model(), keep=0.5, method="inputmerge", reduce_at="input")


@pytest.mark.slow
def test_compiles_fullgraph_and_matches_eager_through_the_timm_patch() -> None:
    torch.manual_seed(0)
    tiny = {"depth": 3, "img_size": 64, "patch_size": 8, "embed_dim": 48, "num_classes": 5}
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **tiny).eval()
    leanformer.apply_token_pooling(model, keep=KEEP, method="inputmerge", carry=True)
    x = torch.randn(3, 3, 64, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)
