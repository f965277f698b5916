"""DRRT / DRT models: interface, gradients, region labels, variants, engine integration."""

from __future__ import annotations

import pytest
import torch

from leanformer import create_model, list_models
from leanformer.layers.pair_embed import ImagePatchTokens, grid_regions
from leanformer.models.drrt import DRRT

# Small but real shapes: 16x16 images in 4x4 patches (16 tokens), a 4x4 point grid.
SMALL = dict(img_size=16, patch_size=4, points_grid=(4, 4), dim=16, num_heads=2, num_classes=4)


def small(**kw) -> DRRT:
    torch.manual_seed(0)
    return DRRT(**{**SMALL, **kw}).eval()


def inputs(batch: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 1, 16, 16, generator=g), torch.randn(batch, 16, generator=g)


@pytest.mark.parametrize("name", [*list_models(family="drrt", tiny=True), "drrt", "drt"])
def test_variants_forward_and_train_every_parameter(name: str) -> None:
    torch.manual_seed(0)
    model = create_model(name)
    x = model.example_inputs(2)
    logits = model(*x)
    assert logits.shape == (2, model.num_classes) and torch.isfinite(logits).all()
    logits.square().sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: {pname} gets no gradient"


@torch.no_grad()
def test_every_registered_variant_builds_and_runs() -> None:
    for name in list_models(family="drrt"):
        model = create_model(name).eval()
        assert model(*model.example_inputs(1)).shape == (1, model.num_classes), name


def test_constructor_works_with_only_num_classes() -> None:
    for name in ("drrt", "drt", "drrt_image_only", "drrt_points_only"):
        model = create_model(name, num_classes=7)
        assert model(*model.example_inputs(1)).shape == (1, 7)


def test_drt_is_drrt_without_recurrence() -> None:
    drrt, drt = create_model("drrt"), create_model("drt")
    assert any(isinstance(m, torch.nn.RNN) for m in drrt.modules())
    assert not any(isinstance(m, torch.nn.RNN) for m in drt.modules())
    assert set(drrt.map_rnns) == {"global_alpha", "global_beta", "regional_alpha", "regional_beta"}
    assert len(drt.map_rnns) == 0 and len(drt.feature_rnns) == 0
    # Everything DRT has, DRRT has too, with the same shapes.
    drrt_shapes = {k: v.shape for k, v in drrt.state_dict().items()}
    for k, v in drt.state_dict().items():
        assert drrt_shapes[k] == v.shape, k


