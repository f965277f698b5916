"""Config: YAML files, dotted overrides, and clear errors for unknown keys or bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from leanformer.config import RunConfig, apply_overrides, load_config
from leanformer.pooling.budgets import parse_keep


def test_yaml_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: deit_test\noptim:\n  lr: 0.01\n  epochs: 3\nmodel_options:\n  depth: 2\n")
    cfg = load_config(path, {"optim.lr": "3e-4", "model_options.keep": "[4, 2]", "train.grad_clip": "none"})
    assert cfg.model == "deit_test" and cfg.optim.epochs == 3
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.model_options == {"depth": 2, "keep": parse_keep([4, 2])}
    assert cfg.train.grad_clip is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"optim.lrr": "1"}, "did you mean lr"),
        ({"optim.lr": "fast"}, "optim.lr expects a number"),
        ({"data.batch_size": "1.5"}, "expects an integer"),
        ({"nothing.here": "1"}, "unknown config key 'nothing'"),
        ({"train.query_masking": "3"}, "true/false"),
    ],
)
def test_bad_overrides(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        apply_overrides(RunConfig(), overrides)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("optim:\n  learning_rate: 1\n")
    with pytest.raises(ValueError, match=r"optim\.learning_rate"):
        load_config(unknown)


def test_presets_in_configs_folder_load() -> None:
    folder = Path(__file__).resolve().parents[1] / "configs"
    presets = sorted(folder.glob("train_*.yaml"))  # run presets; sweep presets have their own schema
    assert presets
    for preset in presets:
        load_config(preset)
