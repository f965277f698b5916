"""`leanformer demo sret`: sliced vs unsliced SReT vs a DeiT of similar size.

On real photographs when this install ships the weights of ``sret_fashion``,
``sret_fashion_unsliced`` and ``deit_fashion`` and Fashion-MNIST is installed: the three
shipped models on the 10,000 test images, nothing trained. Otherwise (saying why in one
line) trains the three digits models here and compares them on the digits test split.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from leanformer.bench.results import write_jsonl
from leanformer.commands._demo_out import claim_demo_folder
from leanformer.commands._fashion_demo import DemoData, evaluate_shipped, training_flags
from leanformer.commands._options import add_config_flags, config_flags_given

COMMAND = ("demo", "sret")
OUT = "runs/demo_sret"  # the default --out, a demo's own folder
HELP = (
    "a small sliced SReT, the same without slicing, and a DeiT: the shipped Fashion-MNIST models "
    "if installed, else trained here on digits; compare them"
)

# (model, what it is); the two SReTs share every weight shape, only the groups differ.
MODELS = (
    ("sret_digits", "SReT, groups [8,2][4,1][1,1]"),
    ("sret_digits_unsliced", "SReT, groups all 1"),
    ("deit_digits", "DeiT, 6 layers, dim 96"),
)
FASHION_MODELS = (
    ("sret_fashion", "SReT, groups [4,2][1,1][1,1]"),
    ("sret_fashion_unsliced", "SReT, groups all 1"),
    ("deit_fashion", "DeiT, 6 layers, dim 64"),
)
DATA = DemoData(
    "sret", fashion="fashion_mnist", digits="digits", models=tuple(name for name, _ in FASHION_MODELS)
)


# The run-config options this demo sets, with its defaults (flags as `train`'s).
TRAINING = {"optim.epochs": 15, "optim.lr": 2e-3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # 15 epochs, as `demo deit`: the DeiT is still far from converged after 8 (61% against
    # 84%), which would flatter the SReTs.
    add_config_flags(parser, *TRAINING, defaults=TRAINING)
    DATA.add_argument(parser)
    parser.add_argument(
        "--models",
        default=",".join(name for name, _ in MODELS),
        help="digits: comma-separated registered models to train and compare (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        default=OUT,
        help="run folder (one sub-folder per model), replaced by every demo run",
    )


def run(args: argparse.Namespace) -> list[dict]:
    if DATA.use_fashion(getattr(args, "data", "auto")):
        return run_fashion(args)
    return run_digits(args)


def run_fashion(args: argparse.Namespace) -> list[dict]:
    """The shipped Fashion-MNIST models on the 10,000 test images."""
    from leanformer.bench.report import trained_model_row

    default_models = ",".join(name for name, _ in MODELS)
    DATA.refuse_digits_options({**training_flags(args, TRAINING), "--models": (args.models, default_models)})
    claim_demo_folder(args.out, "sret", defaults=(OUT,))
    verbose = not args.quiet and not args.json
    notes = dict(FASHION_MODELS)
    rows = [
        {
            "demo": "sret",
            "model": name,
            "note": notes[name],
            "dataset": DATA.fashion,
            "weights": "shipped",
            **trained_model_row(model, top1, device=args.device),
        }
        for name, model, top1 in evaluate_shipped(
            DATA.models, DATA.fashion, device=args.device, progress=verbose
        )
    ]
    write_jsonl(rows, Path(args.out) / "results.jsonl")
    if not args.json:
        print_table(rows, "Fashion-MNIST test images, shipped weights")
    return rows


def run_digits(args: argparse.Namespace) -> list[dict]:
    from leanformer.bench.report import trained_model_row
    from leanformer.config import comma_list, load_config
    from leanformer.engine.train import fit
    from leanformer.models.registry import model_info

    names = comma_list(args.models)
    if not names:
        raise ValueError("--models needs at least one model name")
    notes = dict(MODELS)
    for name in names:
        model_info(name)  # unknown names fail here, before any training
    claim_demo_folder(args.out, "sret", defaults=(OUT,))
    rows = []
    for name in names:
        if not args.json and not args.quiet:
            print(f"== {name} ==")
        cfg = load_config(
            None,
            {
                "model": name,
                **config_flags_given(args, *TRAINING),
                "seed": args.seed,
                "device": args.device,
            },
        )
        out = Path(args.out) / name
        result = fit(cfg, out_dir=out, progress=not args.quiet and not args.json, overwrite=True)
        rows.append(
            {
                "demo": "sret",
                "model": name,
                "note": notes.get(name, ""),
                "dataset": "digits",
                "epochs": args.epochs,
                **trained_model_row(result.model, result.metrics["top1"], device=args.device),
                "checkpoint": str(out / "last.safetensors"),
            }
        )
    if not args.json:
        print_table(rows, f"digits test split, {args.epochs} epochs each")
    return rows


def print_table(rows: list[dict], what: str) -> None:
    from leanformer.apps.table import column, markdown_table, print_speed_note, trained_model_columns

    columns = [
        *trained_model_columns(),
        column("note"),
    ]
    print("\n" + markdown_table(rows, columns))
    threads = int(rows[0]["threads"]) if rows else 0
    print(f"({what}; img/s in eval mode at batch 64 on {threads} threads)")
    print_speed_note(rows)
