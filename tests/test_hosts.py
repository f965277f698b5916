"""Every supported host through the one adapter: timm ViTs in all their pooling forms and
Hugging Face ViT / DeiT / Dinov2 (+registers) / CLIP / SigLIP vision models.

Per host: a budget that keeps every token reproduces the unpatched output (the patched
blocks run the host's parts through leanformer's attention), every method at ratio 0.5
keeps the documented counts, removal restores the exact output, a second patch and
unknown hosts raise naming the library and its version. Across hosts: a timm ViT and a
``transformers`` ViTModel with the same weights agree under the same method and budget.
Models are tiny and built from configs (nothing is downloaded).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import timm
import torch
from torch import Tensor, nn

import leanformer
from leanformer.bench.flops import count_gflops
from leanformer.pooling.budgets import parse_keep
from leanformer.pooling.registry import list_methods

transformers = pytest.importorskip("transformers")

SMALL_TIMM = dict(pretrained=False, depth=3, img_size=32, patch_size=8, num_classes=7, embed_dim=48)
SMALL_HF = dict(
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    intermediate_size=64,
    image_size=32,
    patch_size=8,
)
PATCHES = 16  # 32x32 images, patch 8


def _randomise(model: nn.Module) -> nn.Module:
    """Random LayerScale and norm affines, so a skipped submodule changes the output."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith((".gamma", "lambda1")):
                p.copy_(torch.rand_like(p) + 0.5)
            elif "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _timm(**kw: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return _randomise(timm.create_model("vit_tiny_patch16_224", **{**SMALL_TIMM, **kw}))

    return build


def _hf(model: str, config: str, **kw: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        opts = {**SMALL_HF, **kw}
        if config.startswith("Dinov2"):
            opts.pop("intermediate_size")
        return _randomise(getattr(transformers, model)(getattr(transformers, config)(**opts)))

    return build


# name -> (builder, prefix tokens)
HOSTS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "timm_cls": (_timm(), 1),
    "timm_avg_no_cls": (_timm(global_pool="avg", class_token=False), 0),
    "timm_avgmax": (_timm(global_pool="avgmax"), 1),
    "timm_map": (_timm(global_pool="map", class_token=False), 0),
    "timm_registers": (_timm(reg_tokens=2), 3),
    "timm_distilled": (
        lambda: _randomise(
            timm.create_model("deit_tiny_distilled_patch16_224", **{**SMALL_TIMM, "embed_dim": 192})
        ),
        2,
    ),
    "timm_dynamic": (_timm(dynamic_img_size=True), 1),
    "timm_layerscale_qknorm": (_timm(init_values=0.1, qk_norm=True), 1),
    "timm_scaled_norm": (_timm(scale_attn_norm=True, scale_mlp_norm=True), 1),
    "hf_vit": (_hf("ViTForImageClassification", "ViTConfig", num_labels=5), 1),
    "hf_deit_distilled": (_hf("DeiTForImageClassificationWithTeacher", "DeiTConfig", num_labels=5), 2),
    "hf_dinov2": (_hf("Dinov2Model", "Dinov2Config", layerscale_value=0.5), 1),
    "hf_dinov2_registers": (
        _hf("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig", num_register_tokens=2),
        3,
    ),
    "hf_clip": (_hf("CLIPVisionModel", "CLIPVisionConfig"), 1),
    "hf_siglip": (_hf("SiglipVisionModel", "SiglipVisionConfig"), 0),
}


