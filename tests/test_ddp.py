"""DDP: two gloo processes under torchrun give the single-process result for the same global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ARGS = [
    "train",
    "--model",
    "deit_test",
    "--data",
    "digits",
    "--img-size",
    "16",
    "--batch-size",
    "32",
    "--epochs",
    "2",
    "--data.limit_train",
    "128",
    "--data.limit_test",
    "64",
    "--json",
    "--quiet",
]


def _run(cmd: list[str], tmp: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1, done.stdout  # only rank 0 reports
    return rows[0]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path: Path) -> None:
    single = _run([sys.executable, "-m", "leanformer.cli", *ARGS, "--out", "single"], tmp_path)
    ddp = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_port=29517",
            "-m",
            "leanformer.cli",
            *ARGS,
            "--out",
            "ddp",
        ],
        tmp_path,
    )
    assert ddp["top1"] == pytest.approx(single["top1"], abs=1e-6)
    assert ddp["train_loss"] == pytest.approx(single["train_loss"], rel=1e-4)
    assert ddp["test_loss"] == pytest.approx(single["test_loss"], rel=1e-4)
    # The single-process run holds one random state: two processes cannot resume it
    # (rank 1 used to fail with an IndexError, rank 0 on the lost connection).
    resume = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29518"]
    resume += ["-m", "leanformer.cli", "train", "--resume", "--epochs", "3", "--out", "single", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(resume, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode != 0
    assert "the run in single was trained by 1 process(es)" in done.stderr
    assert len((tmp_path / "single" / "metrics.jsonl").read_text().splitlines()) == 2  # untouched


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_match_one_process(tmp_path: Path) -> None:
    """Two torchrun "nodes" of one process each, meeting at a c10d rendezvous on loopback,
    train as one process does on the same global batch (the multi-node path of docs/cli.md)."""
    single = _run([sys.executable, "-m", "leanformer.cli", *ARGS, "--out", "single"], tmp_path)
    port = _free_port()
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    launch += [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "leanformer-test",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [*launch, "--node-rank", str(rank), "-m", "leanformer.cli", *ARGS, "--out", "nodes"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-2000:]
    rows = [json.loads(line) for out, _ in outputs for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == 1  # only the global rank 0 reports
    assert rows[0]["top1"] == pytest.approx(single["top1"], abs=1e-6)
    assert rows[0]["train_loss"] == pytest.approx(single["train_loss"], rel=1e-4)
    assert rows[0]["test_loss"] == pytest.approx(single["test_loss"], rel=1e-4)
