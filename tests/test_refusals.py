"""Values that make no sense are refused (exit 2, one line), and messages say what happened."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import leanformer
from leanformer.cli import main
from leanformer.engine.checkpoint import load_checkpoint

Capture = pytest.CaptureFixture[str]
TRAIN = ["train", "--model", "deit_test", "--img-size", "16", "--batch-size", "16"]
TRAIN += ["--data.limit_train", "16", "--data.limit_test", "16", "--quiet"]


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _one_line(argv: list[str], capsys: Capture, code: int = 2) -> str:
    capsys.readouterr()
    try:
        assert main(argv) == code
    except SystemExit as exit_:  # argparse's own refusals
        assert exit_.code == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["eval", "--model", "visual_perceiver_test", "--dqs-threshold", "5"],
            "a DQS threshold must be a number in [-1, 1] (a cosine similarity), got 5.0",
        ),
        (
            ["perceiver-eval", "--model", "visual_perceiver_test", "--thresholds", "0.5,2"],
            "a DQS threshold must be a number in [-1, 1] (a cosine similarity), got 2.0",
        ),
        (
            [*TRAIN, "--optim.min_lr", "0.5"],
            "optim.min_lr (0.5) must not exceed the peak optim.lr (0.001)",
        ),
        (
            ["tradeoff", "--preset", "configs/tradeoff_digits.yaml"],
            "--preset 'configs/tradeoff_digits.yaml' looks like a file; --preset names a sweep in configs/",
        ),
        (
            ["bench", "--hf-model", "ViTModel", "--opt", "hidden_size=-1", "--runs", "1"],
            "ViTModel (transformers) cannot be built with the options hidden_size=-1",
        ),
        (
            ["bench", "--model", "deit_test", "--pool", "merge", "--keep", "r-3"],
            "keep 'r-3': ToMe's form r<N> removes a whole number N >= 0 of tokens per block",
        ),
        (["models", "deit_tset"], "unknown model 'deit_tset'; did you mean deit_test"),
    ],
)
def test_values_that_make_no_sense_are_refused(
    argv: list[str], message: str, tmp_path: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may be written, wherever the command would write
    err = _one_line(
        [*argv, "--out", str(tmp_path / "out")] if argv[0] in ("train", "tradeoff") else argv, capsys
    )
    assert message in err
    assert _files(tmp_path) == []


def test_the_model_refuses_a_threshold_outside_the_cosine_range() -> None:
    model = leanformer.create_model("visual_perceiver_test").eval()
    images = torch.randn(2, 3, 32, 32)
    for bad in (5.0, -1.5, float("nan")):
        with pytest.raises(ValueError, match=r"dqs_threshold must be a number in \[-1, 1\]"):
            model(images, dqs_threshold=bad)


def test_a_symlink_loop_as_out_is_named(tmp_path: Path, capsys: Capture) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for out in (loop, loop / "run"):
        err = _one_line([*TRAIN, "--epochs", "1", "--out", str(out)], capsys)
        assert f"{loop} is a symbolic link that" in err and "File exists" not in err
    assert _files(tmp_path) == ["loop"]


def test_a_full_disk_names_the_file_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    assert main([*TRAIN, "--epochs", "1", "--out", str(run)]) == 0
    good = (run / "last.safetensors").read_bytes()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        # The disk fills up while the next checkpoint is written.
        if ".last.safetensors." in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    err = _one_line(["train", "--out", str(run), "--resume", "--epochs", "2", "--quiet"], capsys, code=1)
    assert f"no space left on the device writing {run / 'last.safetensors'}" in err
    assert "keeps its last complete version" in err and "--resume" in err
    assert (run / "last.safetensors").read_bytes() == good
    assert load_checkpoint(run / "last.safetensors").meta["epoch"] == 1
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]
