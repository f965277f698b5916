"""Kill a training run with SIGKILL at random moments, resume it each time, and check it
ends exactly where an uninterrupted run does.

    python benchmarks/kill_resume_loop.py --epochs 400 --kills 30 --out runs/kill_loop

Trains a tiny model (``deit_test`` on 16 digits at 16x16, one batch an epoch) so that an
epoch, and its commit to the run folder, takes a fraction of a second: most kills land
while a checkpoint or metrics line is being written. After each start the script waits
until the run has finished at least one more epoch, then kills it after a random delay
of up to ``--max-delay`` seconds, and resumes it with ``train --resume``. At the end it
checks that:

- ``metrics.jsonl`` has one line per epoch (epochs 1..N, none missing or repeated) and
  equals the uninterrupted run's lines (all fields but the wall-clock ``epoch_seconds``);
- the checkpoint's weights equal the uninterrupted run's bit for bit;
- no temporary file is left in the run folder.

Prints one JSON line with the result; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from leanformer.engine.checkpoint import load_checkpoint

TRAIN_FLAGS = [
    "--model",
    "deit_test",
    "--img-size",
    "16",
    "--batch-size",
    "16",
    "--data.limit_train",
    "16",
    "--data.limit_test",
    "16",
    "--threads",
    "1",
    "--quiet",
]


def train_command(out: Path, epochs: int, *, resume: bool) -> list[str]:
    command = [sys.executable, "-m", "leanformer", "train", *TRAIN_FLAGS, "--epochs", str(epochs)]
    return [*command, "--out", str(out), *(["--resume"] if resume else [])]


def epochs_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def run_with_kills(out: Path, epochs: int, kills: int, max_delay: float, rng: random.Random) -> int:
    """Start, kill and resume until ``kills`` kills landed; then let the run finish."""
    landed = 0
    started = False
    while True:
        before = epochs_done(out)
        process = subprocess.Popen(train_command(out, epochs, resume=started), stdout=subprocess.DEVNULL)
        started = True
        if landed >= kills:
            if process.wait() != 0:
                raise RuntimeError(f"the final resume failed with exit code {process.returncode}")
            return landed
        # Kill only once this start has made progress, so every kill lands in training.
        while process.poll() is None and epochs_done(out) <= before:
            time.sleep(0.02)
        if process.poll() is None:
            time.sleep(rng.uniform(0.0, max_delay))
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            landed += 1
        elif process.returncode != 0:
            raise RuntimeError(f"training failed with exit code {process.returncode}")
        else:
            return landed  # finished before the next kill


def metric_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k != "epoch_seconds"} for row in rows]


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp") or p.is_dir())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=400)
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--max-delay", type=float, default=0.5, help="seconds (default: 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times (default: 0)")
    parser.add_argument("--out", type=Path, default=Path("runs/kill_loop"))
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    reference, killed = args.out / "uninterrupted", args.out / "killed"
    started = time.perf_counter()
    subprocess.run(train_command(reference, args.epochs, resume=False), check=True, stdout=subprocess.DEVNULL)
    landed = run_with_kills(killed, args.epochs, args.kills, args.max_delay, random.Random(args.seed))
    ref_rows, rows = metric_rows(reference), metric_rows(killed)
    ref_state = load_checkpoint(reference / "last.safetensors").model_state
    state = load_checkpoint(killed / "last.safetensors").model_state
    result = {
        "epochs": args.epochs,
        "kills": landed,
        "metrics_lines": len(rows),
        "epochs_in_order": [row["epoch"] for row in rows] == list(range(1, args.epochs + 1)),
        "metrics_equal": rows == ref_rows,
        "weights_equal": state.keys() == ref_state.keys()
        and all(torch.equal(state[k], ref_state[k]) for k in state),
        "leftover_files": leftovers(killed),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result))
    ok = (
        result["metrics_lines"] == args.epochs
        and result["epochs_in_order"]
        and result["metrics_equal"]
        and result["weights_equal"]
        and not result["leftover_files"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
