"""ENACT patched into Hugging Face DETR: exact against the unpatched host, padding-invariant, trainable."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    ConditionalDetrConfig,
    ConditionalDetrForObjectDetection,
    DetrConfig,
    DetrForObjectDetection,
    DetrModel,
)

from leanformer.patch.transformers import apply_enact, remove_enact  # noqa: E402
from leanformer.patch.transformers.detr import (  # noqa: E402
    DetrEnactAttention,
    cluster_ratios,
    enact_layers,
    is_patched,
)

TINY = dict(
    use_timm_backbone=True,
    use_pretrained_backbone=False,  # random weights: nothing is downloaded
    backbone="resnet18",
    d_model=32,
    encoder_layers=2,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    num_queries=6,
    num_labels=3,
)


def build(cls, config_cls=DetrConfig, seed=0, **overrides):
    torch.manual_seed(seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return cls(config_cls(**{**TINY, **overrides})).eval()


@pytest.fixture(scope="module")
def detection():
    return build(DetrForObjectDetection)


def images(seed=0):
    """Two 224x288 images (7x9 feature map); the second is 160x192 padded at the bottom-right."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 224, 288, generator=gen)
    mask = torch.ones(2, 224, 288, dtype=torch.long)
    mask[1, 160:, :] = 0
    mask[1, :, 192:] = 0
    x[1][:, 160:] = 0
    x[1][:, :, 192:] = 0
    return x, mask


def outputs(model, x, mask):
    with torch.no_grad():
        out = model(pixel_values=x, pixel_mask=mask)
    names = ("logits", "pred_boxes", "last_hidden_state", "encoder_last_hidden_state")
    return {k: out[k] for k in names if k in out}


@pytest.mark.parametrize(
    "cls, config_cls",
    [
        (DetrForObjectDetection, DetrConfig),
        (DetrModel, DetrConfig),
        (ConditionalDetrForObjectDetection, ConditionalDetrConfig),
    ],
)
def test_single_position_regions_reproduce_the_dense_model(cls, config_cls):
    model = build(cls, config_cls)
    x, mask = images()
    dense = outputs(model, x, mask)
    apply_enact(model, regions="single")
    assert all(isinstance(a, DetrEnactAttention) for a in enact_layers(model))
    patched = outputs(model, x, mask)
    assert dense.keys() == patched.keys() and "encoder_last_hidden_state" in dense
    for name in dense:
        diff = (dense[name] - patched[name]).abs().max().item()
        assert diff < 1e-5, (name, diff)
    assert cluster_ratios(model) == [1.0, 1.0]


def test_enact_clusters_keys_and_changes_the_encoder(detection):
    model = copy.deepcopy(detection)
    x, mask = images()
    dense = outputs(model, x, mask)
    apply_enact(model, sigma=1.0)
    enact = outputs(model, x, mask)
    ratios = cluster_ratios(model)
    assert len(ratios) == 2 and all(0 < r < 1 for r in ratios)
    attn = enact_layers(model)[0]
    assert attn.last_valid_counts.tolist() == [7 * 9, 5 * 6]
    assert (attn.last_cluster_counts < attn.last_valid_counts).all()
    assert enact["encoder_last_hidden_state"].shape == dense["encoder_last_hidden_state"].shape
    assert not torch.allclose(enact["encoder_last_hidden_state"], dense["encoder_last_hidden_state"])


