"""Two methods of a finished trade-off sweep, compared image by image.

A top-1 difference between two methods on the same test images is only as large as the
images on which they disagree allow. For every budget that both methods of a sweep
measured, this rebuilds each variant as the sweep did (its base model, and the keep
schedule it solved for a GFLOPs budget), predicts every test image, and counts the images
only one of the two got right: ``b`` for the first method, ``c`` for the second.
McNemar's ``z = (b - c) / sqrt(b + c)`` is the difference in units of its noise
(``|z| > 2``: beyond chance at about 95%). The recounted top-1 must equal the sweep's
(checked, as counts of images; a mismatch stops the script).

    python benchmarks/paired_counts.py runs/tradeoff_fashion_d12 --methods inputmerge,merge

A sweep that trained its base model (``model:`` with ``train:``) reloads it from the
sweep folder's ``base`` run. Deterministic methods only (not ``random``/``importance``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from leanformer.apps.sweep_config import SEEDED_METHODS, method_options, sweep_config_from_dict
from leanformer.apps.tradeoff import iter_rows, load_base_model, with_method
from leanformer.data.loaders import eval_loader
from leanformer.engine.builders import build_split
from leanformer.engine.evaluate import evaluate


def correct_per_image(model: nn.Module, loader: Any, device: str) -> Tensor:
    """``[n]`` bool: whether ``model``'s top-1 prediction of each test image is right."""
    hits: list[Tensor] = []

    def keep_hits(logits: Tensor, target: Tensor) -> None:
        hits.append(logits.argmax(dim=-1) == target)

    evaluate(model, loader, device=device, on_logits=keep_hits)
    return torch.cat(hits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="a finished sweep's folder (sweep.json, results.jsonl)")
    parser.add_argument("--methods", default="inputmerge,merge", help="the two methods, first,second")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    methods = args.methods.split(",")
    if len(methods) != 2 or methods[0] == methods[1]:
        parser.error(f"--methods takes two different methods, got {args.methods!r}")
    if any(m in SEEDED_METHODS for m in methods):
        parser.error(f"{', '.join(SEEDED_METHODS)} draw at random: compare deterministic methods")
    for name in ("sweep.json", "results.jsonl"):
        if not (args.sweep / name).is_file():
            parser.error(f"{args.sweep} holds no {name}: give the folder of a finished sweep")
    torch.set_num_threads(args.threads)

    cfg = sweep_config_from_dict(json.loads((args.sweep / "sweep.json").read_text()))
    rows = {(r["method"], r["keep"]): r for r in iter_rows(args.sweep / "results.jsonl")}
    budgets = [keep for (method, keep) in rows if method == methods[0] and (methods[1], keep) in rows]
    if not budgets:
        parser.error(f"the sweep measured no budget with both {methods[0]} and {methods[1]}")
    base = load_base_model(cfg, out_dir=args.sweep, progress=False, resume=True).eval()
    loader = eval_loader(build_split(cfg.data, "test"), batch_size=cfg.data.eval_batch_size)

    print(f"| budget | {methods[0]} | {methods[1]} | only {methods[0]} right | only {methods[1]} right | z |")
    print("|---|---:|---:|---:|---:|---:|")
    for keep in budgets:
        hits = []
        for method in methods:
            row = rows[(method, keep)]
            torch.manual_seed(cfg.seed)  # as the sweep does before building each variant
            model = with_method(
                base,
                method,
                row.get("keep_schedule", row["keep_value"]),
                carry=cfg.carry,
                options=method_options(cfg, method),
            )
            hit = correct_per_image(model, loader, cfg.device)
            # Compared as counts of images: the sweep's percentage went through floats.
            right, expected = int(hit.sum()), round(row["top1"] * hit.numel() / 100)
            if right != expected:
                raise SystemExit(f"{method} {keep}: {right} images right now, {expected} in the sweep")
            hits.append(hit)
        b = int((hits[0] & ~hits[1]).sum())
        c = int((hits[1] & ~hits[0]).sum())
        z = (b - c) / math.sqrt(b + c) if b + c else 0.0
        top1 = [rows[(m, keep)]["top1"] for m in methods]
        print(f"| {keep} | {top1[0]:.2f} | {top1[1]:.2f} | {b} | {c} | {z:+.1f} |")


if __name__ == "__main__":
    main()
