"""`leanformer train`: train a registered model from a config file, flags and dotted overrides."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from leanformer.commands import given
from leanformer.commands._options import (
    add_config_flags,
    add_data_arguments,
    add_model_arguments,
    config_flags_given,
    dotted_overrides,
    show_config_defaults,
)
from leanformer.config import RunConfig, load_config

COMMAND = ("train",)
HELP = "train a model (single process, or DDP under torchrun)"
ACCEPTS_OVERRIDES = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (see configs/)")
    add_model_arguments(parser)
    add_data_arguments(parser)
    add_config_flags(parser, "optim", "aug", "train")
    show_config_defaults(parser, unless="--config or the run --resume continues")
    parser.add_argument(
        "--out", default=None, help="run folder; it must not hold a run already (default: runs/<model>)"
    )
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint, with the config saved in that "
        "folder (flags given now override it)",
    )
    existing.add_argument(
        "--overwrite", action="store_true", help="replace the run --out holds with a new one"
    )


def build_config(args: argparse.Namespace, saved_config: Path | None = None) -> RunConfig:
    """Defaults, then ``--config`` (or the ``saved_config`` of a run being resumed), then flags.

    A resumed run keeps its own seed: a ``--seed`` typed over a saved config is refused by
    the resume rule (:mod:`leanformer.engine.resume_rule`) when it differs.
    """
    # --opt first: a flag of its own (--pool) wins over the same key in --opt.
    overrides: dict[str, Any] = {f"model_options.{key}": value for key, value in args.opt}
    overrides.update(config_flags_given(args))
    # A config file's seed and device stand unless the flags are typed. A seed typed with
    # --resume is applied too, so that the resume rule refuses it rather than ignores it.
    from_file = saved_config is not None or args.config is not None
    if not from_file or given(args, "--seed"):
        overrides["seed"] = args.seed
    if not from_file or given(args, "--device"):
        overrides["device"] = args.device
    overrides.update(dotted_overrides(args.extra))
    config = load_config(saved_config or args.config, overrides)
    from leanformer.engine.train import check_dependent_options, drop_ineffective_options

    if saved_config is not None:
        config, dropped = drop_ineffective_options(config, given=overrides)
        for message in dropped:
            print(f"leanformer: warning: {saved_config}: {message}", file=sys.stderr)
    # What was typed counts even at its default value (--distill-tau 1 without --teacher).
    check_dependent_options(config, given=overrides)
    return config


def _saved_config(args: argparse.Namespace) -> Path | None:
    """``--resume``: the run folder's own ``config.yaml``.

    A config file beside ``--resume`` is refused: it would replace the saved config, and
    with it the run's seed and every setting not repeated (the result would no longer
    equal an uninterrupted run). Changes go in as flags, over the saved config.
    """
    if not args.resume:
        return None
    if args.config is not None:
        raise ValueError(
            "--resume continues with the run's own config.yaml: give changes as flags "
            "(--epochs 20, --optim.epochs 20), not --config"
        )
    if args.out is None:
        raise ValueError("--resume needs --out, the folder of the run to continue")
    saved = Path(args.out) / "config.yaml"
    if not saved.is_file():
        raise ValueError(f"--resume: {args.out} holds no run to continue (no config.yaml)")
    return saved


def run(args: argparse.Namespace) -> list[dict]:
    from leanformer.engine.run_folder import held_run_files
    from leanformer.engine.train import fit

    call_time = [
        flag
        for flag, value in (
            ("--num-queries", args.num_queries),
            ("--dqs-threshold", args.dqs_threshold),
            ("--dqs-rule", args.dqs_rule),
        )
        if value is not None
    ]
    if call_time:
        raise ValueError(
            f"train does not take {', '.join(call_time)} (evaluation options of eval/bench); "
            "a Perceiver trains for every query count with --query-masking"
        )
    if args.pretrained:
        raise ValueError(
            "train does not take --pretrained: to start from the shipped weights, give "
            "--init-from NAME (or a checkpoint or run folder); to fine-tune them with token "
            "pooling at several budgets, run `leanformer tradeoff` with pretrained: true and finetune_epochs"
        )
    if args.out is not None and not args.out.strip():
        raise ValueError("--out is empty; give the run folder (or leave --out out for runs/<model>)")
    cfg = build_config(args, _saved_config(args))
    out = Path(args.out) if args.out is not None else Path("runs") / cfg.model
    if args.overwrite and held_run_files(out) and not args.quiet:
        print(f"leanformer: replacing the run in {out} (--overwrite)", file=sys.stderr)
    result = fit(
        cfg,
        out_dir=out,
        progress=not args.quiet and not args.json,
        resume=args.resume,
        overwrite=args.overwrite,
    )
    if result.out_dir is None or not _is_main():
        return []
    row = {
        "model": cfg.model,
        **result.metrics,
        "run_dir": str(out),
        "checkpoint": str(out / "last.safetensors"),
    }
    if not args.json:
        if "ap" in row:
            score = f"AP {row['ap']:.2f}"
        elif "miou" in row:
            score = f"mIoU {row['miou']:.2f}%"
        else:
            score = f"top-1 {row['top1']:.2f}%"
        print(f"{cfg.model}: {score} after {row.get('epoch', 0)} epochs -> {row['checkpoint']}")
    return [row]


def _is_main() -> bool:
    import os

    return int(os.environ.get("RANK", "0")) == 0