def test_padded_map_gives_the_cropped_maps_encoder_output(detection):
    """The encoder (patched) sees a padded map exactly as the cropped map alone.

    Tested at the encoder: a conv backbone's features near the padding differ from the
    cropped image's in DETR itself, patched or not.
    """
    model = apply_enact(copy.deepcopy(detection), sigma=1.0)
    core = model.model
    x, mask = images()
    seen = {}
    # Runs after the patch's own encoder hook, so it sees the shape that hook passes on.
    handle = core.encoder.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    with torch.no_grad():
        model(pixel_values=x, pixel_mask=mask)
    handle.remove()
    feats, valid, pos = seen["inputs_embeds"], seen["attention_mask"], seen["spatial_position_embeddings"]
    H, W = seen["enact_spatial_shape"]
    assert (H, W) == (7, 9) and valid.dtype == torch.bool
    # Garbage at the padded positions must not reach any valid output.
    feats = torch.where(valid[..., None], feats, torch.full_like(feats, 1e4))
    with torch.no_grad():
        padded = core.encoder(
            inputs_embeds=feats,
            attention_mask=valid,
            spatial_position_embeddings=pos,
            enact_spatial_shape=(H, W),
        ).last_hidden_state
        hv, wv = 5, 6
        crop = feats[1].view(H, W, -1)[:hv, :wv].reshape(1, hv * wv, -1)
        # As DetrModel does: the position embedding's call tells the patch the map's shape.
        crop_pos = core.position_embedding(shape=(1, 1, hv, wv), device=x.device, dtype=x.dtype)
        crop_pos = crop_pos.flatten(2).transpose(1, 2)
        torch.testing.assert_close(crop_pos[0], pos[1].view(H, W, -1)[:hv, :wv].reshape(hv * wv, -1))
        alone = core.encoder(inputs_embeds=crop, spatial_position_embeddings=crop_pos).last_hidden_state
    torch.testing.assert_close(padded[1].view(H, W, -1)[:hv, :wv].reshape(hv * wv, -1), alone[0])
    assert enact_layers(model)[0].last_valid_counts.tolist() == [hv * wv]


def test_remove_restores_the_exact_model(detection):
    model = copy.deepcopy(detection)
    x, mask = images()
    before = outputs(model, x, mask)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    originals = [layer.self_attn for layer in model.model.encoder.layers]
    apply_enact(model)
    assert is_patched(model)
    patched_keys = set(model.state_dict())
    assert patched_keys - set(state) == {
        f"model.encoder.layers.{i}.self_attn.entropy_proj.weight" for i in range(2)
    }
    model.train()
    outputs(model, x, mask)
    remove_enact(model)
    assert not is_patched(model)
    assert [layer.self_attn for layer in model.model.encoder.layers] == originals
    assert all(a.training for a in originals)  # train() on the patched model reaches them
    model.eval()
    after_state = model.state_dict()
    assert after_state.keys() == state.keys()
    assert all(torch.equal(after_state[k], state[k]) for k in state)
    assert (
        not model.model.encoder._forward_pre_hooks and not model.model.position_embedding._forward_pre_hooks
    )
    after = outputs(model, x, mask)
    assert all(torch.equal(before[k], after[k]) for k in before)
    apply_enact(model)  # and it can be applied again
    remove_enact(model)


def test_detection_training_step_reaches_every_encoder_parameter(detection):
    model = apply_enact(copy.deepcopy(detection), sigma=1.0).train()
    x, mask = images()
    labels = [
        {
            "class_labels": torch.tensor([0, 2]),
            "boxes": torch.tensor([[0.3, 0.4, 0.2, 0.3], [0.7, 0.6, 0.3, 0.2]]),
        },
        {"class_labels": torch.tensor([1]), "boxes": torch.tensor([[0.4, 0.4, 0.3, 0.4]])},
    ]
    out = model(pixel_values=x, pixel_mask=mask, labels=labels)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    encoder = dict(model.model.encoder.named_parameters())
    assert any("entropy_proj" in n for n in encoder)
    for name, p in encoder.items():
        assert p.requires_grad and p.grad is not None and torch.isfinite(p.grad).all(), name
        # The entropy logit's bias shifts every logit of a map alike, and the softmax over
        # positions cancels it: its gradient is zero in exact arithmetic.
        if not name.endswith("entropy_proj.bias"):
            assert p.grad.abs().sum() > 0, name
    backbone = [p for p in model.model.backbone.parameters() if p.requires_grad]
    assert backbone and all(p.grad is not None for p in backbone)
    assert model.model.input_projection.weight.grad.abs().sum() > 0


