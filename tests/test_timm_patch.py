"""The timm patch: identity at full budget, parity with a reference built on timm's own
attention forward, prefix (class / distillation / register) tokens, LayerScale, q/k norm,
reversibility and the refusals. Models are built with ``pretrained=False`` and shrunk."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leanformer.patch.api import (
    apply_reducers,
    apply_token_pooling,
    is_patched,
    remove_token_pooling,
)
from leanformer.pooling.reducer import reduce_tokens

SMALL = dict(pretrained=False, depth=3, img_size=32, patch_size=8, num_classes=7)  # 16 patch tokens


def _vit(name: str = "vit_tiny_patch16_224", **kw) -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(name, **{**SMALL, **kw}).eval()
    # Random LayerScale gammas and norm affines, so a skipped submodule changes the output.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".gamma"):
                p.copy_(torch.rand_like(p) + 0.5)
            elif "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


MODELS = {
    "vit": lambda: _vit(),
    "deit_distilled": lambda: _vit("deit_tiny_distilled_patch16_224"),
    "registers": lambda: _vit(reg_tokens=4),
    "layerscale": lambda: _vit(init_values=1e-5),
    "qk_norm": lambda: _vit(qk_norm=True),
}


class TopK(nn.Module):
    """Keep the k tokens with the highest received attention (ties: lowest index), in order."""

    def __init__(self, k: int, *, carry: bool = True, needs_received: bool = True) -> None:
        super().__init__()
        self.k, self.carry, self.needs_received = k, carry, needs_received
        self.seen: list[int] = []

    def forward(self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None):
        B, N, C = tokens.shape
        self.seen.append(N)
        if sizes is None and self.carry:
            sizes = tokens.new_ones(B, N)
        if self.k >= N:
            return tokens, sizes
        score = received if received is not None else -torch.arange(N, dtype=tokens.dtype).expand(B, N)
        idx = score.topk(self.k, dim=1).indices.sort(dim=1).values
        tokens = tokens.gather(1, idx[..., None].expand(-1, -1, C))
        return tokens, None if sizes is None else sizes.gather(1, idx)


class MergePairs(nn.Module):
    """Size-weighted mean of neighbouring token pairs: exercises the carried sizes."""

    needs_received = False

    def forward(self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None):
        B, N, C = tokens.shape
        sizes = tokens.new_ones(B, N) if sizes is None else sizes
        n = N // 2 * 2
        w = sizes[:, :n].reshape(B, n // 2, 2)
        merged = (tokens[:, :n].reshape(B, n // 2, 2, C) * w[..., None]).sum(2) / w.sum(2)[..., None]
        return torch.cat([merged, tokens[:, n:]], 1), torch.cat([w.sum(2), sizes[:, n:]], 1)


def reference_forward(model: nn.Module, x: Tensor, reducers: list[nn.Module | None]) -> Tensor:
    """Plain loop over blocks calling timm's own ``Attention.forward`` (explicit softmax)."""
    prefix = model.num_prefix_tokens
    x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    sizes = None
    for blk, red in zip(model.blocks, reducers):
        attn = blk.attn
        h = blk.norm1(x)
        bias = None if sizes is None else sizes.log()[:, None, None, :]
        B, N, _ = h.shape
        q, k, _ = attn.qkv(h).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        logits = attn.q_norm(q) @ attn.k_norm(k).transpose(-1, -2) * attn.scale
        probs = (logits if bias is None else logits + bias).softmax(-1)
        received = probs.sum((1, 2))
        fused, attn.fused_attn = attn.fused_attn, False
        try:
            x = x + blk.ls1(attn(h, attn_mask=bias))
        finally:
            attn.fused_attn = fused
        if red is not None:
            x, sizes, _ = reduce_tokens(red, x, sizes, received, prefix)
        x = x + blk.ls2(blk.mlp(blk.norm2(x)))
    return model.forward_head(model.norm(x))


@pytest.mark.parametrize("kind", list(MODELS))
def test_full_budget_is_identity(kind: str) -> None:
    model = MODELS[kind]()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
        apply_reducers(model, [TopK(100), TopK(100), TopK(100)])
        out = model(x)
    assert is_patched(model)
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("kind", list(MODELS))
def test_reduction_matches_reference(kind: str) -> None:
    model = MODELS[kind]()
    x = torch.randn(3, 3, 32, 32)
    reducers: list[nn.Module | None] = [TopK(11), MergePairs(), TopK(4, needs_received=False)]
    with torch.no_grad():
        ref = reference_forward(model, x, reducers)
        apply_reducers(model, reducers)
        out = model(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # prefix tokens are never handed to a reducer: 16 patches, then 11, then 6 after the pairs
    assert reducers[0].seen == [16, 16] and reducers[2].seen == [6, 6]


def test_prefix_tokens_kept_and_token_count() -> None:
    model = MODELS["registers"]()
    apply_reducers(model, [TopK(9), TopK(5), None])
    with torch.no_grad():
        feats = model.forward_features(torch.randn(2, 3, 32, 32))
    assert feats.shape == (2, 5 + 5, model.embed_dim)  # class + 4 registers + 5 kept


def test_fused_attention_when_scores_not_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("attn_mask") is not None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    model = apply_reducers(MODELS["vit"](), [MergePairs(), None, TopK(3)])
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    # block 0: fused, no sizes yet; block 1: fused with the log(size) mask; block 2 needs scores
    assert calls == [False, True]


def test_gradients_reach_every_parameter() -> None:
    model = apply_reducers(MODELS["layerscale"]().train(), [TopK(10), MergePairs(), TopK(2)])
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_remove_restores_model() -> None:
    model = MODELS["deit_distilled"]()
    x = torch.randn(2, 3, 32, 32)
    keys = list(model.state_dict())
    with torch.no_grad():
        ref = model(x)
        apply_reducers(model, [TopK(5), TopK(3), TopK(1)])
        assert list(model.state_dict()) == keys  # same blocks, same keys
        assert len(model.blocks) == 3 and type(model.blocks) is nn.Sequential
        assert not torch.allclose(model(x), ref)
        remove_token_pooling(model)
        out = model(x)
    assert not hasattr(model, "token_pooling") and not is_patched(model)
    assert all("forward" not in b.__dict__ for b in model.blocks) and "pool" not in model.__dict__
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    apply_reducers(model, [None, None, None])  # can be patched again


def test_a_model_pickled_before_grids_were_tracked_still_runs_and_unpatches() -> None:
    """A whole patched model saved with ``torch.save`` by the previous version held no grid
    state, recorded its overrides as (module, attribute) pairs and its reducers' budgets
    as plain attributes."""
    import io

    model = apply_token_pooling(_vit(), keep=0.5, method="merge")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
    pooling = model.token_pooling
    del pooling.__dict__["_grids"], pooling._carried["handed"]
    pooling.overrides = [(module, name) for module, name, _ in pooling.overrides]
    for reducer in pooling.reducers.values():  # the budget was a plain attribute then
        budget = reducer.__dict__.pop("_budget")
        del reducer.__dict__["_ratio_text"]
        reducer.__dict__["keep"] = budget
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), expected, rtol=0, atol=0)
    remove_token_pooling(loaded)
    assert all("forward" not in b.__dict__ for b in loaded.blocks)


