"""`leanformer demo drrt`: DRRT vs DRT vs each modality alone vs each fusion, on digits_pairs."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from leanformer.bench.results import write_jsonl
from leanformer.commands._demo_out import claim_demo_folder
from leanformer.commands._options import add_config_flags, config_flags_given

COMMAND = ("demo", "drrt")
OUT = "runs/demo_drrt"  # the default --out, a demo's own folder
HELP = "DRRT vs DRT vs single modalities vs fusion methods on the paired digits task (accuracy, params)"

# key -> (registered model, inputs, recurrence, fusion)
RUNS: dict[str, tuple[str, str, str, str]] = {
    "drrt": ("drrt", "image + points", "yes", "sum"),
    "drrt_maxout": ("drrt_maxout", "image + points", "yes", "maxout"),
    "drrt_concat": ("drrt_concat", "image + points", "yes", "concat"),
    "drt": ("drt", "image + points", "no", "sum"),
    "image_only": ("drrt_image_only", "image", "yes", "-"),
    "points_only": ("drrt_points_only", "points", "yes", "-"),
}


# The run-config options this demo sets, with its defaults (flags as `train`'s).
TRAINING = {"optim.epochs": 8, "optim.lr": 2e-3, "data.batch_size": 32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, *TRAINING, defaults=TRAINING)
    parser.add_argument(
        "--models",
        default=",".join(RUNS),
        help=f"comma-separated subset of {', '.join(RUNS)} (default: all)",
    )
    parser.add_argument(
        "--limit-train", type=int, default=None, help="use the first N training pairs (smoke runs)"
    )
    parser.add_argument(
        "--limit-test", type=int, default=None, help="use the first N test pairs (smoke runs)"
    )
    parser.add_argument(
        "--out", default=OUT, help="folder for results.jsonl and table.md (default: %(default)s)"
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from leanformer.config import comma_list, load_config
    from leanformer.engine.train import fit

    keys = comma_list(args.models)
    unknown = [k for k in keys if k not in RUNS]
    if unknown or not keys:
        raise ValueError(
            f"unknown --models entry {unknown[0] if unknown else '(empty)'}; choose from {', '.join(RUNS)}"
        )
    claim_demo_folder(args.out, "drrt", defaults=(OUT,))
    verbose = not args.quiet and not args.json
    rows = []
    for key in keys:
        name, inputs, recurrence, fusion = RUNS[key]
        overrides: dict[str, Any] = {
            "model": name,
            "data.name": "digits_pairs",
            **config_flags_given(args, *TRAINING),
            "train.checkpoint": False,
            "seed": args.seed,
            "device": args.device,
        }
        if args.limit_train is not None:
            overrides["data.limit_train"] = args.limit_train
        if args.limit_test is not None:
            overrides["data.limit_test"] = args.limit_test
        cfg = load_config(None, overrides)
        if verbose:
            print(f"training {name} ({args.epochs} epochs) ...", flush=True)
        started = time.perf_counter()
        result = fit(cfg, out_dir=None, progress=verbose)
        seconds = time.perf_counter() - started
        params = sum(p.numel() for p in result.model.parameters())
        rows.append(
            {
                "demo": "drrt",
                "run": key,
                "model": name,
                "inputs": inputs,
                "recurrence": recurrence,
                "fusion": fusion,
                "params": params,
                "top1": result.metrics["top1"],
                "epochs": args.epochs,
                "train_seconds": seconds,
            }
        )
    caption = (
        f"(digits_pairs test split, {args.epochs} epochs, batch {args.batch_size}, lr {args.lr}, "
        f"seed {args.seed})"
    )
    out = Path(args.out)
    write_jsonl(rows, out / "results.jsonl")
    (out / "table.md").write_text(f"{table(rows)}\n{caption}\n")
    if not args.json:
        print(table(rows))
        print(caption)
        print(f"results: {out / 'results.jsonl'}, table: {out / 'table.md'}")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table."""
    from leanformer.apps.table import column, markdown_table

    columns = [column("model"), column("inputs"), column("recurrence"), column("fusion")]
    columns += [
        column("params", fmt="{:,}".format, right=True),
        column("top1", "top-1 %", "{:.1f}".format, right=True),
        column("train_seconds", "train s", "{:.0f}".format, right=True),
    ]
    return markdown_table(rows, columns)
