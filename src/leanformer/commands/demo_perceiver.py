"""`leanformer demo perceiver`: Query Masking and Dynamic Query Selection.

On real photographs when this install ships the ``perceiver_fashion`` weights and
Fashion-MNIST is installed: top-1 of the shipped model (trained with Query Masking) on
the 10,000 test images for the first K queries, and its DQS threshold sweep; nothing is
trained. Otherwise (saying why in one line) on the bundled digits: trains the digits
Visual Perceiver twice (all queries every batch; Query Masking), then prints top-1 for
the first K queries of each model, the random K-subset baseline of the model trained
without masking, and the DQS threshold sweep of the masked model.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sized
from pathlib import Path
from typing import Any, cast

from leanformer.commands._demo_out import claim_demo_folder
from leanformer.commands._fashion_demo import DemoData, training_flags
from leanformer.commands._options import (
    add_config_flags,
    config_flags_given,
    dqs_thresholds,
    float_list,
    int_list,
)

COMMAND = ("demo", "perceiver")
OUT = "runs/demo_perceiver"  # the default --out, a demo's own folder
HELP = (
    "Query Masking and DQS: the shipped perceiver_fashion on Fashion-MNIST if both are installed, "
    "else the digits Perceiver trained with and without masking; accuracy by K and DQS"
)
DATA = DemoData("perceiver", fashion="fashion_mnist", digits="digits", models=("perceiver_fashion",))
DIGITS_MODEL = "visual_perceiver_digits"

DEFAULT_KS = "1,2,4,8,16,32,64"
DEFAULT_THRESHOLDS = "0.6,0.7,0.8,0.9,0.95,0.99"


# The run-config options this demo sets, with its defaults (flags as `train`'s).
TRAINING = {"optim.epochs": 10, "optim.lr": 1e-3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, *TRAINING, defaults=TRAINING)
    DATA.add_argument(parser)
    parser.add_argument("--model", default=DIGITS_MODEL, help="digits: a Visual Perceiver preset to train")
    parser.add_argument(
        "--ks",
        type=int_list,
        default=None,
        help=f"query counts (default {DEFAULT_KS}: those below the model's query count Q, then Q)",
    )
    parser.add_argument(
        "--thresholds",
        type=dqs_thresholds,
        default=float_list(DEFAULT_THRESHOLDS),
        help=f"DQS thresholds (default {DEFAULT_THRESHOLDS})",
    )
    parser.add_argument(
        "--dqs-rule", default="any", choices=("any", "kept"), help="DQS rule (default: the paper's)"
    )
    parser.add_argument("--reps", type=int, default=5, help="digits: random-subset repetitions (default 5)")
    parser.add_argument(
        "--out", default=OUT, help="run folder, replaced by every demo run (default: %(default)s)"
    )


def _config(args: argparse.Namespace, masking: bool) -> Any:
    from leanformer.config import load_config

    return load_config(
        None,
        {
            "model": args.model,
            **config_flags_given(args, *TRAINING),
            "train.query_masking": masking,
            "seed": args.seed,
            "device": args.device,
        },
    )


def _train(args: argparse.Namespace, masking: bool, out: Path) -> Any:
    from leanformer.engine.train import fit

    cfg = _config(args, masking)
    return cfg, fit(cfg, out_dir=out, progress=not args.quiet and not args.json, overwrite=True)


def _check_before_training(args: argparse.Namespace) -> list[int]:
    """The model, query counts and thresholds, checked before two trainings, not after:
    returns the query counts of the tables."""
    from leanformer.apps.perceiver_eval import query_counts
    from leanformer.engine.builders import build_model, build_split
    from leanformer.models.query_budget import query_budget
    from leanformer.ops.query_selection import check_threshold

    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    cfg = _config(args, False)
    info = build_split(cfg.data, "test").info  # type: ignore[attr-defined]
    model, _ = build_model(cfg.model, dict(cfg.model_options), info)
    ks = query_counts(args.ks, query_budget(model, needed_by="demo perceiver"), int_list(DEFAULT_KS))
    for threshold in args.thresholds:
        check_threshold(threshold)
    return ks


def run(args: argparse.Namespace) -> list[dict]:
    if DATA.use_fashion(getattr(args, "data", "auto")):
        return run_fashion(args)
    return run_digits(args)


def run_fashion(args: argparse.Namespace) -> list[dict]:
    """The shipped ``perceiver_fashion`` on the Fashion-MNIST test images: top-1 by K and DQS."""
    from leanformer.apps.perceiver_eval import (
        DQS_COLUMNS,
        accuracy_by_k,
        dqs_sweep,
        markdown_table,
        plot_perceiver,
        query_counts,
    )
    from leanformer.bench.results import write_jsonl
    from leanformer.config import load_config
    from leanformer.data.loaders import eval_loader
    from leanformer.engine.builders import build_model, build_split
    from leanformer.models.query_budget import query_budget
    from leanformer.ops.query_selection import check_threshold

    (name,) = DATA.models
    DATA.refuse_digits_options(
        {**training_flags(args, TRAINING), "--model": (args.model, DIGITS_MODEL), "--reps": (args.reps, 5)}
    )
    for threshold in args.thresholds:
        check_threshold(threshold)
    cfg = load_config(None, {"model": name, "data.name": DATA.fashion, "device": args.device})
    dataset = build_split(cfg.data, "test")
    model, _ = build_model(name, {}, dataset.info, pretrained=True)  # type: ignore[attr-defined]
    ks = query_counts(args.ks, query_budget(model, needed_by="demo perceiver"), int_list(DEFAULT_KS))
    out = Path(args.out)
    claim_demo_folder(out, "perceiver", defaults=(OUT,))
    started = time.perf_counter()
    model = model.to(args.device).eval()
    loader = eval_loader(dataset, batch_size=500)
    k_rows = accuracy_by_k(model, loader, ks, device=args.device)
    dqs_rows = dqs_sweep(model, loader, args.thresholds, rule=args.dqs_rule, device=args.device)
    rows: list[dict[str, Any]] = [
        {"table": "accuracy_by_k", "model": name, "k": r["k"], "top1_query_masking": r["top1"]}
        for r in k_rows
    ]
    rows += [{"table": "dqs", "model": name, **r} for r in dqs_rows]
    write_jsonl(rows, out / "results.jsonl")
    plot = plot_perceiver(
        {"Query Masking (first K)": k_rows},
        out / "accuracy_vs_k.png",
        dqs=dqs_rows,
        title=f"{name} (shipped weights) on Fashion-MNIST",
    )
    if not args.json:
        images = len(cast(Sized, dataset))
        print(
            f"\nTop-1 % of the shipped {name} (trained with Query Masking) on {images} "
            "Fashion-MNIST test images"
        )
        print(markdown_table(k_rows, [("k", "K"), ("top1", "first K queries")]))
        print(f"\nDynamic Query Selection (rule {args.dqs_rule!r})")
        print(markdown_table(dqs_rows, DQS_COLUMNS))
        print(
            f"\nresults: {out / 'results.jsonl'}, plot: {plot}; {time.perf_counter() - started:.0f} s in all"
        )
    return rows


def run_digits(args: argparse.Namespace) -> list[dict]:
    from leanformer.apps.perceiver_eval import (
        DQS_COLUMNS,
        accuracy_by_k,
        dqs_sweep,
        markdown_table,
        plot_perceiver,
        random_subset_accuracy,
    )
    from leanformer.bench.results import write_jsonl
    from leanformer.data.loaders import eval_loader
    from leanformer.engine.builders import build_split

    ks = _check_before_training(args)
    out = Path(args.out)
    claim_demo_folder(out, "perceiver", defaults=(OUT,))
    started = time.perf_counter()
    cfg, fixed = _train(args, False, out / "fixed")
    _, masked = _train(args, True, out / "query_masking")
    loader = eval_loader(build_split(cfg.data, "test"), batch_size=cfg.data.eval_batch_size)
    fixed_rows = accuracy_by_k(fixed.model, loader, ks, device=args.device)
    masked_rows = accuracy_by_k(masked.model, loader, ks, device=args.device)
    random_rows = random_subset_accuracy(
        fixed.model, loader, ks, reps=args.reps, seed=args.seed, device=args.device
    )
    dqs_rows = dqs_sweep(masked.model, loader, args.thresholds, rule=args.dqs_rule, device=args.device)

    rows: list[dict[str, Any]] = []
    for f, r, m in zip(fixed_rows, random_rows, masked_rows, strict=True):
        rows.append(
            {
                "table": "accuracy_by_k",
                "k": f["k"],
                "top1_fixed": f["top1"],
                "top1_fixed_random_mean": r["top1_mean"],
                "top1_fixed_random_std": r["top1_std"],
                "top1_query_masking": m["top1"],
            }
        )
    rows += [{"table": "dqs", **r} for r in dqs_rows]
    write_jsonl(rows, out / "results.jsonl")
    plot = plot_perceiver(
        {"trained with all queries (first K)": fixed_rows, "Query Masking (first K)": masked_rows},
        out / "accuracy_vs_k.png",
        baseline=random_rows,
        dqs=dqs_rows,
        title=f"{args.model} on digits",
    )
    if not args.json:
        images = len(cast(Sized, loader.dataset))
        print(f"\nTop-1 % on the digits test split ({images} images), {args.epochs} epochs each")
        print(
            markdown_table(
                rows[: len(fixed_rows)],
                [
                    ("k", "K"),
                    ("top1_fixed", "no masking, first K"),
                    ("top1_fixed_random_mean", f"no masking, random K (mean of {args.reps})"),
                    ("top1_fixed_random_std", "std"),
                    ("top1_query_masking", "Query Masking, first K"),
                ],
            )
        )
        print(f"\nDynamic Query Selection on the Query Masking model (rule {args.dqs_rule!r})")
        print(markdown_table(dqs_rows, DQS_COLUMNS))
        print(
            f"\nresults: {out / 'results.jsonl'}, plot: {plot}; {time.perf_counter() - started:.0f} s in all"
        )
    return rows
