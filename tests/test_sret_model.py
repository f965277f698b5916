"""SReT models: paper parameter counts and FLOPs, any input size, determinism, options."""

from __future__ import annotations

import pytest
import torch

from leanformer import create_model, list_models
from leanformer.bench.flops import count_gflops
from leanformer.layers.sliced_attention import SlicedBlock
from leanformer.models.sret import SReT


def num_params(name: str, **overrides: object) -> float:
    # The meta device builds the structure without allocating or initialising weights.
    with torch.device("meta"):
        model = create_model(name, **overrides)
    return sum(p.numel() for p in model.parameters()) / 1e6


@pytest.mark.parametrize(
    ("name", "paper"),
    [("sret_tiny", 4.76), ("sret_tiny_large", 4.99), ("sret_small", 20.9), ("sret_base", 71.2)],
)
def test_parameter_counts_match_table_7(name: str, paper: float) -> None:
    assert abs(num_params(name) - paper) / paper < 0.01


def test_unsliced_variant_has_the_same_parameters() -> None:
    assert num_params("sret_tiny_unsliced") == num_params("sret_tiny")
    assert num_params("sret_tiny_large_unsliced") == num_params("sret_tiny_large")


def test_tiny_gflops_match_table_2() -> None:
    """Supplement table 2: SReT-T [8,2][4,1][1,1] 1.12 GFLOPs, unsliced SReT-*T 1.38."""
    x = torch.randn(1, 3, 224, 224)
    sliced = count_gflops(create_model("sret_tiny"), (x,))
    full = count_gflops(create_model("sret_tiny_unsliced"), (x,))
    assert sliced == pytest.approx(1.12, rel=0.03)
    assert full == pytest.approx(1.38, rel=0.03)


@pytest.mark.slow
def test_small_gflops_match_paper() -> None:
    x = torch.randn(1, 3, 224, 224)
    assert count_gflops(create_model("sret_small"), (x,)) == pytest.approx(4.2, rel=0.03)


def test_structure_of_tiny() -> None:
    with torch.device("meta"):
        model = create_model("sret_tiny")
    assert isinstance(model, SReT)
    assert [len(s.blocks) for s in model.stages] == [2, 5, 3]
    assert [s.depth for s in model.stages] == [4, 10, 6]
    assert [len(s.nlls) for s in model.stages] == [4, 10, 6]
    assert model.pos_embed.shape == (1, 64, 28, 28)
    assert model.stage_grids((224, 224)) == [(28, 28), (14, 14), (7, 7)]
    first: SlicedBlock = model.stages[0].blocks[0]
    assert first.groups == (8, 2) and first.permute == (False, True)
    assert model.stages[1].blocks[0].groups == (4, 1)
    # P+I-L: no permutation in the last stage.
    assert model.stages[2].blocks[0].permute == (False, False)
    for pool, (cin, cout) in zip(model.pools, [(64, 128), (128, 256)]):
        assert pool.in_channels == cin and pool.out_channels == cout and pool.groups == cin


@pytest.mark.parametrize(
    ("mode", "permute", "inverse"),
    [("P", (True, True, True), False), ("P+I", (True, True, True), True), ("none", (False,) * 3, True)],
)
def test_permutation_modes(mode: str, permute: tuple[bool, ...], inverse: bool) -> None:
    model = create_model("sret_test", permutation=mode)
    for stage, expected in zip(model.stages, permute):
        blk = stage.blocks[0]
        assert blk.permute == (False, expected) and blk.inverse == inverse


def test_none_modes_given_on_the_command_line() -> None:
    # `--opt permutation=none --opt lrc=none` read as YAML's null: they are the "none"
    # ablations (no permutation, no learnable residual coefficients), not an error.
    from leanformer.cli import main
    from leanformer.layers.residual_coeffs import LearnableResidual

    assert main(["bench", "--model", "sret_test", "--opt", "permutation=none", "--opt", "lrc=none",
                 "--runs", "1", "--warmup", "0", "--no-memory", "--quiet"]) == 0  # fmt: skip
    model = create_model("sret_test", permutation=None, lrc=None)
    assert model.permutation == "none" and not any(b.permute[1] for s in model.stages for b in s.blocks)
    residuals = [m for m in model.modules() if isinstance(m, LearnableResidual)]
    assert residuals and all(m.mode == "none" for m in residuals)
    assert not any(p.numel() for m in residuals for p in m.parameters())


