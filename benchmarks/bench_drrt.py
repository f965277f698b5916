"""Inference cost of DRRT, DRT, the single-modality baselines and the relation/recurrence options.

Every model is built at the digits_pairs shapes (32x32 image in 4x4 patches + a 4x4
point grid, width 64) and measured in one process: parameters, GMACs per pair (the
papers' "GFLOPs", counted by ``leanformer.bench.flops``) and forward throughput at
``--batch``.

    python benchmarks/bench_drrt.py --threads 1 --runs 5 --warmup 2

Prints a markdown table and appends JSON lines (with the machine, command and date) to
``--out``, by default ``benchmarks/results/drrt.jsonl``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from leanformer import create_model
from leanformer.bench.flops import count_gflops
from leanformer.bench.results import results_path, run_stamp, write_jsonl
from leanformer.bench.throughput import measure_throughput

# (label, registered model, constructor overrides)
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("DRRT, sum", "drrt", {}),
    ("DRRT, maxout", "drrt_maxout", {}),
    ("DRRT, concat", "drrt_concat", {}),
    ("DRT, sum", "drt", {}),
    ("image only (+ recurrence)", "drrt_image_only", {}),
    ("points only (+ recurrence)", "drrt_points_only", {}),
    ("DRRT, dot-product relation", "drrt", {"relation": "dot"}),
    ("DRRT, literal linear relation", "drrt", {"relation": "linear"}),
    ("DRRT, identity recurrence (scan)", "drrt", {"rnn_act": "identity"}),
    ("DRRT, gelu recurrence (step loop)", "drrt", {"rnn_act": "gelu"}),
]


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default=str(results_path("drrt")))
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    stamp = run_stamp()

    rows = []
    for label, name, options in CASES:
        model = create_model(name, **options).eval()
        inputs = model.example_inputs(args.batch)
        stats = measure_throughput(model, inputs, warmup=args.warmup, runs=args.runs)
        rows.append(
            {
                **stamp,
                "bench": "drrt",
                "case": label,
                "model": name,
                "options": options,
                "params": sum(p.numel() for p in model.parameters()),
                "gflops": count_gflops(model, inputs),
                "batch": args.batch,
                "ms_per_batch": stats["ms_per_batch"],
                "pairs_per_s": stats["img_per_s"],
                "threads": int(stats["threads"]),
            }
        )

    print("| case | params | GFLOPs / pair | ms / batch | pairs / s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['case']} | {r['params']:,} | {r['gflops']:.4f} | {r['ms_per_batch']:.1f} | "
            f"{r['pairs_per_s']:.0f} |"
        )
    print(f"(batch {args.batch}, {rows[0]['threads']} threads, median of {args.runs} runs)")
    write_jsonl(rows, args.out, append=True)


if __name__ == "__main__":
    main()
