"""`leanformer tradeoff`: accuracy vs GFLOPs vs img/s for every token-reduction method."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from leanformer.apps.sweep_config import SweepConfig, load_sweep_config
from leanformer.commands import given
from leanformer.commands._options import add_config_flags, config_flags_given

COMMAND = ("tradeoff",)
HELP = "sweep token-pooling methods x budgets on one model: results.jsonl, a table and a plot"

# Presets live in configs/<name>.yaml: the current folder's, else the source checkout's
# (src/leanformer/commands -> repository root).
PRESET_DIRS = (Path("configs"), Path(__file__).resolve().parents[3] / "configs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="sweep YAML file (see docs/token-pooling.md, 'Trade-off harness')")
    src.add_argument("--preset", help="a named sweep from configs/, e.g. tradeoff_digits")
    parser.add_argument("--out", help="output folder (default: runs/<sweep name>)")
    kept = parser.add_mutually_exclusive_group()
    kept.add_argument("--overwrite", action="store_true", help="replace the sweep --out holds")
    kept.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted sweep --out holds: keep its measured points, run the rest "
        "(same sweep file and flags)",
    )
    # --methods, --budget, --finetune-epochs, --no-throughput, --compile: declared on SweepConfig.
    add_config_flags(parser, schema=SweepConfig, nested=False)


def find_preset(name: str) -> Path:
    if "/" in name or "\\" in name or Path(name).suffix:
        raise ValueError(
            f"--preset {name!r} looks like a file; --preset names a sweep in configs/ "
            "(e.g. tradeoff_digits): give a file with --config"
        )
    for folder in PRESET_DIRS:
        path = folder / f"{name}.yaml"
        if path.is_file():
            return path
    known = sorted({p.stem for d in PRESET_DIRS if d.is_dir() for p in d.glob("tradeoff*.yaml")})
    raise ValueError(f"unknown sweep preset {name!r}; known: {', '.join(known) or 'none found'}")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    # The sweep file's seed and device stand unless the flags are typed.
    overrides: dict[str, Any] = {
        key: getattr(args, key) for key in ("seed", "device") if given(args, f"--{key}")
    }
    overrides.update(config_flags_given(args, schema=SweepConfig, nested=False))
    return overrides


def run(args: argparse.Namespace) -> list[dict]:
    from leanformer.apps.tradeoff import markdown_table, run_sweep, speed_note, summarise_seeds

    path = Path(args.config) if args.config else find_preset(args.preset)
    cfg = load_sweep_config(path, overrides_from_args(args))
    if args.out is not None and not args.out.strip():
        raise ValueError("--out is empty; give the output folder (or leave --out out for runs/<sweep name>)")
    out = Path(args.out) if args.out is not None else Path("runs") / cfg.name
    result = run_sweep(
        cfg, out_dir=out, progress=not (args.quiet or args.json), overwrite=args.overwrite, resume=args.resume
    )
    if not args.json:
        print(markdown_table(summarise_seeds(result.rows), title=cfg.name))
        print(f"\nwrote {out / 'results.jsonl'}, {out / 'table.md'}, {out / 'tradeoff.png'}")
        note = speed_note(summarise_seeds(result.rows))
        if note:
            print(f"leanformer: warning: {note}", file=sys.stderr)
    return result.rows