def test_eval_is_deterministic_and_batch_independent() -> None:
    torch.manual_seed(0)
    model = create_model("sret_test").eval()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        a = model(x)
        torch.manual_seed(123)
        b = model(x)
        single = torch.cat([model(x[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, single, rtol=1e-5, atol=1e-5)


def test_training_mode_permutation_is_random() -> None:
    torch.manual_seed(0)
    model = create_model("sret_test").train()
    for m in model.modules():  # BatchNorm statistics would differ too: freeze them
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert not torch.allclose(model(x), model(x))


def test_permutation_is_invisible_without_slicing() -> None:
    """With one group everywhere, permutation + inverse (P+I) changes nothing."""
    torch.manual_seed(0)
    plain = create_model("sret_test", groups=((1, 1),) * 3, permutation="none").eval()
    perm = create_model("sret_test", groups=((1, 1),) * 3, permutation="P+I").eval()
    perm.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(perm(x), plain(x))


def test_any_input_size_interpolates_position_embedding() -> None:
    model = create_model("sret_test").eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 32, 32)).shape == (1, 5)
        assert model(torch.randn(1, 3, 16, 32)).shape == (1, 5)


def test_indivisible_token_count_raises() -> None:
    model = create_model("sret_test")
    # 12x12 input -> 6x6 = 36 tokens in stage 1, not divisible by 8 groups.
    with pytest.raises(ValueError, match=r"6x6 token grid \(36 tokens\) in stage 1"):
        model(torch.randn(1, 3, 12, 12))
    with pytest.raises(ValueError, match="expected images"):
        model(torch.randn(3, 16, 16))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(groups=((8, 2), (4, 1))), "one entry per stage"),
        (dict(groups=((8, 2, 1), (4, 1), (1, 1))), "one entry per loop"),
        (dict(groups=((0, 2), (4, 1), (1, 1))), r"groups\[0\]\[0\] must be an integer >= 1, got 0"),
        (dict(permutation="PI"), "permutation must be one of"),
        (dict(lrc="all"), "lrc must be one of"),
        (dict(embed_dims=(16, 24, 48)), "multiple of embed_dims"),
        (dict(num_heads=(3, 2, 4)), "must be divisible by num_heads"),
        (dict(stem_chs=(8,)), "stem_chs"),
        (dict(loops=0), "loops"),
    ],
)
def test_bad_options_raise(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        create_model("sret_test", **overrides)


def test_unknown_option_raises() -> None:
    with pytest.raises(ValueError, match="did you mean"):
        create_model("sret_test", nll_ration=1.0)


def test_lrc_variants_change_parameter_count() -> None:
    both, skip, none = (num_params("sret_test", lrc=m) for m in ("both", "skip", "none"))
    # sret_test: 3 unique blocks (4 coefficients each) and 6 NLLs (2 each) = 24 scalars.
    assert round((both - none) * 1e6) == 24 and round((both - skip) * 1e6) == 12


def test_loops_and_unique_are_configurable() -> None:
    model = create_model("sret_test", loops=3, groups=((8, 2, 1), (4, 1, 1), (1, 1, 1)), unique=(2, 1, 1))
    assert [s.depth for s in model.stages] == [6, 3, 3]
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 5)


def test_head_and_classifier_reset() -> None:
    model = create_model("sret_test")
    feats = model.forward_features(torch.randn(2, 3, 16, 16))
    assert feats.shape == (2, 4, 64)  # 2x2 grid in stage 3, 64 channels
    assert model.forward_head(feats, pre_logits=True).shape == (2, 64)
    model.reset_classifier(7)
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 7)
    model.reset_classifier(0)
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 64)


def test_attention_cost_ratio_and_bench_extras() -> None:
    with torch.device("meta"):
        sliced, full = create_model("sret_tiny"), create_model("sret_tiny_unsliced")
    assert full.attention_cost_ratio() == 1.0
    # Stage 1 (784 tokens) dominates: (1/8 + 1/2) / 2 there.
    assert 0.3 < sliced.attention_cost_ratio() < 0.7
    extras = sliced.bench_extras()
    assert extras["groups"] == [[8, 2], [4, 1], [1, 1]] and extras["depth"] == 20


def test_family_is_registered() -> None:
    names = set(list_models(family="sret"))
    assert {"sret_tiny", "sret_tiny_large", "sret_small", "sret_base", "sret_tiny_unsliced"} <= names
    assert {"sret_digits", "sret_tiny_32", "sret_test"} <= names
    assert list_models(family="sret", tiny=True) == ["sret_test"]


@pytest.mark.parametrize("name", ["sret_test", "sret_digits"])
def test_contract_forward_gradients(name: str) -> None:
    torch.manual_seed(0)
    model = create_model(name)
    chans = model.stem.layers[0].in_channels
    x = torch.randn(2, chans, *model.img_size)
    out = model(x)
    assert out.shape == (2, model.num_classes) and torch.isfinite(out).all()
    out.square().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing
