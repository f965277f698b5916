"""DeiT baselines: parameters, GFLOPs (multiply-adds), throughput and peak memory.

    python benchmarks/bench_deit.py --batch-size 32 --runs 5

Prints a markdown table and appends one JSON line per model (with the machine, command and
date) to ``--out``, by default ``benchmarks/results/deit.jsonl``.
"""

from __future__ import annotations

import argparse
import platform

import torch

import leanformer
from leanformer.bench.report import bench_model, example_inputs
from leanformer.bench.results import results_path, run_stamp, write_jsonl

MODELS = ("deit_tiny", "deit_e252", "deit_e318", "deit_small")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=str(results_path("deit")))
    args = parser.parse_args()
    stamp = run_stamp()
    cpu = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu}")
    print(f"| model | params (M) | GFLOPs | img/s (batch {args.batch_size}) | peak memory (MB) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in args.models:
        torch.manual_seed(0)
        model = leanformer.create_model(name).eval()
        inputs = example_inputs(model, args.batch_size)
        figures = bench_model(model, inputs, runs=args.runs)
        row = {**stamp, "model": name, "batch_size": args.batch_size, **figures}
        write_jsonl([row], args.out, append=True)  # model by model: a stopped run keeps what it measured
        print(
            f"| {name} | {row['params_m']:.2f} | {row['gflops']:.3f} | {row['img_per_s']:.1f} "
            f"| {row['peak_mem_mb']:.0f} |"
        )


if __name__ == "__main__":
    main()