@pytest.mark.parametrize("recurrence", [True, False])
def test_batched_equals_per_example(recurrence: bool) -> None:
    model = small(recurrence=recurrence)
    a, b = inputs(3)
    with torch.no_grad():
        full = model(a, b)
        single = torch.cat([model(a[i : i + 1], b[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(full, single, rtol=1e-4, atol=1e-5)


def test_default_regions_are_corresponding_quadrants() -> None:
    model = small()
    assert model.region_a.tolist() == grid_regions((4, 4), (2, 2)).tolist()
    assert model.region_a.view(4, 4).tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]]
    assert model.region_b.tolist() == model.region_a.tolist()  # same 4x4 layout on both sides here


@pytest.mark.parametrize("recurrence", [True, False])
def test_explicit_region_labels(recurrence: bool) -> None:
    model = small(recurrence=recurrence)
    a, b = inputs(2)
    with torch.no_grad():
        default = model(a, b)
        # The model's own labels passed per example give the same output ...
        same = model(a, b, model.region_a.expand(2, -1), model.region_b)
        # ... and so does a pixel map of the quadrants for the image side.
        rows = torch.arange(16)[:, None] // 8
        pixel_map = rows * 2 + torch.arange(16)[None, :] // 8
        from_pixels = model(a, b, pixel_map, model.region_b)
        # Other labels change the regional relation.
        other = model(a, b, torch.zeros(16, dtype=torch.long), torch.zeros(16, dtype=torch.long))
    torch.testing.assert_close(same, default)
    torch.testing.assert_close(from_pixels, default)
    assert not torch.allclose(other, default)


def test_pixel_map_majority_per_patch() -> None:
    ext = ImagePatchTokens(img_size=8, patch_size=4, in_chans=1, dim=4)
    pixel_map = torch.zeros(8, 8, dtype=torch.long)
    pixel_map[:4, 4:] = 1
    pixel_map[4:, :] = 2
    pixel_map[0:3, 0:4] = -1  # 12 of 16 pixels: the patch is in no region
    pixel_map[4:5, 4:8] = 3  # 4 of 16 pixels: the majority stays 2
    assert ext.token_regions(pixel_map, 4).tolist() == [-1, 1, 2, 2]
    with pytest.raises(ValueError, match=r"labels must be in \[0, 4\)"):
        ext.token_regions(pixel_map + 5, 4)


def test_bad_region_labels_raise() -> None:
    model = small()
    a, b = inputs(2)
    ok = model.region_b
    with pytest.raises(ValueError, match=r"region_a labels must be in \[0, 4\)"):
        model(a, b, torch.full((16,), 4), ok)
    with pytest.raises(ValueError, match=r"region_b labels must be in \[0, 4\)"):
        model(a, b, model.region_a, torch.full((16,), -2))
    with pytest.raises(ValueError, match=r"region_b must have one label per token, shape \[16\]"):
        model(a, b, model.region_a, ok[:10])
    with pytest.raises(ValueError, match="image region map must be"):
        model(a, b, torch.zeros(2, 3, 16, 16, dtype=torch.long), ok)
    with pytest.raises(ValueError, match="pass both region_a and region_b"):
        model(a, b, model.region_a)
    with pytest.raises(ValueError, match="integer region labels"):
        model(a, b, model.region_a.float(), ok)
    with pytest.raises(ValueError, match="give both region_a and region_b"):
        DRRT(**SMALL, region_a=[0] * 16)
    with pytest.raises(ValueError, match="region_b must have one label per token"):
        DRRT(**SMALL, region_a=[0] * 16, region_b=[0] * 5)
    with pytest.raises(ValueError, match="num_regions=3 does not match region_grid"):
        DRRT(**SMALL, num_regions=3)


def test_explicit_default_labels_at_construction() -> None:
    labels = [0] * 8 + [1] * 8
    model = DRRT(**SMALL, region_a=labels, region_b=labels)
    assert model.regional_relation.num_regions == 2
    assert model.region_a.tolist() == labels


def test_single_modality_ignores_the_other_input() -> None:
    a, b = inputs(2)
    for side in ("a", "b"):
        model = small(inputs=side)
        assert set(model.extractors) == {side}
        assert model.interaction is None and model.global_relation is None
        with torch.no_grad():
            y = model(a, b)
            y2 = model(a * 2, b) if side == "b" else model(a, b * 2)
        torch.testing.assert_close(y, y2)
    with pytest.raises(ValueError, match="needs input 'b'"):
        small(inputs="b")(a)


def test_drt_accepts_other_image_sizes_with_explicit_regions() -> None:
    model = small(recurrence=False)
    a = torch.randn(2, 1, 24, 24)
    b = torch.randn(2, 16)
    with pytest.raises(ValueError, match="pass region_a/region_b for inputs of another size"):
        model(a, b)
    ra = grid_regions((6, 6), (2, 2))
    assert model(a, b, ra, model.region_b).shape == (2, 4)
    with pytest.raises(ValueError, match="built for 16x16 maps"):
        small()(a, b, ra, model.region_b)


def test_reset_classifier_and_pre_logits() -> None:
    model = small()
    a, b = inputs(2)
    model.reset_classifier(9)
    assert model(a, b).shape == (2, 9)
    assert model.forward_head(model.forward_features(a, b), pre_logits=True).shape == (2, 16)
    model.reset_classifier(0)
    assert model(a, b).shape == (2, model.head_hidden)


def test_literal_relation_form_still_runs() -> None:
    model = small(relation="linear")
    a, b = inputs(2)
    assert model(a, b).shape == (2, 4)


def test_bad_options_raise() -> None:
    with pytest.raises(ValueError, match="unknown fusion 'avg'"):
        DRRT(fusion="avg")
    with pytest.raises(ValueError, match="unknown relation form"):
        DRRT(relation="cosine")
    with pytest.raises(ValueError, match="unknown modality 'audio'"):
        DRRT(modality_b="audio")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="concat' needs relations='both'"):
        DRRT(fusion="concat", relations="global")
    with pytest.raises(ValueError, match="inputs must be"):
        DRRT(inputs="c")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has no option 'fuse'; did you mean fusion"):
        create_model("drrt", fuse="sum")
    with pytest.raises(ValueError, match=r"expected point measurements \[B, 16\]") as info:
        small()(inputs(2)[0], torch.randn(2, 9))
    assert "points_grid is 4x4: build it for the data's grid (--opt points_grid=N" in str(info.value)
    with pytest.raises(ValueError, match="feature_size does not apply"):
        small().example_inputs(2, feature_size=(4, 4))


@pytest.mark.slow
def test_trains_on_digits_pairs_through_the_engine(tmp_path) -> None:
    from leanformer.config import load_config
    from leanformer.engine.train import fit

    cfg = load_config(
        None,
        {
            "model": "drrt",
            "model_options.dim": 16,
            "model_options.extractor_depth": 0,
            "data.name": "digits_pairs",
            "data.limit_train": 64,
            "data.limit_test": 32,
            "data.batch_size": 32,
            "optim.epochs": 1,
        },
    )
    result = fit(cfg, out_dir=tmp_path / "run", progress=False)
    assert 0.0 <= result.metrics["top1"] <= 100.0
    assert result.model_options["num_classes"] == 10 and result.model_options["img_size"] == 32
    assert (tmp_path / "run" / "last.safetensors").exists()


@pytest.mark.slow
def test_demo_command_smoke(capsys, tmp_path) -> None:
    import argparse
    import json

    from leanformer.commands import demo_drrt

    args = argparse.Namespace(
        epochs=1, lr=1e-3, batch_size=16, models="points_only", limit_train=32, limit_test=16,
        seed=0, device="cpu", threads=None, quiet=True, json=False, out=str(tmp_path),
    )  # fmt: skip
    rows = demo_drrt.run(args)
    assert [r["model"] for r in rows] == ["drrt_points_only"] and rows[0]["params"] > 0
    assert "| drrt_points_only | points | yes | - |" in capsys.readouterr().out
    saved = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert saved == rows
    assert "| drrt_points_only | points | yes | - |" in (tmp_path / "table.md").read_text()
    args.models = "drrt,nope"
    with pytest.raises(ValueError, match="unknown --models entry nope"):
        demo_drrt.run(args)
