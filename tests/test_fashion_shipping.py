"""From a training run to shipped weights for the Fashion-MNIST models, as they will ship:
``tools/ship_weights.py RUN NAME --ema`` then ``create_model(NAME, pretrained=True)`` gives
the run's EMA model (BatchNorm statistics and DRRT's region buffers included). Fake
garments; nothing is written into the package."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from leanformer import create_model
from leanformer.config import load_config
from leanformer.data import build_dataset
from leanformer.engine.checkpoint import load_model
from leanformer.engine.train import fit
from leanformer.models import pretrained
from test_fashion_mnist import write_fashion

REPO = Path(__file__).resolve().parents[1]


def ship_weights_tool():
    spec = importlib.util.spec_from_file_location("ship_weights", REPO / "tools" / "ship_weights.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "data"), [("sret_fashion", "fashion_mnist"), ("drrt_fashion", "fashion_pairs")]
)
def test_a_run_ships_and_loads_as_its_ema_model(
    name: str, data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_fashion(tmp_path / "data" / "fashion-mnist", n_train=16, n_test=4, gz=False)
    monkeypatch.setenv("LEANFORMER_DATA", str(tmp_path / "data"))
    config = REPO / "configs" / f"train_{name}.yaml"
    quick = {"optim.epochs": 1, "data.batch_size": 8, "data.eval_batch_size": 8, "data.options.validation": 8}
    fit(load_config(config, quick), out_dir=tmp_path / "run", progress=False)

    tool = ship_weights_tool()
    weights = tmp_path / "weights"
    monkeypatch.setattr(tool, "WEIGHTS_DIR", weights)
    monkeypatch.setattr(pretrained, "WEIGHTS_DIR", weights)
    argv = ["ship_weights.py", str(tmp_path / "run"), name, "--ema", "--recipe", f"configs/{config.name}"]
    monkeypatch.setattr(sys, "argv", argv)
    tool.main()

    card = json.loads((weights / f"{name}.json").read_text())
    assert card["weights"] == "EMA of the weights" and card["data"]["name"] == data
    assert card["recipe"]["command"] == f"leanformer train --config configs/{config.name}"
    shipped = create_model(name, pretrained=True).eval()
    assert shipped.leanformer_missing_keys == []
    run = load_model(tmp_path / "run" / "last.safetensors", ema=True).eval()
    test = build_dataset(data, split="test")
    inputs = [test[i][0] for i in range(4)]
    batch = (
        tuple(torch.stack(parts) for parts in zip(*inputs))
        if data == "fashion_pairs"
        else (torch.stack(inputs),)
    )
    with torch.no_grad():
        torch.testing.assert_close(shipped(*batch), run(*batch), rtol=0, atol=0)
