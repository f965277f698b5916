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


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-epoch run folder of deit_test at 16x16."""
    from leanformer.config import load_config
    from leanformer.engine.train import fit

    flags = {"model": "deit_test", "data.img_size": "16", "data.limit_train": "16"}
    flags.update({"data.limit_test": "16", "data.batch_size": "16", "optim.epochs": "1"})
    run = tmp_path_factory.mktemp("trained") / "run"
    fit(load_config(None, flags), out_dir=run, progress=False)
    return run


def _flip_tensor_byte(path: Path) -> None:
    """Damage one byte of the tensor data, leaving the header (and so the file's form) intact."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start + (len(data) - start) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_tensor_bytes_are_refused(
    tmp_path: Path, trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from leanformer.cli import main

    path = tmp_path / "last.safetensors"
    shutil.copy(trained_run / "last.safetensors", path)
    assert load_checkpoint(path).meta["epoch"] == 1
    _flip_tensor_byte(path)
    for read in (load_checkpoint, load_model):
        with pytest.raises(ValueError, match="is damaged: its bytes have SHA-256"):
            read(path)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is damaged" in err and len(err.splitlines()) == 1


def test_a_flipped_bit_in_the_metadata_is_refused(
    tmp_path: Path, trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The digest covers the whole file: limit_test 16 -> 96 in the stored config evaluated
    another test set, exit 0, when only the tensor bytes were hashed."""
    import shutil

    from leanformer.cli import main

    path = tmp_path / "last.safetensors"
    shutil.copy(trained_run / "last.safetensors", path)
    data = bytearray(path.read_bytes())
    at = data.index(b'\\"limit_test\\": 16')  # JSON inside the JSON header: quotes escaped
    digit = at + len(b'\\"limit_test\\": ')
    data[digit] ^= 0x08  # "1" -> "9": still valid JSON, another value
    path.write_bytes(bytes(data))
    before = sorted(p.name for p in tmp_path.iterdir())
    for read in (load_checkpoint, load_model, read_checkpoint_meta):
        with pytest.raises(ValueError, match="is damaged: its bytes have SHA-256"):
            read(path)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is damaged" in err and str(path) in err and len(err.splitlines()) == 1
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_any_flipped_bit_is_refused(tmp_path: Path) -> None:
    """Every byte of a new checkpoint counts: one flipped bit at positions spread over the
    whole file (length prefix, header, padding, digest, tensors) is never loaded."""
    path = tmp_path / "last.safetensors"
    _save(path, leanformer.create_model("deit_test"), 1)
    clean = path.read_bytes()
    header_end = 8 + int.from_bytes(clean[:8], "little")
    positions = sorted({*range(0, header_end, max(1, header_end // 60)), header_end - 1, len(clean) - 1})
    positions += list(range(header_end, len(clean), max(1, (len(clean) - header_end) // 20)))
    for position in positions:
        for bit in (0x01, 0x80):
            damaged = bytearray(clean)
            damaged[position] ^= bit
            path.write_bytes(bytes(damaged))
            with pytest.raises(ValueError):
                load_checkpoint(path)


def test_checkpoints_with_a_tensor_digest_only_load_with_a_warning(trained_run: Path, tmp_path: Path) -> None:
    """Files of the previous format hashed their tensor bytes: still checked, and loaded with
    a warning that the metadata is not."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import save

    from leanformer.errors import UnverifiedCheckpointWarning

    with safe_open(str(trained_run / "last.safetensors"), framework="pt") as handle:
        header = handle.metadata()[ckpt_module.META_KEY]
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    header = header.replace("leanformer-checkpoint-2", "leanformer-checkpoint-1")
    blob = save(tensors, metadata={ckpt_module.META_KEY: header, ckpt_module.DIGEST_KEY: "0" * 64})
    start = 8 + int.from_bytes(blob[:8], "little")
    digest = hashlib.sha256(blob[start:]).hexdigest()
    old = tmp_path / "old.safetensors"
    old.write_bytes(blob.replace(b"0" * 64, digest.encode(), 1))
    assert read_checkpoint_meta(old)["epoch"] == 1
    with pytest.warns(UnverifiedCheckpointWarning, match="its metadata is not verified"):
        load_model(old)
    _flip_tensor_byte(old)
    with pytest.raises(ValueError, match="its tensor bytes have SHA-256"):
        load_model(old)


def test_checkpoints_without_a_digest_load_with_a_warning(
    tmp_path: Path, trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Files written before checksums existed: accepted, but not silently."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from leanformer.cli import main
    from leanformer.errors import UnverifiedCheckpointWarning

    path, old = trained_run / "last.safetensors", tmp_path / "run" / "last.safetensors"
    model = load_model(path)
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata()[ckpt_module.META_KEY]
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    old.parent.mkdir()
    header = header.replace("leanformer-checkpoint-2", "leanformer-checkpoint-1")  # as they were
    save_file(tensors, str(old), metadata={ckpt_module.META_KEY: header})
    assert json.loads(header)["epoch"] == 1
    with pytest.warns(UnverifiedCheckpointWarning, match="carries no SHA-256"):
        rebuilt = load_model(old)
    for key, value in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[key], value)
    # The command line shows it on one line, and takes the run folder for --checkpoint.
    assert main(["eval", "--checkpoint", str(old.parent)]) == 0
    err = capsys.readouterr().err
    assert "leanformer: warning:" in err and "carries no SHA-256" in err


def test_checkpoint_may_be_a_run_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _save(run / "last.safetensors", leanformer.create_model("deit_test"), 2)
    assert read_checkpoint_meta(run)["epoch"] == 2
    assert load_checkpoint(run).meta["epoch"] == 2
    with pytest.raises(
        ValueError, match=r"is a folder without a checkpoint \(looked for .*last\.safetensors\)"
    ):
        load_model(tmp_path)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("not json", "its leanformer metadata is damaged"),
        ("[1, 2]", "its leanformer metadata is damaged"),
        ('{"model_name": 5}', "does not name its model"),
        ('{"model_name": "deit_test", "model_options": [1]}', "its model_options are damaged"),
    ],
)
def test_damaged_metadata_is_refused_by_name(tmp_path: Path, header: str, message: str) -> None:
    """Metadata that is not a JSON object (written by hand, or cut) gave a JSONDecodeError,
    TypeError or AttributeError from deep inside; without a digest nothing else checks it."""
    import warnings

    from safetensors.torch import save_file

    path = tmp_path / "last.safetensors"
    save_file({"model.w": torch.zeros(2)}, str(path), metadata={ckpt_module.META_KEY: header})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no digest: the unverified-checkpoint warning
        with pytest.raises(ValueError, match=message):
            load_model(path)
