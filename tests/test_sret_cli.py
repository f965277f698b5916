"""`leanformer demo sret` and `leanformer bench` with SReT models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from leanformer.cli import main


def test_bench_reports_sret_extras(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--model", "sret_test", "--batch-size", "2", "--runs", "1", "--warmup", "0", "--json"]
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["model"] == "sret_test" and row["groups"] == [[8, 2], [4, 1], [1, 1]]
    assert row["params_m"] > 0 and row["gflops"] > 0 and row["depth"] == 6


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "sret", "--epochs", "0"])
    assert exit_.value.code == 2
    assert "argument --epochs: must be >= 1, got 0" in capsys.readouterr().err
    assert main(["demo", "sret", "--models", "sret_nope"]) == 2
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "sret", "--epochs", "1", "--models", "sret_test", "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["model"] == "sret_test" and 0.0 <= row["top1"] <= 100.0
    assert (tmp_path / "sret_test" / "last.safetensors").exists()