def test_the_entropy_gradient_matches_finite_differences(detection):
    """The entropy path's gradient (our analytic backward) through a patched layer, in float64."""
    host = copy.deepcopy(detection.model.encoder.layers[0].self_attn).double()
    attn = DetrEnactAttention(host, num_heads=4, sigma=1.0)
    assert attn.entropy_proj.weight.dtype == torch.float64
    torch.nn.init.normal_(attn.entropy_proj.weight, std=3.0)  # far from uniform weights in a region
    gen = torch.Generator().manual_seed(1)
    H, W = 4, 5
    x, pos = torch.randn(2, 2, H * W, 32, generator=gen, dtype=torch.float64)
    valid = torch.ones(2, H, W, dtype=torch.bool)
    valid[1, 3:, :] = False
    valid[1, :, 4:] = False
    weight = attn.entropy_proj.weight.detach().clone().requires_grad_(True)
    probe = torch.randn(2, H * W, 32, generator=gen, dtype=torch.float64)

    def attention(w):
        kwargs = dict(position_embeddings=pos, enact_spatial_shape=(H, W), enact_valid=valid.flatten(1))
        out, _ = torch.func.functional_call(attn, {"entropy_proj.weight": w}, (x,), kwargs)
        return (out * probe).sum()  # one scalar: a random projection of every output

    assert torch.autograd.gradcheck(attention, (weight,), eps=1e-6, atol=1e-6)
    assert attn.last_cluster_counts.max() < H * W  # real regions, not the identity


def test_unsupported_models_and_misuse_are_refused(detection):
    version = transformers.__version__
    with pytest.raises(ValueError, match=f"transformers {version}.*Linear is not one of"):
        apply_enact(nn.Linear(2, 2))
    model = copy.deepcopy(detection)
    model.model.encoder.layers[1].self_attn = nn.Identity()
    with pytest.raises(ValueError, match=f"transformers {version}.*layer 1's self_attn is Identity"):
        apply_enact(model)
    assert not is_patched(model)
    model = copy.deepcopy(detection)
    with pytest.raises(ValueError, match="sigma must be"):
        apply_enact(model, sigma=-1)
    with pytest.raises(ValueError, match="regions must be one of"):
        apply_enact(model, regions="chunks")
    with pytest.raises(TypeError):
        apply_enact(model, sigmaa=3)
    assert not is_patched(model)
    assert not any(isinstance(a, DetrEnactAttention) for a in model.modules())
    with pytest.raises(ValueError, match="not applied"):
        remove_enact(model)
    apply_enact(model)
    with pytest.raises(ValueError, match="already applied"):
        apply_enact(model)
    feats = torch.randn(1, 12, 32)
    with pytest.raises(ValueError, match=r"needs the feature map's \(H, W\)"):
        model.model.encoder(inputs_embeds=feats)
    with pytest.raises(ValueError, match="spatial shape 3x5 = 15 positions does not match"):
        model.model.encoder(inputs_embeds=feats, enact_spatial_shape=(3, 5))


def test_a_whole_forward_leaves_no_shape_for_a_later_direct_encoder_call(detection) -> None:
    # A forward given encoder_outputs embeds positions (the shape is recorded) but never
    # runs the encoder (which would use it up); a later direct call of the encoder on
    # another map of the same token count must not take that shape.
    from transformers.modeling_outputs import BaseModelOutput

    model = apply_enact(copy.deepcopy(detection))
    x, mask = images()
    with torch.no_grad():
        encoded = model.model(pixel_values=x, pixel_mask=mask).encoder_last_hidden_state
        reused = BaseModelOutput(last_hidden_state=encoded)
        model.model(pixel_values=x, pixel_mask=mask, encoder_outputs=reused)
        with pytest.raises(ValueError, match=r"needs the feature map's \(H, W\)"):
            model.model.encoder(inputs_embeds=torch.randn(1, 63, 32))  # 9x7, not the 7x9 just embedded
