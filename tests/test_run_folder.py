"""Run folders: never clobbered, consistent after an interruption at any write, nothing
left behind by a command that fails its checks."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from leanformer.apps.sweep_config import sweep_config_from_dict
from leanformer.apps.tradeoff import run_sweep
from leanformer.cli import main
from leanformer.config import load_config
from leanformer.engine import checkpoint as checkpoint_module
from leanformer.engine.checkpoint import load_checkpoint
from leanformer.engine.folder_lock import locked_folder
from leanformer.engine.run_folder import RUN_FILES, remove_stale_temporaries
from leanformer.engine.train import fit
from leanformer.errors import FolderInUseError, NonFiniteLossError
from test_train import QUICK

Capture = pytest.CaptureFixture[str]
# test_train's run with one batch an epoch: an epoch costs a fraction of a second.
FAST = {**QUICK, "data.limit_train": "16", "data.limit_test": "16", "data.batch_size": "16"}
TRAIN = ["train", "--model", "deit_test", "--img-size", "16", "--batch-size", "16"]
TRAIN += ["--data.limit_train", "16", "--data.limit_test", "16", "--quiet"]


def _rows(folder: Path) -> list[dict[str, Any]]:
    text = (folder / "metrics.jsonl").read_text() if (folder / "metrics.jsonl").exists() else ""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k != "epoch_seconds"} for row in rows]


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp") or p.is_dir())


def _one_line_error(argv: list[str], capsys: Capture) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 3-epoch run."""
    out = tmp_path_factory.mktemp("reference")
    fit(load_config(None, FAST), out_dir=out, progress=False, overwrite=True)
    return out


def test_a_finished_run_is_never_replaced_silently(tmp_path: Path, capsys: Capture) -> None:
    run = tmp_path / "run"
    assert main([*TRAIN, "--epochs", "1", "--out", str(run)]) == 0
    before = (run / "metrics.jsonl").read_text()
    err = _one_line_error([*TRAIN, "--epochs", "1", "--out", str(run)], capsys)
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert (run / "metrics.jsonl").read_text() == before
    # --resume continues it; --overwrite replaces it and says so.
    assert main([*TRAIN, "--epochs", "2", "--out", str(run), "--resume"]) == 0
    assert [r["epoch"] for r in _rows(run)] == [1, 2]
    assert main(["train", *TRAIN[1:-1], "--epochs", "1", "--out", str(run), "--overwrite"]) == 0
    assert "replacing the run" in capsys.readouterr().err
    assert [r["epoch"] for r in _rows(run)] == [1]
    with pytest.raises(SystemExit, match="2"):
        main([*TRAIN, "--out", str(run), "--resume", "--overwrite"])
    assert "--overwrite: not allowed with argument --resume" in capsys.readouterr().err


def test_empty_out_is_an_error(tmp_path: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert "--out is empty" in _one_line_error([*TRAIN, "--out", ""], capsys)
    assert "--out is empty" in _one_line_error(
        ["tradeoff", "--preset", "tradeoff_digits", "--out", " "], capsys
    )
    assert list(tmp_path.iterdir()) == []


def test_failed_checks_leave_nothing_behind(tmp_path: Path, capsys: Capture) -> None:
    run = tmp_path / "run"
    # The image size fails the model's patch size: found by one forward pass, before writing.
    err = _one_line_error([*TRAIN, "--img-size", "30", "--out", str(run)], capsys)
    assert "not a multiple of the patch size" in err
    assert not run.exists()
    # A sweep checks every budget before it trains the base model.
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        "model: deit_test\nmethods: [wkmedoids, kmeans]\nbudgets: [0.5, 2]\nthroughput: false\n"
        "data: {img_size: 16, limit_train: 16, limit_test: 16, batch_size: 16}\n"
        "train: {optim: {epochs: 1}}\n"
    )
    err = _one_line_error(["tradeoff", "--config", str(sweep), "--out", str(tmp_path / "sw")], capsys)
    assert "wkmedoids at budget 2" in err
    err = _one_line_error(["tradeoff", "--config", str(sweep), "--methods", "kmeens"], capsys)
    assert "did you mean kmeans" in err
    assert not (tmp_path / "sw").exists()


def test_sweep_folder_is_not_replaced_silently(tmp_path: Path, capsys: Capture) -> None:
    out = tmp_path / "sw"
    out.mkdir()
    (out / "results.jsonl").write_text("{}\n")
    err = _one_line_error(["tradeoff", "--preset", "tradeoff_digits", "--out", str(out)], capsys)
    assert "already holds a sweep" in err and "--overwrite" in err
    assert (out / "results.jsonl").read_text() == "{}\n"


