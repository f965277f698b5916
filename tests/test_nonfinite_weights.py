"""Weights holding NaN or inf are refused by name, not evaluated into a plausible number."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leanformer.cli import main
from leanformer.engine.checkpoint import load_checkpoint, load_model, save_checkpoint
from leanformer.models.state_loading import first_nonfinite

Capture = pytest.CaptureFixture[str]
DATA = ["--img-size", "16", "--batch-size", "16", "--data.limit_train", "16", "--data.limit_test", "16"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("nonfinite") / "run"
    assert (
        main(["train", "--model", "deit_test", *DATA, "--epochs", "1", "--quiet", "--out", str(folder)]) == 0
    )
    return folder


def _rewrite(run: Path, path: Path, change) -> Path:
    """A valid checkpoint (its digest recomputed) whose model weights ``change`` edited."""
    ckpt = load_checkpoint(run / "last.safetensors")
    model = load_model(run / "last.safetensors")
    with torch.no_grad():
        change(model.state_dict())
    save_checkpoint(path, model=model, meta=ckpt.meta)
    return path


def _one_line(argv: list[str], capsys: Capture, code: int = 2) -> str:
    capsys.readouterr()
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_first_nonfinite_names_the_first_bad_tensor() -> None:
    state = {"a": torch.zeros(3), "steps": torch.tensor(5), "b": torch.tensor([1.0, float("inf")])}
    assert first_nonfinite(state) == "b"
    assert first_nonfinite({"a": torch.zeros(3)}) is None


def test_eval_and_bench_refuse_a_nan_weight(run: Path, tmp_path: Path, capsys: Capture) -> None:
    path = _rewrite(
        run, tmp_path / "nan.safetensors", lambda s: s["head.weight"].view(-1)[0].fill_(float("nan"))
    )
    before = sorted(p.name for p in tmp_path.iterdir())
    for command in (["eval", "--checkpoint", str(path)], ["bench", "--checkpoint", str(path), "--runs", "1"]):
        err = _one_line(command, capsys)
        assert f"checkpoint {path}: tensor head.weight holds NaN or inf values" in err
        assert "--allow-nonfinite" in err
    with pytest.raises(ValueError, match=r"tensor head\.weight holds NaN"):
        load_model(path)
    # Asked for explicitly, it loads (and the NaN is the user's to see).
    model = load_model(path, allow_nonfinite=True)
    assert torch.isnan(model.state_dict()["head.weight"]).any()
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(path), "--allow-nonfinite", "--json"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    err = _one_line(["eval", "--model", "deit_test", "--allow-nonfinite"], capsys)
    assert "--allow-nonfinite is for the weights of a --checkpoint" in err


def test_a_teacher_with_nan_weights_is_refused_by_name(run: Path, tmp_path: Path, capsys: Capture) -> None:
    teacher = _rewrite(
        run, tmp_path / "t.safetensors", lambda s: s["blocks.0.mlp.fc1.bias"].fill_(float("inf"))
    )
    out = tmp_path / "student"
    argv = ["train", "--model", "deit_test", *DATA, "--epochs", "1", "--quiet", "--out", str(out)]
    err = _one_line([*argv, "--teacher", str(teacher)], capsys)
    assert f"checkpoint {teacher}: tensor blocks.0.mlp.fc1.bias holds NaN or inf" in err
    assert not out.exists()


def test_a_teacher_whose_output_overflows_is_named(run: Path, tmp_path: Path, capsys: Capture) -> None:
    """Finite weights, infinite scores: the stop message blamed the learning rate."""
    # Weights of 3e38 (finite) times features of order 1, summed: the scores overflow.
    teacher = _rewrite(run, tmp_path / "t.safetensors", lambda s: s["head.weight"].fill_(3e38))
    out = tmp_path / "student"
    argv = ["train", "--model", "deit_test", *DATA, "--epochs", "1", "--quiet", "--out", str(out)]
    err = _one_line([*argv, "--teacher", str(teacher)], capsys, code=1)
    assert f"the teacher {teacher} gave NaN or inf scores at epoch 1, step 1" in err
    assert "learning rate" not in err
