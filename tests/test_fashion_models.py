"""The Fashion-MNIST presets of the Perceiver, SReT and DRRT families: sizes pinned, the
issue's constraints between them, and a clear refusal of weights that do not ship yet."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leanformer import create_model
from leanformer.bench.flops import count_gflops
from leanformer.cli import main
from leanformer.data.registry import DatasetInfo
from leanformer.engine.builders import model_options_for_data
from leanformer.models import pretrained
from leanformer.models.registry import model_info

# name -> (parameters, GMACs per 28x28 image); deit_fashion is the yardstick.
SIZES = {
    "deit_fashion": (313_674, 0.0880),
    "perceiver_fashion": (921_802, 0.0605),
    "sret_fashion": (295_986, 0.0270),
    "sret_fashion_unsliced": (295_986, 0.0331),
    "drrt_fashion": (234_146, 0.0150),
    "drt_fashion": (179_786, 0.0102),
}
NEW = [name for name in SIZES if name != "deit_fashion"]
FASHION = DatasetInfo(num_classes=10, in_chans=1, img_size=28)
PAIRS = DatasetInfo(num_classes=10, in_chans=1, img_size=28, inputs=2)


def inputs(name: str, batch: int = 1) -> tuple[torch.Tensor, ...]:
    image = torch.randn(batch, 1, 28, 28)
    return (image, torch.randn(batch, 49)) if name.startswith(("drrt", "drt")) else (image,)


def params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(SIZES))
def test_sizes_are_pinned(name: str) -> None:
    model = create_model(name).eval()
    count, gmacs = SIZES[name]
    assert params(model) == count
    assert count_gflops(model, inputs(name)) == pytest.approx(gmacs, abs=5e-4)
    with torch.no_grad():
        assert model(*inputs(name, batch=2)).shape == (2, 10)


def test_the_issue_s_constraints() -> None:
    deit_params, deit_gmacs = SIZES["deit_fashion"]
    # SReT: no more parameters than deit_fashion; the unsliced model is the same network.
    assert SIZES["sret_fashion"][0] <= deit_params
    sliced, unsliced = create_model("sret_fashion"), create_model("sret_fashion_unsliced")
    assert {k: v.shape for k, v in sliced.state_dict().items()} == {
        k: v.shape for k, v in unsliced.state_dict().items()
    }
    assert _differing_defaults("sret_fashion", "sret_fashion_unsliced") == {"groups"}
    assert unsliced.groups == ((1, 1),) * 3 and sliced.attention_cost_ratio() < 1.0
    # DRRT and DRT: the same model but for recurrence (their configs: the same recipe).
    assert _differing_defaults("drrt_fashion", "drt_fashion") == {"recurrence"}
    # Every model costs at most deit_fashion's GMACs per image (trained on 2 CPU cores in
    # epochs of about 4 minutes, its card says); DRRT's GMACs leave out the relation's tanh
    # and the sequential map recurrence (see models/drrt.py).
    assert all(SIZES[name][1] <= deit_gmacs for name in NEW)


def _differing_defaults(one: str, other: str) -> set[str]:
    a, b = model_info(one).defaults, model_info(other).defaults
    return {key for key in a.keys() | b.keys() if a.get(key) != b.get(key)}


def test_perceiver_serves_fewer_queries_at_a_fraction_of_the_cost() -> None:
    model = create_model("perceiver_fashion").eval()
    (x,) = inputs("perceiver_fashion")
    full = count_gflops(model, (x,))
    half = count_gflops(model, (x,), forward_kwargs={"num_queries": 32})
    quarter = count_gflops(model, (x,), forward_kwargs={"num_queries": 16})
    assert model.num_queries == 64 and quarter < half < 0.55 * full


@pytest.mark.parametrize("name", NEW)
def test_the_data_sets_options_leave_the_presets_as_they_are(name: str) -> None:
    """``--data fashion_mnist`` / ``fashion_pairs`` fill nothing the preset does not already
    say, so shipped weights will fit the data they were trained on."""
    info = PAIRS if name.startswith(("drrt", "drt")) else FASHION
    assert model_options_for_data(name, {}, info) == {
        key: value
        for key, value in model_info(name).defaults.items()
        if key in ("num_classes", "in_chans", "img_size")
    }


@pytest.mark.parametrize("name", NEW)
def test_pretrained_without_shipped_weights_is_one_clear_line(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pretrained, "WEIGHTS_DIR", tmp_path)  # as this install: none of them ships
    with pytest.raises(ValueError) as error:
        create_model(name, pretrained=True)
    assert str(error.value) == f"model {name!r} has no shipped weights (pretrained=True works for: none)"


@pytest.mark.parametrize(("name", "data"), [("sret_fashion", "digits"), ("drrt_fashion", "digits_pairs")])
def test_eval_pretrained_without_shipped_weights_exits_2_with_one_line(
    name: str, data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(pretrained, "WEIGHTS_DIR", tmp_path)
    assert main(["eval", "--model", name, "--pretrained", "--data", data]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"leanformer: error: model {name!r} has no shipped weights (pretrained=True works for: none)"
    ]