def test_refuses_second_patch_and_unsupported_models() -> None:
    version = timm.__version__
    model = apply_reducers(MODELS["vit"](), [None] * 3)
    with pytest.raises(ValueError, match=rf"already applied.*timm {version}"):
        apply_reducers(model, [None] * 3)
    # apply_reducers takes any supported host: the error names every library it knows.
    with pytest.raises(
        ValueError, match=rf"cannot patch a Sequential.*timm VisionTransformer \(timm {version}\)"
    ):
        apply_reducers(nn.Sequential(nn.Linear(2, 2)), [None])
    parallel = timm.create_model("vit_small_patch16_18x2_224", **{**SMALL, "depth": 2})
    with pytest.raises(ValueError, match=rf"timm {version}.*block 0 is a ParallelThingsBlock"):
        apply_reducers(parallel, [None] * 2)
    with pytest.raises(ValueError, match="got 2 reducers for a model with 3 blocks"):
        apply_reducers(MODELS["vit"](), [None] * 2)
    with pytest.raises(ValueError, match="no token pooling to remove"):
        remove_token_pooling(MODELS["vit"]())


def test_refuses_unknown_block_forward() -> None:
    model = MODELS["vit"]()

    class OtherBlock(type(model.blocks[0])):
        def forward(self, x, attn_mask=None, is_causal=False):
            return x

    model.blocks[1].__class__ = OtherBlock
    with pytest.raises(ValueError, match=r"block 1 is a OtherBlock"):
        apply_reducers(model, [None] * 3)


@pytest.mark.parametrize("method", ["wkmedoids", "kmeans", "powerbert", "merge", "random"])
def test_apply_token_pooling_methods(method: str) -> None:
    model = MODELS["deit_distilled"]()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
        apply_token_pooling(model, keep=[16, 16, 16], method=method, carry=True)
        same = model(x)
        remove_token_pooling(model)
        apply_token_pooling(model, keep=[12, 6, 3], method=method, carry=True)
        feats = model.forward_features(x)
    assert (same - ref).abs().max() < 1e-5
    assert feats.shape[1] == 2 + 3 and torch.isfinite(feats).all()


def test_create_timm_model_errors_and_local_weights(tmp_path) -> None:
    from leanformer.patch.timm import create_timm_model

    with pytest.raises(ValueError, match=r"unknown timm model 'deit_smal_patch16_224'.*mean deit_small"):
        create_timm_model("deit_smal_patch16_224")
    with pytest.raises(ValueError, match="local file"):
        create_timm_model("deit_tiny_patch16_224", pretrained=True)
    torch.manual_seed(0)
    # timm re-initialises the head when num_classes differs from its config's, so keep 1000.
    source = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32)
    path = tmp_path / "weights.pth"
    torch.save(source.state_dict(), path)
    loaded = create_timm_model(
        "deit_tiny_patch16_224",
        pretrained=True,
        pretrained_cfg_overlay={"file": str(path)},
        img_size=32,
    )
    for (name, a), b in zip(source.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("method", ["powerbert", "wkmedoids", "merge"])
def test_patched_forward_peak_memory_is_not_above_the_unpatched(method: str) -> None:
    """With the first block already removing tokens, no patched forward may hold more live
    tensor memory than the host's: attention scores come a block of queries at a time and
    the attention output is freed before the MLP, as in timm's own block."""
    from leanformer.bench.memory import cpu_peak_mb

    torch.manual_seed(0)
    # 256 patch tokens, head size 32: scores in blocks of 128 queries.
    shape = dict(depth=2, img_size=64, patch_size=4, embed_dim=64, num_heads=2)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **shape).eval()
    x = torch.randn(4, 3, 64, 64)
    with torch.inference_mode():
        model(x)  # one-time allocations stay out of the figure
        host = cpu_peak_mb(lambda: model(x))
        apply_token_pooling(model, keep=[224, 192], method=method, carry=True)
        model(x)
        patched = cpu_peak_mb(lambda: model(x))
    assert patched <= host


def test_a_host_cast_before_patching_gets_the_pooling_in_its_dtype() -> None:
    """conv's learned downsampler is built in float32; on a float64 host it must follow."""
    model = _vit().double()
    apply_token_pooling(model, keep=0.5, method="conv")
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32, dtype=torch.float64)).dtype == torch.float64
