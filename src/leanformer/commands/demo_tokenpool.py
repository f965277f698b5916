"""`leanformer demo tokenpool` (the default `leanformer demo` / `make demo`).

Train the small DeiT (``deit_digits``: 6 blocks, 64 patch tokens) on the bundled digits
once, then insert every token-reduction method at several budgets *without*
fine-tuning (the Token Pooling paper's appendix E setting, with carry) and measure
top-1, GFLOPs and img/s side by side. Prints the table; writes results.jsonl, table.md
and tradeoff.png. ``configs/tradeoff_digits.yaml`` is the same sweep as a preset.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

COMMAND = ("demo", "tokenpool")
HELP = "train a small DeiT on digits, then compare every token-pooling method at several budgets"
DEFAULT = True

# Per-block maxima for the 6 blocks (64 patch tokens; the class token is always kept),
# shaped like the paper's schedules: keep early blocks whole, thin out the late ones.
DEMO_SWEEP: dict[str, Any] = {
    "name": "tradeoff_digits",
    "model": "deit_digits",
    "train": {"optim": {"epochs": 15, "lr": 0.002}},
    "data": {"name": "digits", "batch_size": 64, "eval_batch_size": 256},
    # conv is left out: its layers are learned, so without fine-tuning it is random.
    "methods": ["wkmedoids", "kmedoids", "wkmeans", "kmeans", "powerbert", "importance", "random", "merge"],
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--epochs", type=int, default=None, help="training epochs of the base model (default 15)"
    )
    parser.add_argument(
        "--out", default="runs/demo_tokenpool", help="output folder, replaced by every demo run"
    )
    parser.add_argument("--no-throughput", action="store_true", help="skip the img/s measurement")


def demo_config(args: argparse.Namespace) -> dict[str, Any]:
    sweep = {**DEMO_SWEEP, "seed": args.seed, "device": args.device}
    epochs = getattr(args, "epochs", None)
    if epochs is not None:
        if epochs < 1:
            raise ValueError(f"--epochs must be >= 1, got {epochs}")
        sweep["train"] = {"optim": {**DEMO_SWEEP["train"]["optim"], "epochs": epochs}}
    if getattr(args, "no_throughput", False):
        sweep["throughput"] = False
    return sweep


def run(args: argparse.Namespace) -> list[dict]:
    import time

    from leanformer.bench.tradeoff import markdown_table, run_sweep, sweep_config_from_dict

    start = time.perf_counter()
    cfg = sweep_config_from_dict(demo_config(args))
    out = Path(getattr(args, "out", None) or "runs/demo_tokenpool")
    result = run_sweep(cfg, out_dir=out, progress=not (args.quiet or args.json), overwrite=True)
    if not args.json:
        print(
            markdown_table(result.rows, title="Token Pooling on digits (deit_digits, no fine-tuning, carry)")
        )
        ranking = _ranking(result.rows)
        if ranking:
            print("\nmean top-1 over the budgets: " + ", ".join(f"{m} {a:.1f}" for m, a in ranking))
        print(f"\nwrote {out / 'table.md'} and {out / 'tradeoff.png'} in {time.perf_counter() - start:.0f} s")
        print(f"clusters: leanformer visualize clusters --checkpoint {out / 'base' / 'last.safetensors'}")
    return result.rows


def _ranking(rows: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """Methods by their mean top-1 across the budgets, best first (as measured)."""
    acc: dict[str, list[float]] = {}
    for r in rows:
        if r["method"] != "none":
            acc.setdefault(r["method"], []).append(r["top1"])
    return sorted(((m, sum(v) / len(v)) for m, v in acc.items()), key=lambda t: -t[1])
