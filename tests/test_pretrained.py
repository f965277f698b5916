"""Shipped weights: loaded offline, verified by SHA-256, refused clearly when absent or damaged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import leanformer
from leanformer.models import pretrained
from leanformer.models.pretrained import file_sha256, shipped_models


def ship(folder: Path, name: str, model: torch.nn.Module) -> Path:
    """Write ``model``'s weights and a card for them as the package ships them."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    card = {"model": name, "sha256": file_sha256(path), "data": {"name": "digits"}, "top1": 0.0}
    (folder / f"{name}.json").write_text(json.dumps(card))
    return path


def test_pretrained_loads_the_shipped_weights(tmp_path: Path, monkeypatch) -> None:
    torch.manual_seed(1)
    trained = leanformer.create_model("deit_test")
    ship(tmp_path, "deit_test", trained)
    monkeypatch.setattr(pretrained, "WEIGHTS_DIR", tmp_path)
    assert shipped_models() == ["deit_test"]
    torch.manual_seed(2)  # a different init: only the loaded weights can make them equal
    loaded = leanformer.create_model("deit_test", pretrained=True)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), trained(x), rtol=0, atol=0)
    # Options that do not change the weights' shapes still apply (pooling on the trained model).
    pooled = leanformer.create_model("deit_test", pretrained=True, pool="powerbert", keep=0.5)
    assert torch.equal(pooled.state_dict()["head.weight"], trained.state_dict()["head.weight"])
    with pytest.raises(ValueError, match="do not fit the options"):
        leanformer.create_model("deit_test", pretrained=True, embed_dim=48, num_heads=2)


def test_hash_mismatch_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    path = ship(tmp_path, "deit_test", leanformer.create_model("deit_test"))
    monkeypatch.setattr(pretrained, "WEIGHTS_DIR", tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one flipped bit in the last tensor's bytes; the header still parses
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="fail their SHA-256 check"):
        leanformer.create_model("deit_test", pretrained=True)


@pytest.mark.parametrize(
    ("card", "message"),
    [
        ('{"sha256": "ab', "is not valid JSON"),
        ("[1, 2]", "is not a JSON object"),
        ('{"data": {"name": "digits"}}', "has no valid sha256"),
        ('{"sha256": "xyz", "data": {"name": "digits"}}', "has no valid sha256"),
        ('{"sha256": "' + "a" * 64 + '", "data": "digits"}', r"does not name its data set \(data.name\)"),
    ],
)
def test_a_damaged_card_is_one_clear_error(tmp_path: Path, monkeypatch, card: str, message: str) -> None:
    """A card cut or edited by hand gave a raw JSONDecodeError or KeyError."""
    ship(tmp_path, "deit_test", leanformer.create_model("deit_test"))
    (tmp_path / "deit_test.json").write_text(card)
    monkeypatch.setattr(pretrained, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(ValueError, match=f"weights card deit_test.json {message}"):
        leanformer.create_model("deit_test", pretrained=True)


def test_models_without_weights_refuse_pretrained(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(pretrained, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(ValueError, match="'deit_small' has no shipped weights"):
        leanformer.create_model("deit_small", pretrained=True)


def test_every_shipped_card_matches_its_file() -> None:
    """The package's own weights: each card's hash is its file's (no test data needed)."""
    for name in shipped_models():
        card = pretrained.model_card(name)
        assert card["sha256"] == file_sha256(pretrained.WEIGHTS_DIR / f"{name}.safetensors")
        assert {"recipe", "data"} <= set(card) and ("top1" in card or "miou" in card)


def test_shipped_weights_name_their_data_and_its_options() -> None:
    """`--model NAME --pretrained` reads the data the card names, with its data options
    (segvit_fashion: fashion_detect's semantic target); options given win."""
    assert pretrained.card_data_overrides("segvit_fashion", {}) == {
        "data.name": "fashion_detect",
        "data.options.target": "semantic",
    }
    given = pretrained.card_data_overrides("deit_fashion", {"data.options.validation": 5})
    assert given == {"data.name": "fashion_mnist", "data.options.validation": 5, "data.options.augment": True}