def test_nan_message_names_a_checkpoint_only_if_there_is_one(tmp_path: Path) -> None:
    cfg = load_config(None, {**FAST, "optim.lr": "1e6", "data.batch_size": "4"})
    with pytest.raises(NonFiniteLossError) as info:
        fit(cfg, out_dir=tmp_path, progress=False)
    assert "no checkpoint was written" in str(info.value)
    assert "last good" not in str(info.value) and not (tmp_path / "last.safetensors").exists()


def test_a_run_stopped_before_its_first_epoch_leaves_nothing(tmp_path: Path) -> None:
    """Its config alone would make the same command with a smaller lr need --overwrite."""
    out = tmp_path / "run"
    diverging = load_config(None, {**FAST, "optim.lr": "1e6", "data.batch_size": "4"})
    with pytest.raises(NonFiniteLossError, match="keeps nothing of this run"):
        fit(diverging, out_dir=out, progress=False)
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("the user's own file\n")
    with pytest.raises(NonFiniteLossError):
        fit(diverging, out_dir=kept, progress=False)
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
    fit(load_config(None, FAST), out_dir=out, progress=False)  # no --overwrite needed
    assert (out / "last.safetensors").is_file()


def test_a_run_that_fails_in_its_first_epoch_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    """Any failure before the first epoch commits (here the optimizer's step) discards the
    run, as a diverged loss does; a failure after it keeps the committed epochs."""
    import leanformer.engine.train as train

    def failing_step(self, *args, **kwargs):
        raise RuntimeError("the optimizer failed")

    out = tmp_path / "run"
    monkeypatch.setattr(train.torch.optim.AdamW, "step", failing_step)
    with pytest.raises(RuntimeError, match="the optimizer failed"):
        fit(load_config(None, FAST), out_dir=out, progress=False)
    assert not out.exists()
    monkeypatch.undo()
    committed = fit(load_config(None, FAST), out_dir=out, progress=False, stop_after_epochs=1)
    monkeypatch.setattr(train.torch.optim.AdamW, "step", failing_step)
    with pytest.raises(RuntimeError, match="the optimizer failed"):
        fit(load_config(None, FAST), out_dir=out, progress=False, resume=True)
    assert (out / "last.safetensors").is_file() and len(committed.history) == 1
    # A checkpoint whose history is lost (an older one without metrics.jsonl) is still a
    # committed epoch: a failure after resuming it keeps it.
    monkeypatch.setattr(train, "recover", lambda folder: [])
    with pytest.raises(RuntimeError, match="the optimizer failed"):
        fit(load_config(None, FAST), out_dir=out, progress=False, resume=True)
    assert (out / "last.safetensors").is_file() and (out / "config.yaml").is_file()


def test_files_get_the_same_permissions(tmp_path: Path, reference: Path) -> None:
    modes = {name: stat.S_IMODE((reference / name).stat().st_mode) for name in RUN_FILES}
    umask = os.umask(0)
    os.umask(umask)
    assert set(modes.values()) == {0o666 & ~umask}, modes


class _Interrupt(Exception):
    """Stands for the process dying at one step of writing the run folder."""


class _FailingOs:
    """``os`` as the checkpoint module sees it, raising at the ``fail_at``-th rename of a
    written file into place (``None``: count the renames only). Raising at any earlier
    step of a write (creating or syncing the temporary file) leaves the same state as
    raising at its rename."""

    STEPS = ("replace",)

    def __init__(self, fail_at: int | None) -> None:
        self.fail_at, self.steps = fail_at, 0

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if name not in self.STEPS:
            return real

        def step(*args: Any, **kwargs: Any) -> Any:
            if self.steps == self.fail_at:
                raise _Interrupt(f"interrupted at step {self.steps} ({name})")
            self.steps += 1
            return real(*args, **kwargs)

        return step


