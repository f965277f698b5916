"""CLI: JSON output, one-line errors with exit code 2, train -> eval round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leanformer.cli import main


def _json_rows(capsys: pytest.CaptureFixture[str]) -> list[dict]:
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_models_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "deit_*", "--json"]) == 0
    rows = _json_rows(capsys)
    assert {"deit_small", "deit_tiny", "deit_test"} <= {r["model"] for r in rows}


def test_bench_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["bench", "--model", "deit_test", "--batch-size", "2", "--runs", "2", "--warmup", "1", "--json"])
        == 0
    )
    (row,) = _json_rows(capsys)
    for key in ("model", "params_m", "gflops", "img_per_s", "peak_mem_mb", "threads", "batch_size"):
        assert key in row
    assert row["gflops"] > 0 and row["img_per_s"] > 0
    assert row["threads"] == torch.get_num_threads() and isinstance(row["threads"], int)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--model", "deit_smal"], "did you mean deit_small"),
        (["bench", "--model", "deit_test", "--batch-size", "0"], "batch size"),
        (["bench", "--model", "deit_test", "--opt", "depthh=2"], "did you mean depth"),
        (["bench", "--model", "deit_test", "--bogus"], "unrecognized arguments"),
        (["bench", "--model", "deit_test", "--feature-size", "ax3"], "HxW"),
        # An empty entry used to be dropped, shifting the later budgets by one block.
        (
            ["bench", "--model", "deit_test", "--pool", "powerbert", "--keep", "12,,8"],
            "empty entry at position 2",
        ),
        (
            ["bench", "--model", "deit_test", "--pool", "powerbert", "--keep", "4,2,"],
            "empty entry at position 3",
        ),
        (
            ["bench", "--model", "deit_test", "--pool", "powerbert", "--keep", "4,x"],
            "entry 2 ('x') is neither a token count (int) nor a ratio (float)",
        ),
        (
            ["bench", "--model", "deit_test", "--pool", "powerbert", "--keep", "0.5,1.5,1"],
            "keep[1] (block 1): a keep ratio (float) must be in (0, 1], got 1.5",
        ),
        # --img-size used to be reported but unused beside --feature-size.
        (
            ["bench", "--model", "detr_encoder_test", "--feature-size", "6x7", "--img-size", "64"],
            "argument --img-size: not allowed with argument --feature-size",
        ),
        (["train", "--model", "deit_test", "--optim.lrr", "1"], "did you mean lr"),
        (["train", "--model", "deit_test", "--data", "nope"], "unknown dataset"),
        (["eval", "--checkpoint", "missing.safetensors"], "does not exist"),
        (["eval"], "--checkpoint"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc_info:
        code = main(argv)
        raise SystemExit(code)
    assert exc_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_train_then_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    argv = [
        "train",
        "--model",
        "deit_test",
        "--img-size",
        "16",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--data.limit_train",
        "64",
        "--data.limit_test",
        "32",
        "--out",
        str(run),
        "--json",
    ]
    assert main(argv) == 0
    (trained,) = _json_rows(capsys)
    assert (run / "last.safetensors").exists() and (run / "config.yaml").exists()
    assert main(["eval", "--checkpoint", str(run / "last.safetensors"), "--json"]) == 0
    (evaluated,) = _json_rows(capsys)
    assert evaluated["top1"] == pytest.approx(trained["top1"])
    assert evaluated["n"] == 32


def test_progress_bars_only_on_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Text-mode commands draw bars over their long work on a terminal; without one (a log,
    a pipe) one plain line per epoch or sweep point and nothing for inner loops; nothing
    with --quiet."""
    import io

    run = tmp_path / "run"
    train = ["train", "--model", "deit_test", "--img-size", "16", "--epochs", "1", "--out", str(run)]
    train += ["--batch-size", "16", "--data.limit_train", "32", "--data.limit_test", "32"]
    evaluate = ["eval", "--checkpoint", str(run / "last.safetensors"), "--data.limit_test", "32"]
    assert main(train) == 0
    assert main(evaluate) == 0
    lines = capsys.readouterr().err.splitlines()  # captured stderr is not a terminal
    assert len(lines) == 1 and lines[0].startswith("epochs: 1/1 top1=")
    assert main([*train, "--overwrite", "--quiet"]) == 0
    assert "epochs" not in capsys.readouterr().err

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    perceiver = ["--model", "visual_perceiver_test", "--limit", "16", "--batch-size", "8"]
    perceiver_eval = ["perceiver-eval", *perceiver, "--ks", "1,2", "--reps", "1", "--runs", "2"]
    perceiver_eval += ["--time-batch", "2", "--thresholds", "0.9", "--out", str(tmp_path / "pe")]
    attention = ["visualize", "perceiver-attention", *perceiver, "--out", str(tmp_path / "maps.png")]
    for argv, descs in (
        (evaluate, ["eval"]),
        ([*train, "--epochs", "2", "--resume"], ["epoch 2"]),
        (["bench", "--model", "deit_test", "--runs", "2"], ["timing"]),
        ([*perceiver_eval, "--overwrite"], ["accuracy by K", "K=2", "random K subsets", "timing", "t=0.9"]),
        (attention, ["attention maps"]),
    ):
        for quiet in (False, True):
            term = Terminal()
            monkeypatch.setattr("sys.stderr", term)
            assert main([*argv, "--quiet"] if quiet else argv) == 0
            monkeypatch.undo()
            for desc in descs:
                assert (desc in term.getvalue()) is not quiet, (argv[0], desc, quiet)


