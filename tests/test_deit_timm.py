"""The DeiT family is timm's VisionTransformer: registered in timm, pooled by the adapter,
old checkpoints converted."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer

import leanformer
from leanformer.models.registry import create_model


def test_deit_presets_are_timm_vision_transformers_with_timm_keys() -> None:
    torch.manual_seed(0)
    ours = create_model("deit_test").eval()
    assert type(ours).forward is VisionTransformer.forward and isinstance(ours, VisionTransformer)
    theirs = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=16,
        patch_size=4,
        embed_dim=32,
        depth=3,
        num_heads=2,
        num_classes=5,
        dynamic_img_size=True,
    ).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(ours(x), theirs(x))
    distilled = create_model("deit_test", distilled=True)
    assert isinstance(distilled, VisionTransformerDistilled) and distilled.num_prefix_tokens == 2


def test_timm_create_model_builds_registered_presets_with_pretrained_cfg() -> None:
    leanformer.list_models()  # importing the families registers them in timm too
    model = timm.create_model("deit_digits")
    cfg = model.pretrained_cfg
    assert cfg["input_size"] == (1, 32, 32) and cfg["num_classes"] == 10 and len(cfg["mean"]) == 1
    assert timm.create_model("deit_test", num_classes=3).num_classes == 3
    small = timm.models.get_pretrained_cfg("deit_small")
    assert small.input_size == (3, 224, 224) and small.mean == (0.485, 0.456, 0.406)
    with pytest.raises(ValueError, match="'deit_test' has no shipped weights"):
        timm.create_model("deit_test", pretrained=True)


def test_pooled_deit_budget_changes_at_run_time() -> None:
    model = create_model("deit_test", pool="powerbert", keep=[16, 16, 16], carry=True).eval()
    x = torch.randn(1, 3, 16, 16)
    assert model.forward_features(x).shape[1] == 1 + 16
    model.token_pooling.keep = "r4"
    assert model.forward_features(x).shape[1] == 1 + 4  # 16 -> 12 -> 8 -> 4


def test_old_checkpoint_reducer_keys_are_converted() -> None:
    torch.manual_seed(0)
    model = create_model("deit_test", pool="conv", pool_options={"layers": [0]})
    state = model.state_dict()
    new_key = "token_pooling.reducers.0.conv.weight"
    old = {k.replace("token_pooling.reducers.0.", "blocks.0.reducer."): v for k, v in state.items()}
    assert "blocks.0.reducer.conv.weight" in old and new_key not in old
    fresh = create_model("deit_test", pool="conv", pool_options={"layers": [0]})
    fresh.load_state_dict({k: v + 1 if k.endswith("conv.weight") else v for k, v in old.items()}, strict=True)
    torch.testing.assert_close(fresh.state_dict()[new_key], state[new_key] + 1)


@pytest.mark.parametrize("distilled", [False, True])
def test_image_sides_not_multiples_of_the_patch_are_a_value_error(distilled: bool) -> None:
    """timm's own check is an assert (a bare traceback, and gone under ``python -O``); every
    path to the patches, forward and forward_intermediates, names both sizes instead."""
    model = create_model("deit_test", distilled=distilled).eval()
    for path in (model, model.forward_intermediates):
        with pytest.raises(ValueError, match="image size 30x28 is not a multiple of the patch size 4x4"):
            path(torch.randn(1, 3, 30, 28))
    with torch.no_grad():
        assert model(torch.randn(2, 3, 24, 28)).shape[0] == 2  # other multiples still work
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(images), model(images))
