"""Checkpoints: round trip, atomic writes, rebuilding the model from metadata."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import leanformer
from leanformer.engine import checkpoint as ckpt_module
from leanformer.engine.checkpoint import load_checkpoint, load_model, read_checkpoint_meta, save_checkpoint


def _save(path: Path, model: torch.nn.Module, epoch: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    opt.step()
    save_checkpoint(
        path,
        model=model,
        optimizer=opt,
        meta={"model_name": "deit_test", "model_options": {}, "epoch": epoch},
        extra={"torch_rng": [torch.get_rng_state()]},
    )


def test_round_trip(tmp_path: Path) -> None:
    model = leanformer.create_model("deit_test")
    _save(tmp_path / "last.safetensors", model, 3)
    ckpt = load_checkpoint(tmp_path / "last.safetensors")
    assert ckpt.meta["epoch"] == 3 and (tmp_path / "last.json").exists()
    for key, value in model.state_dict().items():
        assert torch.equal(ckpt.model_state[key], value)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(ckpt.optimizer_state)
    assert len(opt.state) == len(list(model.parameters()))
    rebuilt = load_model(tmp_path / "last.safetensors")
    x = torch.randn(2, 3, 16, 16)
    model.eval()
    torch.testing.assert_close(rebuilt.eval()(x), model(x))


def test_interrupted_write_keeps_last_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.safetensors"
    model = leanformer.create_model("deit_test")
    _save(path, model, 1)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_module.os, "replace", crash)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        _save(path, model, 2)
    monkeypatch.setattr(ckpt_module.os, "replace", os.replace)
    assert path.read_bytes() == before
    assert load_checkpoint(path).meta["epoch"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable"):
        load_checkpoint(junk)


def test_readers_take_only_the_tensors_they_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The metadata reader reads no tensor, ``load_model`` only the model's (not the optimizer's)."""
    path = tmp_path / "last.safetensors"
    _save(path, leanformer.create_model("deit_test"), 4)
    full = load_checkpoint(path)
    read: list[str] = []
    real_open = ckpt_module.safe_open

    class Recording:
        def __init__(self, *args, **kwargs) -> None:
            self.handle = real_open(*args, **kwargs)

        def __enter__(self):
            inner = self.handle.__enter__()

            class Handle:
                def metadata(self):
                    return inner.metadata()

                def keys(self):
                    return inner.keys()

                def get_tensor(self, key: str):
                    read.append(key)
                    return inner.get_tensor(key)

            return Handle()

        def __exit__(self, *exc) -> None:
            self.handle.__exit__(*exc)

    monkeypatch.setattr(ckpt_module, "safe_open", Recording)
    assert read_checkpoint_meta(path) == full.meta
    assert read == []
    load_model(path)
    assert sorted(read) == sorted(f"model.{k}" for k in full.model_state)
    assert full.optimizer_state  # the file does hold optimizer tensors that were skipped
    with pytest.raises(ValueError, match="does not exist"):
        read_checkpoint_meta(tmp_path / "nope.safetensors")
