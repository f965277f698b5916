"""`leanformer demo sret`: sliced vs unsliced SReT vs a DeiT of similar size on digits."""

from __future__ import annotations

import argparse
from pathlib import Path

from leanformer.commands._demo_out import claim_demo_folder
from leanformer.commands._options import add_config_flags, config_flags_given

COMMAND = ("demo", "sret")
OUT = "runs/demo_sret"  # the default --out, a demo's own folder
HELP = "train a small sliced SReT, the same without slicing, and a DeiT on digits; compare them"

# (model, what it is); the two SReTs share every weight shape, only the groups differ.
MODELS = (
    ("sret_digits", "SReT, groups [8,2][4,1][1,1]"),
    ("sret_digits_unsliced", "SReT, groups all 1"),
    ("deit_digits", "DeiT, 6 layers, dim 96"),
)


# The run-config options this demo sets, with its defaults (flags as `train`'s).
TRAINING = {"optim.epochs": 15, "optim.lr": 2e-3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # 15 epochs, as `demo deit`: the DeiT is still far from converged after 8 (61% against
    # 84%), which would flatter the SReTs.
    add_config_flags(parser, *TRAINING, defaults=TRAINING)
    parser.add_argument(
        "--models",
        default=",".join(name for name, _ in MODELS),
        help="comma-separated registered models to compare (default: the three above)",
    )
    parser.add_argument(
        "--out",
        default=OUT,
        help="run folder (one sub-folder per model), replaced by every demo run",
    )


def run(args: argparse.Namespace) -> list[dict]:
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
        print_table(rows, args.epochs)
    return rows


def print_table(rows: list[dict], epochs: int) -> None:
    from leanformer.apps.table import column, markdown_table, print_speed_note, trained_model_columns

    columns = [
        *trained_model_columns(),
        column("note"),
    ]
    print("\n" + markdown_table(rows, columns))
    threads = int(rows[0]["threads"]) if rows else 0
    print(f"(digits test split, {epochs} epochs each; img/s in eval mode at batch 64 on {threads} threads)")
    print_speed_note(rows)
