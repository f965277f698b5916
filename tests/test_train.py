"""Training engine: resume equals an uninterrupted run; a diverged loss stops and keeps the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from leanformer.config import load_config
from leanformer.engine.checkpoint import load_checkpoint
from leanformer.engine.train import fit
from leanformer.errors import NonFiniteLossError
from leanformer.models.registry import register

QUICK = {
    "model": "deit_test",
    "model_options.drop_path_rate": "0.1",  # randomness in training, so RNG state matters
    "data.img_size": "16",
    "data.limit_train": "96",
    "data.limit_test": "64",
    "data.batch_size": "32",
    "optim.epochs": "3",
}


def _history(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _strip_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "epoch_seconds"} for r in rows]


def test_resume_matches_uninterrupted(tmp_path: Path) -> None:
    cfg = load_config(None, QUICK)
    straight = fit(cfg, out_dir=tmp_path / "a", progress=False)
    fit(cfg, out_dir=tmp_path / "b", progress=False, stop_after_epochs=1)
    assert load_checkpoint(tmp_path / "b" / "last.safetensors").meta["epoch"] == 1
    resumed = fit(cfg, out_dir=tmp_path / "b", progress=False, resume=True)
    a, b = _strip_time(_history(tmp_path / "a")), _strip_time(_history(tmp_path / "b"))
    assert len(a) == len(b) == 3
    for row_a, row_b in zip(a, b):
        for key in row_a:
            assert row_a[key] == pytest.approx(row_b[key], rel=1e-6, abs=1e-9), key
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_resume_refuses_other_model(tmp_path: Path) -> None:
    fit(load_config(None, {**QUICK, "optim.epochs": "1"}), out_dir=tmp_path, progress=False)
    other = load_config(None, {**QUICK, "model_options.depth": "2"})
    with pytest.raises(ValueError, match=r"would change model_options.depth \(absent\) -> 2"):
        fit(other, out_dir=tmp_path, progress=False, resume=True)


def test_resume_refuses_another_seed(tmp_path: Path) -> None:
    # The result of a resumed run equals an uninterrupted one only with the run's own seed.
    cfg = load_config(None, {**QUICK, "optim.epochs": "2", "seed": "3"})
    fit(cfg, out_dir=tmp_path, progress=False, stop_after_epochs=1)
    other = load_config(None, {**QUICK, "optim.epochs": "2", "seed": "4"})
    with pytest.raises(ValueError, match="would change seed 3 -> 4"):
        fit(other, out_dir=tmp_path, progress=False, resume=True)


class _Explodes(nn.Module):
    """Finite for the first ``good_steps`` training calls, then NaN."""

    def __init__(self, *, num_classes: int = 10, in_chans: int = 1, img_size: int = 16, good_steps: int = 3):
        super().__init__()
        self.num_classes = num_classes
        self.linear = nn.Linear(in_chans * img_size * img_size, num_classes)
        self.good_steps = good_steps
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x.flatten(1))
        if self.training:
            self.calls += 1
            if self.calls > self.good_steps:
                out = out * float("nan")
        return out

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def reset_classifier(self, num_classes: int) -> None:
        self.linear = nn.Linear(self.linear.in_features, num_classes)


register("_test_explodes", _Explodes, family="_test")


def test_non_finite_loss_stops_and_keeps_last_good(tmp_path: Path) -> None:
    cfg = load_config(None, {**QUICK, "model": "_test_explodes", "model_options": {}})
    with pytest.raises(NonFiniteLossError, match=r"epoch 2, step 1.*last good checkpoint"):
        fit(cfg, out_dir=tmp_path, progress=False)
    ckpt = load_checkpoint(tmp_path / "last.safetensors")
    assert ckpt.meta["epoch"] == 1
    assert all(torch.isfinite(t).all() for t in ckpt.model_state.values())
    assert len(_history(tmp_path)) == 1


def test_bad_training_options() -> None:
    with pytest.raises(ValueError, match="epochs"):
        fit(load_config(None, {**QUICK, "optim.epochs": "0"}), progress=False)
    with pytest.raises(ValueError, match="resume needs"):
        fit(load_config(None, QUICK), progress=False, resume=True)
    for key, value in (
        ("optim.min_lr", "-1"),
        ("optim.weight_decay", "-0.1"),
        ("optim.warmup_epochs", "-1"),
        ("data.eval_batch_size", "0"),
        ("optim.lr", "1e300"),  # beyond float32: the optimizer's step would fail mid-epoch
        ("optim.lr", "inf"),
    ):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            fit(load_config(None, {**QUICK, key: value}), progress=False)
    with pytest.raises(ValueError, match="latent queries"):
        fit(load_config(None, {**QUICK, "train.query_masking": "true"}), progress=False)


def test_cli_resume_uses_the_run_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`train --out RUN --resume` with no other flag continues the run as it was configured.

    The run uses a non-default seed, learning rate, epoch count and model options; none of
    them is repeated on the resume command line, yet the result equals the straight run.
    """
    from leanformer.cli import main

    flags = {**QUICK, "seed": "3", "optim.lr": "0.003", "model_options.pool": "powerbert"}
    flags["model_options.keep"] = "[24, 12, 6]"
    cfg = load_config(None, flags)
    fit(cfg, out_dir=tmp_path / "a", progress=False)
    fit(cfg, out_dir=tmp_path / "b", progress=False, stop_after_epochs=1)
    assert main(["train", "--out", str(tmp_path / "b"), "--resume", "--json"]) == 0
    a, b = _strip_time(_history(tmp_path / "a")), _strip_time(_history(tmp_path / "b"))
    assert len(a) == len(b) == 3
    for row_a, row_b in zip(a, b):
        for key in row_a:
            assert row_a[key] == pytest.approx(row_b[key], rel=1e-6, abs=1e-9), key
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "missing"), "--resume"]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    assert main(["train", "--resume", "--model", "deit_test"]) == 2
    assert "--resume needs --out" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model_options.num_classes": "5"}, "the model gives 5 class scores, but the data has 10 classes"),
        (
            {"model_options.num_classes": "12", "train.teacher": "TEACHER"},
            "student and teacher logits differ",
        ),
    ],
)
def test_a_model_or_teacher_that_does_not_fit_the_data_is_refused_before_writing(
    tmp_path: Path, overrides: dict, message: str
) -> None:
    """A batch without the highest labels passes cross-entropy, so the class count is checked
    up front; either mismatch used to fail mid-epoch, leaving a folder that blocked re-runs."""
    if overrides.get("train.teacher") == "TEACHER":  # a trained 10-class teacher
        fit(load_config(None, {**QUICK, "optim.epochs": "1"}), out_dir=tmp_path / "teacher", progress=False)
        overrides = {**overrides, "train.teacher": str(tmp_path / "teacher")}
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        fit(load_config(None, {**QUICK, **overrides}), out_dir=out, progress=False)
    assert not out.exists()