def test_an_interrupted_commit_leaves_a_consistent_folder(
    tmp_path: Path, reference: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interrupt every step of resuming a run at epoch 1 and committing epoch 2: the folder
    is at epoch 1 or 2 (metrics and pointer never ahead of the checkpoint), and resuming
    it gives the uninterrupted run, line for line and weight for weight."""
    cfg = load_config(None, FAST)
    at_epoch_1 = tmp_path / "epoch1"
    fit(cfg, out_dir=at_epoch_1, progress=False, stop_after_epochs=1)
    counting = _FailingOs(None)
    probe = tmp_path / "probe"
    shutil.copytree(at_epoch_1, probe)
    monkeypatch.setattr(checkpoint_module, "os", counting)
    fit(cfg, out_dir=probe, progress=False, resume=True, stop_after_epochs=1)
    steps = counting.steps
    # config.yaml; recovery's metrics.jsonl and last.json; the commit's checkpoint, last.json
    # and metrics.jsonl.
    assert steps == 6
    expected, weights = _rows(reference), load_checkpoint(reference / "last.safetensors").model_state
    for fail_at in range(steps):
        run = tmp_path / f"cut{fail_at}"
        shutil.copytree(at_epoch_1, run)
        monkeypatch.setattr(checkpoint_module, "os", _FailingOs(fail_at))
        with pytest.raises(_Interrupt):
            fit(cfg, out_dir=run, progress=False, resume=True, stop_after_epochs=1)
        monkeypatch.setattr(checkpoint_module, "os", os)
        epoch = load_checkpoint(run / "last.safetensors").meta["epoch"]
        assert epoch in (1, 2)
        assert _rows(run) in (expected[:1], expected[:epoch]), fail_at
        assert json.loads((run / "last.json").read_text())["epoch"] in (1, epoch), fail_at
        fit(cfg, out_dir=run, progress=False, resume=True)
        assert _rows(run) == expected, fail_at
        final = load_checkpoint(run / "last.safetensors").model_state
        assert all(torch.equal(final[k], weights[k]) for k in weights), fail_at
        assert json.loads((run / "last.json").read_text())["epoch"] == 3
        assert _temporaries(run) == [], fail_at


def test_stale_temporaries_are_removed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    fit(load_config(None, FAST), out_dir=run, progress=False, stop_after_epochs=1)
    stale = [checkpoint_module.temporary_name(run / name) for name in ("last.safetensors", "metrics.jsonl")]
    for path in stale:
        path.write_bytes(b"x" * 100)
    # Named like a temporary by hand, without the check only the engine computes: kept.
    (run / ".metrics.jsonl.deadbeef.tmp").write_text("the user's")
    (run / ".last.safetensors.0a1b2c3d00000000.tmp").write_text("the user's")
    (run / "tmpab12cd").mkdir()  # where checkpoints used to be staged
    (run / "tmpab12cd" / "ckpt.safetensors").write_bytes(b"x")
    (run / "notes.tmp").write_text("the user's")  # not ours: kept
    (run / "tmp_user").mkdir()
    (run / "tmp_user" / "data.txt").write_text("the user's")
    fit(load_config(None, FAST), out_dir=run, progress=False, resume=True)
    kept = [".last.safetensors.0a1b2c3d00000000.tmp", ".metrics.jsonl.deadbeef.tmp", "notes.tmp", "tmp_user"]
    assert sorted(p.name for p in run.iterdir() if p.name not in RUN_FILES) == kept
    assert remove_stale_temporaries(run) == []


def test_a_new_run_keeps_the_files_already_in_its_folder(tmp_path: Path) -> None:
    """`train --out DIR` on a folder that is not a run yet deleted a file of the user's
    named like an engine temporary."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / ".metrics.jsonl.deadbeef.tmp").write_text("the user's")
    (folder / "notes.txt").write_text("the user's")
    argv = ["train", "--model", "deit_test", "--img-size", "16", "--epochs", "1", "--batch-size", "16"]
    argv += ["--data.limit_train", "16", "--data.limit_test", "16", "--quiet", "--out", str(folder)]
    assert main(argv) == 0
    assert (folder / ".metrics.jsonl.deadbeef.tmp").read_text() == "the user's"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [".metrics.jsonl.deadbeef.tmp", "notes.txt", *RUN_FILES]
    )


def test_only_the_engine_names_its_temporaries(tmp_path: Path) -> None:
    made = checkpoint_module.temporary_name(tmp_path / "metrics.jsonl")
    assert checkpoint_module.is_temporary_of(made, "metrics.jsonl")
    assert not checkpoint_module.is_temporary_of(made, "config.yaml")
    for name in (".metrics.jsonl.deadbeef.tmp", ".metrics.jsonl.deadbeefdeadbeef.tmp", "metrics.jsonl.tmp"):
        assert not checkpoint_module.is_temporary_of(tmp_path / name, "metrics.jsonl")