def _is_hf(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers.")


def run(model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """``(final output, tokens after the last block)`` of either library's model."""
    if not _is_hf(model):
        feats = model.forward_features(x)
        return model.forward_head(feats), feats
    out = model(pixel_values=x, output_hidden_states=True)
    final = next(
        v
        for k in ("logits", "pooler_output", "last_hidden_state")
        if (v := getattr(out, k, None)) is not None
    )
    return final, out.hidden_states[-1]


@pytest.fixture(scope="module")
def images() -> Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("host", list(HOSTS))
def test_keep_everything_is_identity_and_remove_restores(host: str, images: Tensor) -> None:
    build, _ = HOSTS[host]
    model = build()
    keys = list(model.state_dict())
    with torch.no_grad():
        ref, _ = run(model, images)
        leanformer.apply_token_pooling(model, keep=[PATCHES] * 3, method="wkmedoids")
        assert leanformer.is_patched(model) and list(model.state_dict()) == keys
        same, _ = run(model, images)
        model.token_pooling.keep = 0.5
        reduced, _ = run(model, images)
        leanformer.remove_token_pooling(model)
        back, _ = run(model, images)
    assert (same - ref).abs().max() < 1e-5
    assert (reduced - ref).abs().max() > 1e-4  # the reduction really ran
    assert not leanformer.is_patched(model) and list(model.state_dict()) == keys
    torch.testing.assert_close(back, ref, atol=0, rtol=0)


@pytest.mark.parametrize("host", list(HOSTS))
def test_a_copied_or_pickled_patched_model_runs_its_own_weights(host: str, images: Tensor) -> None:
    """The patched attention must follow the copy's weights, not the original's: a copy with
    other weights equals a fresh patched model loaded with them (and gradients reach the copy)."""
    import copy
    import io

    build, _ = HOSTS[host]
    original = build()
    leanformer.apply_token_pooling(original, keep=0.5, method="merge")
    copied = copy.deepcopy(original)
    with torch.no_grad():
        for p in copied.parameters():
            p.mul_(0.5)
    fresh = build()
    leanformer.apply_token_pooling(fresh, keep=0.5, method="merge")
    fresh.load_state_dict(copied.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(run(copied, images)[0], run(fresh, images)[0])
        assert (run(copied, images)[0] - run(original, images)[0]).abs().max() > 1e-4
    run(copied, images)[0].sum().backward()
    qkv = [p for n, p in copied.named_parameters() if "attn" in n or "attention" in n]
    assert qkv and all(p.grad is not None for p in qkv)
    assert all(p.grad is None for p in original.parameters())
    if _is_hf(original):
        return  # transformers' own output hooks are local functions: its models do not pickle
    buffer = io.BytesIO()
    torch.save(original, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        torch.testing.assert_close(run(loaded, images)[0], run(original, images)[0])


@pytest.mark.parametrize("host", list(HOSTS))
def test_every_method_keeps_the_documented_counts(host: str, images: Tensor) -> None:
    build, prefix = HOSTS[host]
    base = build()
    for method in list_methods():
        model = leanformer.apply_token_pooling(
            build() if method == "conv" else base, keep=0.5, method=method, carry=True
        )
        with torch.no_grad():
            final, tokens = run(model, images)
        # ratio 0.5 per block: 16 -> 8 -> 4 -> 2; entrymerge halves once more before the
        # first block; conv halves each grid side while the budget asks to drop half:
        # 4x4 -> 2x2 -> 1x1 -> (one token left: no layer)
        expected = {"none": PATCHES, "conv": 1, "entrymerge": 1}.get(method, 2)
        assert tokens.shape[1] == prefix + expected, method
        assert torch.isfinite(final).all(), method
        if method != "conv":
            leanformer.remove_token_pooling(model)


@pytest.mark.parametrize("host", ["timm_cls", "hf_clip", "hf_siglip"])
def test_second_patch_raises_naming_the_library(host: str) -> None:
    model = leanformer.apply_token_pooling(HOSTS[host][0](), keep=0.5, method="merge")
    library = "transformers" if _is_hf(model) else "timm"
    with pytest.raises(ValueError, match=rf"already applied.*{library} \d"):
        leanformer.apply_token_pooling(model, keep=0.5, method="merge")


@pytest.mark.parametrize("method", ["kmeans", "wkmedoids", "merge", "entrymerge", "powerbert"])
@pytest.mark.parametrize("training", [False, True])
def test_an_empty_batch_gives_the_hosts_empty_output(method: str, training: bool) -> None:
    """Clusterings had no tokens to seed from and score-needing methods no scores: an empty
    batch now passes through the host's own blocks, as it does unpatched."""
    model = HOSTS["timm_avgmax"][0]().train(training)
    empty = torch.randn(0, 3, 32, 32)
    expected = model(empty)
    leanformer.apply_token_pooling(model, keep=0.5, method=method, carry=True)
    out = model(empty)
    assert out.shape == expected.shape == (0, 7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)  # and the next batch pools


@pytest.mark.parametrize("host", ["timm_cls", "hf_vit"])
def test_a_later_block_run_on_its_own_starts_from_nothing_of_the_last_forward(
    host: str, images: Tensor
) -> None:
    """Block 1 called on tokens of its own after a whole forward: the last block handed
    no sizes on, so it runs as on a model that never ran (before, it took the last
    forward's sizes, which fail or, at a matching count, weigh the wrong tokens)."""
    build, prefix = HOSTS[host]
    ran, fresh = build(), build()
    for model in (ran, fresh):
        leanformer.apply_token_pooling(model, keep=0.5, method="merge", carry=True)
    with torch.no_grad():
        run(ran, images)
        tokens = torch.randn(2, prefix + 8, 32 if _is_hf(ran) else 48)
        blocks = (lambda m: m.vit.layers) if _is_hf(ran) else (lambda m: m.blocks)
        out, expected = blocks(ran)[1](tokens), blocks(fresh)[1](tokens)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("carry", ["no", 1, None])
def test_carry_must_be_a_yes_or_no(carry: object) -> None:
    """A word would be truthy: sizes tracked although the caller said no."""
    model = HOSTS["timm_cls"][0]()
    with pytest.raises(ValueError, match="carry must be True or False"):
        leanformer.apply_token_pooling(model, keep=0.5, method="merge", carry=carry)  # type: ignore[arg-type]
    assert not leanformer.is_patched(model)


def test_unsupported_hosts_raise_naming_library_and_version() -> None:
    hf_version, timm_version = transformers.__version__, timm.__version__
    beit = transformers.BeitModel(transformers.BeitConfig(**SMALL_HF))
    with pytest.raises(
        ValueError, match=rf"transformers {hf_version}.*BeitModel is not one of the supported"
    ):
        leanformer.apply_token_pooling(beit, keep=0.5)
    eva = timm.create_model("eva02_tiny_patch14_224", pretrained=False, depth=1, img_size=28)
    with pytest.raises(ValueError, match=rf"timm {timm_version}.*Eva is not a timm VisionTransformer"):
        leanformer.apply_token_pooling(eva, keep=0.5)
    with pytest.raises(ValueError, match=rf"timm {timm_version}.*transformers {hf_version}"):
        leanformer.apply_token_pooling(nn.Linear(2, 2), keep=0.5)
    with pytest.raises(ValueError, match="no token pooling to remove"):
        leanformer.remove_token_pooling(HOSTS["hf_vit"][0]())


def test_masks_are_refused_on_pooled_models() -> None:
    model = leanformer.apply_token_pooling(HOSTS["timm_cls"][0](), keep=0.5, method="powerbert")
    with pytest.raises(ValueError, match="cannot take an attention mask"):
        model.forward_features(torch.randn(1, 3, 32, 32), attn_mask=torch.ones(17, 17, dtype=torch.bool))


@pytest.mark.parametrize("host", ["hf_vit", "hf_clip"])
def test_attention_maps_are_refused_on_pooled_hugging_face_models(host: str, images: Tensor) -> None:
    """The host collects its maps from attention modules the pooled blocks no longer call:
    it returned an empty tuple without saying so."""
    model = HOSTS[host][0]()
    model.config._attn_implementation = "eager"  # the implementation that returns maps
    with torch.no_grad():
        assert len(model(pixel_values=images, output_attentions=True).attentions) == 3
        leanformer.apply_token_pooling(model, keep=0.5, method="merge")
        with pytest.raises(ValueError, match="cannot return attention maps"):
            model(pixel_values=images, output_attentions=True)
        model(pixel_values=images)  # without maps it runs
        model.config.output_attentions = True  # maps asked for by the config, not the call
        with pytest.raises(ValueError, match="cannot return attention maps"):
            model(pixel_values=images)


def _timm_to_hf_vit(timm_model: nn.Module) -> nn.Module:
    """A ``transformers`` ViTModel holding ``timm_model``'s weights (fused qkv split in three)."""
    cfg = transformers.ViTConfig(
        **{**SMALL_HF, "hidden_size": 48, "num_attention_heads": 3, "intermediate_size": 192}
    )
    cfg.layer_norm_eps = 1e-6  # timm's
    hf = transformers.ViTModel(cfg, add_pooling_layer=False).eval()
    src = timm_model.state_dict()
    state = {
        "embeddings.cls_token": src["cls_token"],
        "embeddings.position_embeddings": src["pos_embed"],
        "embeddings.patch_embeddings.projection.weight": src["patch_embed.proj.weight"],
        "embeddings.patch_embeddings.projection.bias": src["patch_embed.proj.bias"],
        "layernorm.weight": src["norm.weight"],
        "layernorm.bias": src["norm.bias"],
    }
    for i in range(len(timm_model.blocks)):
        t, h = f"blocks.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            for a, b in (
                ("norm1", "layernorm_before"),
                ("norm2", "layernorm_after"),
                ("attn.proj", "attention.o_proj"),
            ):
                state[h + f"{b}.{kind}"] = src[t + f"{a}.{kind}"]
            for fc in ("fc1", "fc2"):
                state[h + f"mlp.{fc}.{kind}"] = src[t + f"mlp.{fc}.{kind}"]
            for name, part in zip(("q", "k", "v"), src[t + f"attn.qkv.{kind}"].chunk(3), strict=True):
                state[h + f"attention.{name}_proj.{kind}"] = part
    hf.load_state_dict(state, strict=True)
    return hf


@pytest.mark.parametrize("method", ["wkmedoids", "powerbert", "merge", "inputmerge", "entrymerge"])
def test_timm_and_hugging_face_vit_agree(method: str, images: Tensor) -> None:
    timm_model = HOSTS["timm_cls"][0]()
    hf_model = _timm_to_hf_vit(timm_model)
    with torch.no_grad():
        plain = (
            (timm_model.forward_features(images) - hf_model(pixel_values=images).last_hidden_state)
            .abs()
            .max()
        )
        for model in (timm_model, hf_model):
            leanformer.apply_token_pooling(model, keep=0.5, method=method, carry=True)
        a = timm_model.forward_features(images)
        b = hf_model(pixel_values=images).last_hidden_state
    assert plain < 1e-4  # the conversion is right before any pooling
    # 16 patches halved by each of 3 blocks; entrymerge halves them once more before the first
    assert a.shape == b.shape == (2, 1 + (1 if method == "entrymerge" else 2), 48)
    assert (a - b).abs().max() < 1e-4


def test_runtime_budget_changes_gflops_and_bad_budget_keeps_the_old_one() -> None:
    model = leanformer.apply_token_pooling(HOSTS["hf_vit"][0](), keep=[16, 16, 16], method="wkmedoids")
    x = (torch.randn(1, 3, 32, 32),)

    def gflops() -> float:
        return count_gflops(model, x)

    full = gflops()
    model.token_pooling.keep = {"r": 4}  # ToMe's form: 16 -> 12 -> 8 -> 4
    tome = gflops()
    model.token_pooling.keep = 0.5
    half = gflops()
    assert half < tome < full
    before = model.token_pooling.reducers
    for bad, match in (([4, 4], "3 blocks"), (1.5, r"\(0, 1\]"), ({"r": -1}, ">= 0"), ("levl3", "preset")):
        with pytest.raises(ValueError, match=match):
            model.token_pooling.keep = bad
        assert model.token_pooling.keep == parse_keep(0.5) and model.token_pooling.reducers is before
    assert gflops() == pytest.approx(half)


def test_modes_follow_the_host_and_eval_is_deterministic(images: Tensor) -> None:
    for host in ("timm_cls", "hf_siglip"):
        model = leanformer.apply_token_pooling(HOSTS[host][0](), keep=0.5, method="random")
        assert not any(m.training for m in model.token_pooling.modules())
        with torch.no_grad():
            first, second = run(model, images)[0], run(model, images)[0]
        torch.testing.assert_close(first, second, atol=0, rtol=0)
        model.train()
        assert all(m.training for m in model.token_pooling.modules())
        model.token_pooling.keep = 0.25  # rebuilt reducers take the current mode
        assert all(m.training for m in model.token_pooling.modules())


@pytest.mark.parametrize("host", ["timm_avg_no_cls", "timm_avgmax", "timm_map", "hf_siglip"])
def test_average_and_attention_pools_weigh_tokens_by_size(host: str, images: Tensor) -> None:
    """Two identical patches merged into one token of size 2 must leave a size-weighted
    average (or attention pool) exactly as it was over the 16 original tokens."""
    model = HOSTS[host][0]()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "pos_embed" in name or "position_embedding" in name:
                p.zero_()  # identical patches give identical tokens
        x = images.clone()
        x[..., 0:8, 8:16] = x[..., 0:8, 0:8]  # patch 1 = patch 0: the one pair merge picks
        ref = run(model, x)[0]
        leanformer.apply_token_pooling(model, keep=[15, 15, 15], method="merge", carry=True)
        pooled, tokens = run(model, x)
        leanformer.remove_token_pooling(model)
        leanformer.apply_token_pooling(model, keep=[15, 15, 15], method="merge", carry=False)
        unweighted = run(model, x)[0]
    assert tokens.shape[1] == HOSTS[host][1] + 15
    torch.testing.assert_close(pooled, ref, atol=2e-5, rtol=2e-5)
    assert (unweighted - ref).abs().max() > 1e-4  # without sizes the merge is visible


@pytest.mark.parametrize(
    "host", ["timm_avg_no_cls", "timm_avgmax", "timm_map", "timm_max_with_cls", "hf_siglip", "timm_cls"]
)
@pytest.mark.parametrize("carry", [True, False])
def test_a_head_that_pools_patches_refuses_a_budget_that_leaves_none(
    host: str, carry: bool, images: Tensor
) -> None:
    """A budget of 0 leaves only the prefix tokens: fine for a class-token head, but an
    average, max or attention pool over no patch token would be NaN, not an answer."""
    model = _timm(global_pool="max")() if host == "timm_max_with_cls" else HOSTS[host][0]()
    leanformer.apply_token_pooling(model, keep=[10, 0, 0], method="merge", carry=carry)
    if host == "timm_cls":
        with torch.no_grad():
            assert torch.isfinite(run(model, images)[0]).all()
        return
    refusal = r"left no patch token .* pools the patch tokens .*keep at least one"
    with pytest.raises(ValueError, match=refusal), torch.no_grad():
        run(model, images)
    model.token_pooling.keep = [10, 1, 1]
    with torch.no_grad():
        assert torch.isfinite(run(model, images)[0]).all()
