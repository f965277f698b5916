"""`leanformer demo tokenpool` (the default `leanformer demo` / `make demo`).

On real photographs when they are installed: the shipped ``deit_fashion`` (Fashion-MNIST,
196 patch tokens) with every token-reduction method inserted *without* fine-tuning (the
Token Pooling paper's appendix E setting, with carry) at the same four GFLOPs budgets, on a
fixed 2,000-image test subset, ToMe's own budget form beside them; the methods are ranked
by their mean top-1 over those budgets. Nothing is trained.

Without Fashion-MNIST it says how to get it in one line and runs the digits sweep
instead: the small ``deit_digits`` trained here first on scikit-learn's bundled 8x8 digits.

Prints the table; writes results.jsonl, table.md and tradeoff.png.
``configs/tradeoff_fashion.yaml`` and ``configs/tradeoff_digits.yaml`` are the full presets.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from leanformer.apps.gflops_budget import is_gflops_budget
from leanformer.commands._demo_out import claim_demo_folder

COMMAND = ("demo", "tokenpool")
HELP = "compare every token-pooling method at several budgets (Fashion-MNIST if installed, else digits)"
DEFAULT = True

_METHODS = [
    "wkmedoids",
    "kmedoids",
    "wkmeans",
    "kmeans",
    "powerbert",
    "importance",
    "random",
    "merge",
    "stepmerge",
    "inputmerge",
    "entrymerge",
]

DEMO_GFLOPS = (0.9, 0.7, 0.5, 0.35)

FASHION_SWEEP: dict[str, Any] = {
    "name": "demo_fashion",
    "model": "deit_fashion",
    "pretrained": True,
    "data": {"name": "fashion_mnist", "eval_batch_size": 500, "limit_test": 2000},
    # conv is left out: its layers are learned, so without fine-tuning it is random.
    "methods": _METHODS,
    # Every method at the same costs: its keep ratio solved to 0.9, 0.7, 0.5 and 0.35 of the
    # unpooled model's GFLOPs (a keep ratio costs each method differently). ToMe's own form
    # (r tokens merged per block) at r landing near the first three.
    "budgets": [{"gflops": g} for g in DEMO_GFLOPS],
    "tome_r": [7, 19, 31],
    "carry": True,
    "throughput_batch_size": 32,
    "throughput_warmup": 1,
    "throughput_runs": 3,
}

# Per-block maxima for the 6 blocks (64 patch tokens; the class token is always kept),
# shaped like the paper's schedules: keep early blocks whole, thin out the late ones.
DIGITS_SWEEP: dict[str, Any] = {
    "name": "tradeoff_digits",
    "model": "deit_digits",
    "train": {"optim": {"epochs": 15, "lr": 0.002}},
    "data": {"name": "digits", "batch_size": 64, "eval_batch_size": 256},
    "methods": _METHODS,
    "budgets": [
        [64, 56, 48, 40, 32, 24],
        [60, 48, 36, 24, 16, 8],
        [48, 32, 20, 12, 6, 2],
        [32, 16, 8, 4, 2, 1],
    ],
    "carry": True,
    "finetune_epochs": 0,
    "throughput_batch_size": 64,
    "throughput_warmup": 1,
    "throughput_runs": 5,
}

COLUMNS = (
    "top-1 on the test images, its change against the unpooled model (none), GFLOPs per image "
    "(multiply-adds), the base GFLOPs over the method's, measured img/s and speedup, tokens "
    "reaching the final norm"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        choices=("auto", "fashion_mnist", "digits"),
        default="auto",
        help="fashion_mnist (shipped model, no training), digits (trains deit_digits first), or auto: "
        "Fashion-MNIST when it is installed (default: auto)",
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="digits only: training epochs of the base model (default 15)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="output folder, replaced by every demo run (default: runs/demo_fashion or runs/demo_tokenpool)",
    )
    parser.add_argument("--no-throughput", action="store_true", help="skip the img/s measurement")


def choose_data(requested: str) -> str:
    """``fashion_mnist`` or ``digits``; ``auto`` says in one line why it falls back to digits."""
    from leanformer.data.fashion_mnist import HOW_TO_GET, is_available
    from leanformer.models.pretrained import shipped_models

    if requested != "auto":
        return requested
    if "deit_fashion" not in shipped_models():
        print("leanformer: this install has no deit_fashion weights, running the digits sweep")
        return "digits"
    if is_available():
        return "fashion_mnist"
    print(f"leanformer: Fashion-MNIST is not installed, running the digits sweep; to get it: {HOW_TO_GET}")
    return "digits"


def demo_config(args: argparse.Namespace, data: str = "digits") -> dict[str, Any]:
    base = FASHION_SWEEP if data == "fashion_mnist" else DIGITS_SWEEP
    sweep = {**base, "seed": args.seed, "device": args.device}
    epochs = getattr(args, "epochs", None)
    if epochs is not None:
        if data != "digits":
            raise ValueError("--epochs applies to the digits demo (the Fashion-MNIST demo trains nothing)")
        if epochs < 1:
            raise ValueError(f"--epochs must be >= 1, got {epochs}")
        sweep["train"] = {"optim": {**DIGITS_SWEEP["train"]["optim"], "epochs": epochs}}
    if getattr(args, "no_throughput", False):
        sweep["throughput"] = False
    return sweep


def run(args: argparse.Namespace) -> list[dict]:
    import time

    from leanformer.apps.sweep_config import sweep_config_from_dict
    from leanformer.apps.tradeoff import markdown_table, run_sweep, speed_note, summarise_seeds

    start = time.perf_counter()
    data = choose_data(getattr(args, "data", "auto"))
    cfg = sweep_config_from_dict(demo_config(args, data))
    default_out = "runs/demo_fashion" if data == "fashion_mnist" else "runs/demo_tokenpool"
    given = getattr(args, "out", None)
    out = Path(given or default_out)
    claim_demo_folder(out, "tokenpool", defaults=("runs/demo_fashion", "runs/demo_tokenpool"))
    result = run_sweep(cfg, out_dir=out, progress=not (args.quiet or args.json), overwrite=True)
    if not args.json:
        rows = summarise_seeds(result.rows)
        what = (
            "deit_fashion (shipped weights) on 2,000 Fashion-MNIST test images"
            if data == "fashion_mnist"
            else "deit_digits on the digits test split"
        )
        print(markdown_table(rows, title=f"Token Pooling: {what}, no fine-tuning, carry"))
        print(f"\ncolumns: {COLUMNS}.")
        print(_ranking_line(rows))
        took = time.perf_counter() - start
        print(f"\nwrote {out / 'table.md'} and the plot {out / 'tradeoff.png'} in {took:.0f} s")
        note = speed_note(rows)
        if note:
            print(f"leanformer: warning: {note}", file=sys.stderr)
        source = (
            "--model deit_fashion --pretrained"
            if data == "fashion_mnist"
            else (f"--checkpoint {out / 'base' / 'last.safetensors'}")
        )
        print(f"clusters: leanformer visualize clusters {source}", file=sys.stdout)
    return result.rows


def _ranking_line(rows: list[dict[str, Any]]) -> str:
    """The methods by their mean top-1 over the GFLOPs budgets, best first, as measured; a
    ranking over keep ratios or token counts would reward the methods that spend more."""
    acc: dict[str, list[float]] = {}
    targets: list[float] = []
    for r in rows:
        if r["method"] != "none" and is_gflops_budget(r.get("keep_value")):
            acc.setdefault(r["method"], []).append(r["top1"])
            if r["keep_value"]["gflops"] not in targets:
                targets.append(r["keep_value"]["gflops"])
    if not acc:
        return (
            "these budgets cost each method different GFLOPs: compare the methods along the "
            "GFLOPs axis of tradeoff.png"
        )
    ranking = sorted(((m, sum(v) / len(v)) for m, v in acc.items()), key=lambda t: -t[1])
    at = ", ".join(f"{t:g}x" for t in targets)
    return f"mean top-1 at equal GFLOPs ({at} of the unpooled model's): " + ", ".join(
        f"{m} {a:.2f}" for m, a in ranking
    )