@pytest.mark.slow
def test_kill_9_during_training_then_resume(tmp_path: Path, reference: Path) -> None:
    """A real SIGKILL of a training process, at a random point after its first epoch."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    command = [sys.executable, "-m", "leanformer", *TRAIN, "--threads", str(torch.get_num_threads())]
    command += ["--epochs", "3", "--opt", "drop_path_rate=0.1", "--out", str(run)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while process.poll() is None and not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    process.kill()  # SIGKILL
    process.wait()
    if (run / "last.safetensors").exists():
        completed = subprocess.run([*command, "--resume"], env=env, capture_output=True, text=True)
    else:  # killed before its first commit: a new start
        completed = subprocess.run([*command, "--overwrite"], env=env, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    rows, expected = _rows(run), _rows(reference)
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    for row, ref in zip(rows, expected, strict=True):
        assert row == pytest.approx(ref, rel=1e-5, abs=1e-7)
    weights = load_checkpoint(reference / "last.safetensors").model_state
    final = load_checkpoint(run / "last.safetensors").model_state
    for key, value in weights.items():
        torch.testing.assert_close(final[key], value, msg=key)
    assert _temporaries(run) == []


def test_a_folder_in_use_is_refused_and_left_alone(tmp_path: Path, capsys: Capture) -> None:
    """A second writer on the same --out stops at once, before it reads or writes there."""
    out = tmp_path / "run"
    fit(load_config(None, FAST), out_dir=out, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with locked_folder(out):  # as a training process holds it
        with pytest.raises(FolderInUseError, match="in use by another leanformer process"):
            fit(load_config(None, FAST), out_dir=out, progress=False, resume=True)
        err = _one_line_error([*TRAIN, "--out", str(out), "--overwrite"], capsys)
        assert "in use by another leanformer process" in err
        with pytest.raises(FolderInUseError):
            run_sweep(sweep_config_from_dict({"model": "deit_test", "budgets": [0.5]}), out_dir=out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    fit(load_config(None, FAST), out_dir=out, progress=False, resume=True)  # free again


def test_a_killed_holder_frees_its_folder(tmp_path: Path) -> None:
    """The lock belongs to the process: kill -9 releases it, so a crash never blocks a resume."""
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from leanformer.engine.folder_lock import locked_folder\n"
            "with locked_folder(Path(sys.argv[1])):\n"
            "    print('held', flush=True)\n"
            "    time.sleep(600)\n",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUseError), locked_folder(out):
            pass
    finally:
        holder.kill()
        holder.wait()
    with locked_folder(out):
        assert out.is_dir()


def test_a_refused_new_folder_leaves_no_trace(tmp_path: Path) -> None:
    out = tmp_path / "new" / "run"
    with pytest.raises(ValueError, match="resume continues the run"):
        fit(load_config(None, FAST), out_dir=out, progress=False, resume=True, overwrite=True)
    assert not out.exists() and not (tmp_path / "new").exists()


def test_only_the_writing_process_of_a_launch_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    from leanformer.engine.folder_lock import is_main_process

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "1")  # a stray RANK outside torchrun: this process writes
    assert is_main_process()
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert not is_main_process()
    monkeypatch.setenv("RANK", "0")
    assert is_main_process()


def test_an_unreachable_gflops_target_leaves_the_sweep_folder_as_it_was(
    tmp_path: Path, capsys: Capture
) -> None:
    """--overwrite clears a folder only once every budget is solved: a GFLOPs target out
    of reach used to be found after the earlier results were gone."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        "model: deit_test\nmethods: [merge]\nbudgets: [0.5]\nthroughput: false\n"
        "data: {img_size: 16, limit_train: 16, limit_test: 16, batch_size: 16}\n"
    )
    out = tmp_path / "sw"
    assert main(["tradeoff", "--config", str(sweep), "--out", str(out)]) == 0
    capsys.readouterr()  # its progress lines (stderr is not a terminal here)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    for budgets in (["--budget", "g0.01"], ["--budget", "0.7", "--budget", "g0.01"]):
        err = _one_line_error(
            ["tradeoff", "--config", str(sweep), "--out", str(out), "--overwrite", *budgets], capsys
        )
        assert "merge at 0.01x: out of reach" in err
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    # With a base model still to train, the untrained one answers first: nothing is trained.
    trained = tmp_path / "trained.yaml"
    trained.write_text(sweep.read_text() + "train: {optim: {epochs: 1}}\n")
    err = _one_line_error(
        ["tradeoff", "--config", str(trained), "--out", str(out), "--overwrite", "--budget", "g0.01"], capsys
    )
    assert "out of reach" in err and not (out / "base").exists()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
