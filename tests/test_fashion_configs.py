"""The training configs of the Fashion-MNIST models: each loads, documents itself, keeps the
test images out of model selection, and trains one step on fake garments (no data set
installed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from leanformer.config import load_config
from leanformer.engine.builders import build_model, build_split
from leanformer.engine.train import fit
from test_fashion_mnist import write_fashion

REPO = Path(__file__).resolve().parents[1]
VALIDATION = 10_000
CONFIGS = {
    "train_perceiver_fashion.yaml": ("perceiver_fashion", "fashion_mnist"),
    "train_sret_fashion.yaml": ("sret_fashion", "fashion_mnist"),
    "train_sret_fashion_unsliced.yaml": ("sret_fashion_unsliced", "fashion_mnist"),
    "train_drrt_fashion.yaml": ("drrt_fashion", "fashion_pairs"),
    "train_drt_fashion.yaml": ("drt_fashion", "fashion_pairs"),
}


@pytest.fixture(scope="module")
def fake_data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``$LEANFORMER_DATA`` with fake Fashion-MNIST files: 8 training images beyond the
    configs' 10,000 validation images, and 4 test images."""
    root = tmp_path_factory.mktemp("data")
    write_fashion(root / "fashion-mnist", n_train=VALIDATION + 8, n_test=4, gz=False)
    return root


def raw(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / name).read_text())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_documents_its_command_and_chooses_on_validation(name: str) -> None:
    text = (REPO / "configs" / name).read_text()
    assert text.startswith(f"# `leanformer train --config configs/{name}")
    assert "do not ship yet" in text
    model, data = CONFIGS[name]
    cfg = load_config(REPO / "configs" / name)
    assert cfg.model == model and cfg.data.name == data
    assert cfg.data.options["validation"] == VALIDATION and cfg.train.eval_split == "val"
    assert cfg.train.ema  # the recipe's EMA, which fits every model here
    assert cfg.train.query_masking == (model == "perceiver_fashion")
    if data == "fashion_mnist":  # image augmentation fits single images only
        assert cfg.aug.randaugment and cfg.aug.reprob > 0 and cfg.data.options["augment"]


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("train_sret_fashion.yaml", "train_sret_fashion_unsliced.yaml"),
        ("train_drrt_fashion.yaml", "train_drt_fashion.yaml"),
    ],
)
def test_compared_models_share_one_recipe(one: str, other: str) -> None:
    a, b = raw(one), raw(other)
    assert a.pop("model") != b.pop("model")
    assert a == b


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_trains_one_step_on_fake_garments(
    name: str, fake_data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEANFORMER_DATA", str(fake_data_root))
    # One batch of the 8 training images, evaluated on 4 validation images.
    quick = {"optim.epochs": 1, "data.batch_size": 8, "data.eval_batch_size": 4, "data.limit_test": 4}
    cfg = load_config(REPO / "configs" / name, quick)
    train = build_split(cfg.data, "train")
    assert len(train) == 8  # the other 10,000 are the validation split
    torch.manual_seed(cfg.seed)  # fit builds its model after this seed: the initial weights
    initial, _ = build_model(cfg.model, dict(cfg.model_options), train.info)
    result = fit(cfg, out_dir=tmp_path / "run", progress=False)
    assert len(result.history) == 1 and torch.isfinite(torch.tensor(result.history[0]["train_loss"]))
    assert "top1_ema" in result.history[0]
    before = dict(initial.named_parameters())
    changed = [
        n for n, p in result.model.named_parameters() if not torch.equal(p.detach(), before[n].detach())
    ]
    assert changed, "one optimizer step changes the weights"
    assert (tmp_path / "run" / "last.safetensors").is_file()
