"""How much `leanformer bench` figures move between identical runs, by allocator setting.

    python benchmarks/bench_allocator_spread.py --repeats 10

Runs the same ``leanformer bench`` command ``--repeats`` times in each of three settings,
interleaved (A B C A B C ...), each in a fresh process:

- ``cli``: no ``MALLOC_*_`` variables; the command line sets the allocator itself
  (what a user who types ``leanformer bench`` gets);
- ``exported``: the Makefile's ``MALLOC_*_`` variables exported;
- ``glibc``: no variables and ``LEANFORMER_DEFAULT_MALLOC=1``: glibc's defaults, what the
  command line measured before it set the allocator.

Appends one JSON line per run and one summary per setting (the median, min and max img/s
and the spread ``(max - min) / min``; with the machine, command and date) to ``--out``, by
default ``benchmarks/results/allocator_spread.jsonl``, and prints the summaries.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from leanformer.allocator import SETTINGS
from leanformer.bench.results import results_path, run_stamp, write_jsonl

BENCH = ["bench", "--model", "deit_small", "--runs", "10", "--warmup", "3"]  # batch 1, the default
BENCH += ["--no-memory", "--json"]


def environment(setting: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k != "LEANFORMER_DEFAULT_MALLOC"
    }
    if setting == "exported":
        env.update({variable: str(value) for variable, _, value in SETTINGS})
    elif setting == "glibc":
        env["LEANFORMER_DEFAULT_MALLOC"] = "1"
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="runs per setting (default: 10)")
    parser.add_argument("--threads", type=int, default=None, help="--threads for bench (default: torch's)")
    parser.add_argument("--out", type=Path, default=results_path("allocator_spread"))
    args = parser.parse_args()
    command = [sys.executable, "-m", "leanformer", *BENCH]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    settings = ("cli", "exported", "glibc")
    speeds: dict[str, list[float]] = {s: [] for s in settings}
    stamp = run_stamp(threads=args.threads)
    for repeat in range(args.repeats):
        for setting in settings:
            done = subprocess.run(
                command, env=environment(setting), capture_output=True, text=True, check=True
            )
            row = {**stamp, "setting": setting, "repeat": repeat, **json.loads(done.stdout.splitlines()[-1])}
            speeds[setting].append(row["img_per_s"])
            write_jsonl([row], args.out, append=True)  # run by run: a stopped loop keeps its rows
    for setting, values in speeds.items():
        low, high = min(values), max(values)
        summary = {
            **stamp,
            "kind": "summary",
            "setting": setting,
            "runs": len(values),
            "median_img_per_s": round(statistics.median(values), 2),
            "min": round(low, 2),
            "max": round(high, 2),
            "spread": round((high - low) / low, 3),
        }
        write_jsonl([summary], args.out, append=True)
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
