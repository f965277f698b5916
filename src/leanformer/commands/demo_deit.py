"""`leanformer demo deit`: train the small DeiT on digits; print accuracy, GFLOPs and img/s."""

from __future__ import annotations

import argparse
from pathlib import Path

from leanformer.commands._demo_out import claim_demo_folder
from leanformer.commands._options import add_config_flags, config_flags_given

COMMAND = ("demo", "deit")
OUT = "runs/demo_deit"  # the default --out, a demo's own folder
HELP = "train a small DeiT on the bundled digits and report accuracy, GFLOPs and img/s"


# The run-config options this demo sets, with its defaults (flags as `train`'s).
TRAINING = {"optim.epochs": 15}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, *TRAINING, defaults=TRAINING)
    parser.add_argument(
        "--out", default=OUT, help="run folder, replaced by every demo run (default: %(default)s)"
    )


def run(args: argparse.Namespace) -> list[dict]:
    from leanformer.apps.table import markdown_table, print_speed_note, trained_model_columns
    from leanformer.bench.report import trained_model_row
    from leanformer.config import load_config
    from leanformer.engine.train import fit

    cfg = load_config(
        None,
        {
            "model": "deit_digits",
            **config_flags_given(args, *TRAINING),
            "optim.lr": 2e-3,
            "seed": args.seed,
            "device": args.device,
        },
    )
    claim_demo_folder(args.out, "deit", defaults=(OUT,))
    result = fit(cfg, out_dir=Path(args.out), progress=not args.quiet and not args.json, overwrite=True)
    row = {
        "demo": "deit",
        "model": cfg.model,
        "dataset": "digits",
        "epochs": args.epochs,
        **trained_model_row(result.model, result.metrics["top1"], device=args.device),
        "checkpoint": str(Path(args.out) / "last.safetensors"),
    }
    if not args.json:
        columns = trained_model_columns()
        print("\n" + markdown_table([row], columns))
        print(
            f"(digits test split, {args.epochs} epochs; img/s at batch 64 on {int(row['threads'])} threads; "
            f"checkpoint {row['checkpoint']})"
        )
        print_speed_note([row])
    return [row]
