"""Visual Perceiver cost per query count (paper table 1) and Dynamic Query Selection overhead.

Prints markdown tables and appends JSON lines (with the machine, command and date) to
``--out``, by default ``benchmarks/results/perceiver.jsonl``:

* GMACs per image and inference time per batch for K in 1..64, and the time relative
  to K=64 (goal: K=32 at most 0.55 of K=64; the paper measured 0.46);
* DQS at a threshold whose average kept count is about ``--dqs-target`` queries: its
  time next to the fixed-K' model at the same average budget, and the share of the
  selection itself (similarities, keep mask, grouping) in the full model's time
  (goal: at most 3%).

Without ``--checkpoint`` the weights are random, so the DQS threshold is calibrated on
the batch to reach the target average (kept counts of an untrained model say nothing
about accuracy, only about cost). Run with a stable allocator, e.g.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/bench_perceiver.py
"""

from __future__ import annotations

import argparse

import torch

from leanformer import create_model
from leanformer.apps.perceiver_eval import COST_COLUMNS, cost_by_k, dqs_timing, markdown_table
from leanformer.bench.results import results_path, run_stamp, write_jsonl


def calibrate_threshold(model: torch.nn.Module, batch: torch.Tensor, target: float, rule: str) -> float:
    """Bisect t so that the batch keeps about ``target`` queries on average (more t, more kept)."""
    lo, hi = -1.0, 1.0
    with torch.inference_mode():
        for _ in range(30):
            mid = (lo + hi) / 2
            model(batch[:64], dqs_threshold=mid, dqs_rule=rule)
            if float(model.last_kept_counts.float().mean()) < target:  # type: ignore[union-attr]
                lo = mid
            else:
                hi = mid
    return hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="visual_perceiver_cifar")
    parser.add_argument("--checkpoint", help="trained weights (last.safetensors); random weights otherwise")
    parser.add_argument("--batch-size", type=int, default=128, help="images per timed batch (paper: 512)")
    parser.add_argument("--ks", default="1,2,4,8,16,32,48,64")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--dqs-threshold", type=float, help="DQS threshold (default: calibrated to --dqs-target)"
    )
    parser.add_argument(
        "--dqs-target", type=float, default=32.0, help="average kept queries to calibrate for"
    )
    parser.add_argument("--dqs-rule", default="any", choices=("any", "kept"))
    parser.add_argument("--threads", type=int, help="torch intra-op threads")
    parser.add_argument("--out", default=str(results_path("perceiver")))
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.checkpoint:
        from leanformer.engine.checkpoint import load_model

        model = load_model(args.checkpoint)
    else:
        model = create_model(args.model)
    model.eval()
    batch = torch.randn(args.batch_size, model.in_chans, *model.img_size)
    ks = [int(k) for k in args.ks.split(",")]
    env = {**run_stamp(), "model": args.model, "batch_size": args.batch_size}

    cost = cost_by_k(model, ks, batch=batch, warmup=args.warmup, runs=args.runs)
    for row in cost:
        row.update(env, bench="perceiver_cost")
    by_k = {r["k"]: r for r in cost}

    t = args.dqs_threshold
    if t is None:
        t = calibrate_threshold(model, batch, args.dqs_target, args.dqs_rule)
    dqs = dqs_timing(model, batch, t, rule=args.dqs_rule, warmup=args.warmup, runs=args.runs)
    dqs.update(env, bench="perceiver_dqs", weights="checkpoint" if args.checkpoint else "random")
    write_jsonl([*cost, dqs], args.out, append=True)

    print(f"## {args.model}: cost per query count (batch {args.batch_size}, {env['threads']} threads)\n")
    print(markdown_table(cost, [*COST_COLUMNS, ("img_per_s", "img/s")]))
    if 32 in by_k and 64 in by_k:
        ratio = by_k[32]["ms_per_batch"] / by_k[64]["ms_per_batch"]
        print(f"\ntime ratio K=32 / K=64: {ratio:.3f} (paper 0.46)")
    print(f"\n## DQS (rule {args.dqs_rule!r}, t={t:.4f}, {dqs['weights']} weights)\n")
    print(
        markdown_table(
            [dqs],
            [
                ("kept_mean", "avg kept K'"),
                ("kept_min", "min"),
                ("kept_max", "max"),
                ("groups", "distinct counts"),
                ("buckets", "attention buckets"),
                ("attention_work", "attention work / fixed"),
                ("attention_work_padded", "with padding"),
                ("ms_dqs", "DQS ms"),
                ("k_fixed", "fixed K"),
                ("ms_fixed", "fixed-K ms"),
                ("dqs_vs_fixed", "DQS / fixed"),
                ("ms_select", "selection ms"),
                ("select_share", "selection / full model"),
            ],
        )
    )
    print(f"\nJSON lines appended to {args.out}")


if __name__ == "__main__":
    main()
