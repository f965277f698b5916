"""`leanformer perceiver-eval`: the Visual Perceiver tables for a trained checkpoint.

Top-1 for the first K queries, the random K-subset baseline (mean/std over
repetitions), GMACs and inference time per K, and the DQS threshold sweep; markdown on
stdout, JSON lines and a plot in ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from leanformer.commands._options import (
    add_data_arguments,
    add_split_argument,
    dqs_thresholds,
    float_list,
    int_list,
)
from leanformer.commands._perceiver import load_perceiver
from leanformer.models.query_budget import query_budget

COMMAND = ("perceiver-eval",)
ACCEPTS_OVERRIDES = True  # data options: --data.options.validation 10000 for --split val
DEFAULT_KS = "1,2,4,8,16,32,48,64"
HELP = "Visual Perceiver tables: accuracy / GMACs / time per query count, random baseline, DQS sweep"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", help="a last.safetensors of a trained Visual Perceiver")
    parser.add_argument(
        "--model", help="a registered Perceiver (untrained unless --pretrained) without a checkpoint"
    )
    parser.add_argument(
        "--pretrained", action="store_true", help="with --model: the weights shipped with leanformer"
    )
    parser.add_argument(
        "--ema",
        action="store_true",
        help="with --checkpoint: the EMA of the weights a run trained with --ema kept",
    )
    add_split_argument(parser)
    parser.add_argument("--limit", type=int, help="evaluate on the first N images only")
    parser.add_argument(
        "--ks",
        type=int_list,
        default=None,
        help=f"query counts (default {DEFAULT_KS}: those below the model's query count Q, then Q)",
    )
    parser.add_argument(
        "--thresholds",
        type=dqs_thresholds,
        default=float_list("0.6,0.65,0.7,0.8,0.9,0.99"),
        help="DQS thresholds",
    )
    parser.add_argument("--dqs-rule", default="any", choices=("any", "kept"))
    parser.add_argument("--reps", type=int, default=5, help="random-subset repetitions (0: skip)")
    parser.add_argument("--time-batch", type=int, default=64, help="batch size of the timing runs (0: skip)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per K")
    parser.add_argument("--out", default="runs/perceiver_eval", help="folder for results.jsonl and plots")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the results of an earlier perceiver-eval in --out"
    )
    add_data_arguments(parser)


OUTPUTS = ("results.jsonl", "accuracy_vs_k.png")


def _check_out(out: Path, *, overwrite: bool) -> None:
    """Refuse a file, another command's run or sweep folder, and (without ``overwrite``)
    an earlier perceiver-eval's results."""
    from leanformer.engine.run_folder import held_run_files

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder for results.jsonl and the plot")
    if (out / "sweep.json").exists():
        raise ValueError(f"--out {out} holds a trade-off sweep (sweep.json); give another folder")
    if run_files := held_run_files(out):
        raise ValueError(f"--out {out} holds a training run ({', '.join(run_files)}); give another folder")
    held = [name for name in OUTPUTS if (out / name).exists()]
    if held and not overwrite:
        raise ValueError(f"--out {out} already holds {', '.join(held)}; pass --overwrite to replace them")


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from leanformer.apps.perceiver_eval import (
        COST_COLUMNS,
        DQS_COLUMNS,
        accuracy_by_k,
        cost_by_k,
        dqs_sweep,
        markdown_table,
        plot_perceiver,
        query_counts,
        random_subset_accuracy,
    )
    from leanformer.bench.results import write_jsonl
    from leanformer.data.loaders import eval_loader

    if args.reps < 0 or args.time_batch < 0 or args.runs < 1:
        raise ValueError("--reps and --time-batch must be >= 0 and --runs >= 1")
    _check_out(Path(args.out), overwrite=args.overwrite)  # before the work, not after it
    model, dataset = load_perceiver(args, split=args.split, command="perceiver-eval")
    ks = query_counts(args.ks, query_budget(model, needed_by="perceiver-eval"), int_list(DEFAULT_KS))
    loader = eval_loader(dataset, batch_size=args.batch_size or 256)
    show = not (args.quiet or args.json)
    acc = accuracy_by_k(model, loader, ks, device=args.device, progress=show)
    base = (
        random_subset_accuracy(
            model, loader, ks, reps=args.reps, seed=args.seed, device=args.device, progress=show
        )
        if args.reps
        else []
    )
    cost: list[dict[str, Any]] = []
    if args.time_batch:
        first = dataset[0][0]
        g = torch.Generator().manual_seed(args.seed)
        batch = torch.randn(args.time_batch, *first.shape, generator=g).to(args.device)
        cost = cost_by_k(model, ks, batch=batch, runs=args.runs, progress=show)
    dqs = dqs_sweep(model, loader, args.thresholds, rule=args.dqs_rule, device=args.device, progress=show)

    by_k = {r["k"]: r for r in cost}
    base_k = {r["k"]: r for r in base}
    table = []
    for r in acc:
        row: dict[str, Any] = {"table": "by_k", "k": r["k"], "top1": r["top1"]}
        if base_k:
            row.update(random_mean=base_k[r["k"]]["top1_mean"], random_std=base_k[r["k"]]["top1_std"])
        if by_k:
            row.update(
                {key: by_k[r["k"]][key] for key in ("gflops", "ms_per_batch", "rel_time", "img_per_s")}
            )
        table.append(row)
    rows = table + [{"table": "dqs", **r} for r in dqs]
    out = Path(args.out)
    write_jsonl(rows, out / "results.jsonl")
    plot = plot_perceiver(
        {"first K": acc},
        out / "accuracy_vs_k.png",
        cost=cost or None,
        baseline=base or None,
        dqs=dqs,
        title=getattr(model, "leanformer_name", ""),
    )
    if not args.json:
        columns = [("k", "K"), ("top1", "top-1 %")]
        if base_k:
            columns += [("random_mean", f"random K (mean of {args.reps})"), ("random_std", "std")]
        if by_k:
            columns += [c for c in COST_COLUMNS if c[0] != "k"]
        print(markdown_table(table, columns))
        print(f"\nDQS (rule {args.dqs_rule!r})")
        print(markdown_table(dqs, DQS_COLUMNS))
        print(f"\nresults: {out / 'results.jsonl'}, plot: {plot}")
    return rows
