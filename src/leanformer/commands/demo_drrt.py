"""`leanformer demo drrt`: DRRT vs DRT, and on digits each modality alone and each fusion.

On real photographs when this install ships the ``drrt_fashion`` and ``drt_fashion``
weights and Fashion-MNIST is installed: both shipped models on the 10,000 ``fashion_pairs``
test pairs, nothing trained. Otherwise (saying why in one line) trains DRRT, DRT, the
single-modality baselines and each fusion here on ``digits_pairs``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from leanformer.bench.results import write_jsonl
from leanformer.commands._demo_out import claim_demo_folder
from leanformer.commands._fashion_demo import DemoData, evaluate_shipped, training_flags
from leanformer.commands._options import add_config_flags, config_flags_given

COMMAND = ("demo", "drrt")
OUT = "runs/demo_drrt"  # the default --out, a demo's own folder
HELP = (
    "DRRT vs DRT (accuracy, params): the shipped models on fashion_pairs if installed, else trained "
    "here on digits_pairs with single modalities and fusion methods"
)

# key -> (registered model, inputs, recurrence, fusion)
RUNS: dict[str, tuple[str, str, str, str]] = {
    "drrt": ("drrt", "image + points", "yes", "sum"),
    "drrt_maxout": ("drrt_maxout", "image + points", "yes", "maxout"),
    "drrt_concat": ("drrt_concat", "image + points", "yes", "concat"),
    "drt": ("drt", "image + points", "no", "sum"),
    "image_only": ("drrt_image_only", "image", "yes", "-"),
    "points_only": ("drrt_points_only", "points", "yes", "-"),
}
FASHION_RUNS: dict[str, tuple[str, str, str, str]] = {
    "drrt": ("drrt_fashion", "image + points", "yes", "sum"),
    "drt": ("drt_fashion", "image + points", "no", "sum"),
}
DATA = DemoData(
    "drrt",
    fashion="fashion_pairs",
    digits="digits_pairs",
    models=tuple(name for name, *_ in FASHION_RUNS.values()),
)


# The run-config options this demo sets, with its defaults (flags as `train`'s).
TRAINING = {"optim.epochs": 8, "optim.lr": 2e-3, "data.batch_size": 32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, *TRAINING, defaults=TRAINING)
    DATA.add_argument(parser)
    parser.add_argument(
        "--models",
        default=",".join(RUNS),
        help=f"digits_pairs: comma-separated subset of {', '.join(RUNS)} (default: all)",
    )
    parser.add_argument(
        "--limit-train",
        type=int,
        default=None,
        help="digits_pairs: use the first N training pairs (smoke runs)",
    )
    parser.add_argument(
        "--limit-test", type=int, default=None, help="evaluate on the first N test pairs (smoke runs)"
    )
    parser.add_argument(
        "--out", default=OUT, help="folder for results.jsonl and table.md (default: %(default)s)"
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if DATA.use_fashion(getattr(args, "data", "auto")):
        return run_fashion(args)
    return run_digits(args)


def run_fashion(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The shipped ``drrt_fashion`` and ``drt_fashion`` on the fashion_pairs test pairs."""
    DATA.refuse_digits_options(
        {
            **training_flags(args, TRAINING),
            "--models": (args.models, ",".join(RUNS)),
            "--limit-train": (args.limit_train, None),
        }
    )
    if args.limit_test is not None and args.limit_test < 1:
        raise ValueError(f"--limit-test must be >= 1, got {args.limit_test}")
    claim_demo_folder(args.out, "drrt", defaults=(OUT,))
    verbose = not args.quiet and not args.json
    results = evaluate_shipped(
        DATA.models, DATA.fashion, device=args.device, progress=verbose, limit=args.limit_test
    )
    runs = {
        name: (key, inputs, recurrence, fusion)
        for key, (name, inputs, recurrence, fusion) in FASHION_RUNS.items()
    }
    rows = []
    for name, model, top1 in results:
        rows.append({**_row(runs[name], name, model, top1), "weights": "shipped"})
    caption = f"({DATA.fashion} test split, shipped weights)"
    _write(rows, caption, Path(args.out), json_only=args.json)
    return rows


def run_digits(args: argparse.Namespace) -> list[dict[str, Any]]:
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
        row = _row((key, inputs, recurrence, fusion), name, result.model, result.metrics["top1"])
        rows.append({**row, "epochs": args.epochs, "train_seconds": seconds})
    caption = (
        f"(digits_pairs test split, {args.epochs} epochs, batch {args.batch_size}, lr {args.lr}, "
        f"seed {args.seed})"
    )
    _write(rows, caption, Path(args.out), json_only=args.json)
    return rows


def _row(run: tuple[str, str, str, str], name: str, model: Any, top1: float) -> dict[str, Any]:
    """One table row: the run's key and settings, the model's size and its top-1."""
    key, inputs, recurrence, fusion = run
    return {
        "demo": "drrt",
        "run": key,
        "model": name,
        "inputs": inputs,
        "recurrence": recurrence,
        "fusion": fusion,
        "params": sum(p.numel() for p in model.parameters()),
        "top1": top1,
    }


def _write(rows: list[dict[str, Any]], caption: str, out: Path, *, json_only: bool) -> None:
    """results.jsonl and table.md in ``out``; the table on stdout too unless ``json_only``."""
    write_jsonl(rows, out / "results.jsonl")
    (out / "table.md").write_text(f"{table(rows)}\n{caption}\n")
    if not json_only:
        print(table(rows))
        print(caption)
        print(f"results: {out / 'results.jsonl'}, table: {out / 'table.md'}")


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table (with training seconds when the rows were trained here)."""
    from leanformer.apps.table import column, markdown_table

    columns = [column("model"), column("inputs"), column("recurrence"), column("fusion")]
    columns += [
        column("params", fmt="{:,}".format, right=True),
        column("top1", "top-1 %", "{:.1f}".format, right=True),
    ]
    if rows and "train_seconds" in rows[0]:
        columns.append(column("train_seconds", "train s", "{:.0f}".format, right=True))
    return markdown_table(rows, columns)