def test_group_without_name_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["visualize"]) == 2
    assert "clusters" in capsys.readouterr().out


def test_demo_group_has_a_default() -> None:
    from leanformer.cli import build_parser

    args = build_parser().parse_args(["demo"])
    assert args._module.COMMAND == ("demo", "tokenpool")


def test_the_default_demo_takes_its_options_without_its_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from leanformer.commands import demo_tokenpool

    seen: list[object] = []
    monkeypatch.setattr(demo_tokenpool, "run", lambda args: seen.append(args) or [])
    assert main(["demo", "--data", "digits", "--no-throughput", "--seed", "3"]) == 0
    assert main(["demo"]) == 0
    assert main(["demo", "--threads", "1", "tokenpool", "--epochs", "2"]) == 0
    typed, bare, named = seen
    assert (typed.data, typed.no_throughput, typed.seed) == ("digits", True, 3)  # type: ignore[attr-defined]
    assert (bare.data, bare.no_throughput, bare.seed) == ("auto", False, 0)  # type: ignore[attr-defined]
    assert (named.threads, named.epochs) == (1, 2)  # type: ignore[attr-defined]
    capsys.readouterr()
    # help for the group still lists its demos; a wrong option is still one line
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "perceiver" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--bogus"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == "leanformer: error: unrecognized arguments: --bogus"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_or_bad_device_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", "deit_test", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip() == (
        "leanformer: error: --device cuda: no cuda device is available on this machine"
    )
    assert main(["bench", "--model", "deit_test", "--device", "gpu"]) == 2
    assert "is not a torch device" in capsys.readouterr().err


def test_unexpected_errors_are_one_line_unless_asked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import leanformer.commands.models as models_command

    def broken(args: object) -> None:
        raise ZeroDivisionError("integer modulo by zero\nsecond line")

    monkeypatch.setattr(models_command, "run", broken)
    assert main(["models"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("leanformer: error: ZeroDivisionError: integer modulo by zero")
    monkeypatch.setenv("LEANFORMER_TRACEBACK", "1")
    with pytest.raises(ZeroDivisionError):
        main(["models"])


def test_a_reader_that_stops_early_ends_the_command_quietly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`leanformer models --json | head -1`: exit as if killed by SIGPIPE, no traceback."""
    import io
    import sys

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["models", "--json"]) == 141
    assert main(["models"]) == 141  # a table printed by the command itself
    assert capsys.readouterr().err == ""


def test_python_dash_m_runs_the_command_line() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "leanformer", "models", "deit_test", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0])["model"] == "deit_test"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ks", "0"], "query counts must be >= 1, got [0]"),
        (["--ks", "100"], "--ks [100] exceed the model's 8 latent queries"),
        (
            ["--thresholds", "nan"],
            "a DQS threshold must be a number in [-1, 1] (a cosine similarity), got nan",
        ),
        (["--thresholds", "0.5,2"], "got 2.0"),
        (["--model", "deit_test"], "demo perceiver needs a Visual Perceiver"),
    ],
)
def test_demo_perceiver_checks_its_options_before_training(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # These used to surface after both models had trained (up to minutes).
    out = tmp_path / "demo"
    argv = ["demo", "perceiver", "--model", "visual_perceiver_test", "--epochs", "1", "--out", str(out)]
    try:
        code = main([*argv, *flags])
    except SystemExit as refused:  # a flag argparse refuses by its type
        code = refused.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # nothing trained, nothing written


@pytest.mark.parametrize("demo", ["deit", "drrt", "perceiver", "sret", "tokenpool"])
def test_a_demo_refuses_a_folder_it_did_not_write(
    demo: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Demos replace their runs on every run: `--out runs` used to replace the user's
    # runs/sret_digits, which `train` itself refuses to overwrite.
    user_run = tmp_path / "runs"
    (user_run / "sret_digits").mkdir(parents=True)
    (user_run / "sret_digits" / "last.safetensors").write_bytes(b"the user's")
    assert main(["demo", demo, "--out", str(user_run)]) == 2
    assert "holds files a demo did not write" in capsys.readouterr().err
    assert (user_run / "sret_digits" / "last.safetensors").read_bytes() == b"the user's"
    assert not (user_run / ".leanformer-demo").exists()


def test_a_demo_s_default_folder_is_its_own_however_spelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A folder an older version of the demo wrote (no mark) is the demo's at its default
    # path, whether given as runs/demo_deit, ./runs/demo_deit or runs/demo_deit/.
    from leanformer.commands._demo_out import MARK, claim_demo_folder

    monkeypatch.chdir(tmp_path)
    for spelling in ("runs/demo_deit", "./runs/demo_deit", "runs/demo_deit/"):
        (tmp_path / "runs" / "demo_deit").mkdir(parents=True, exist_ok=True)
        (tmp_path / "runs" / "demo_deit" / "last.safetensors").write_bytes(b"old demo run")
        (tmp_path / "runs" / "demo_deit" / MARK).unlink(missing_ok=True)
        claim_demo_folder(spelling, "deit", defaults=("runs/demo_deit",))
        assert (tmp_path / "runs" / "demo_deit" / MARK).is_file()
    with pytest.raises(ValueError, match="holds files a demo did not write"):
        claim_demo_folder("runs", "deit", defaults=("runs/demo_deit",))
