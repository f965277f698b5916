"""Per-block keep schedules at equal GFLOPs, on the Fashion-MNIST validation split.

A constant per-block keep ratio ``rho`` shrinks the tokens geometrically: at ``rho = 0.5``
the last of ``deit_fashion``'s six blocks sees 3 of 196 patch tokens. This script shapes
the schedule, ``rho_i = rho ** (1 + tilt * u + bend * (u ** 2 - 1 / 3))`` for block ``i``
with ``u = 2 i / (depth - 1) - 1`` (``tilt < 0``: remove more in the first blocks and less
in the last ones; ``bend > 0``: keep more in the middle blocks; both 0: the constant
ratio), solves ``rho`` so that every schedule costs the same GFLOPs (``--targets``,
fractions of the unpooled model's; the sweep's GFLOPs budgets,
:mod:`leanformer.apps.gflops_budget`), and measures top-1 without fine-tuning on
``--images`` images of the validation split from ``--start`` (the last 10,000 training
images, which the shipped model never trained on). ``--checkpoint`` screens another
model trained on the first 50,000 (e.g. the depth-12 run of
``configs/train_deit_fashion_d12.yaml``). Needs Fashion-MNIST.

    python benchmarks/screen_schedules.py --targets 0.5,0.36,0.24 --tilts=-1.2,-0.6,0,0.6 \\
        --methods merge,stepmerge
    python benchmarks/screen_schedules.py --targets 0.36 --methods merge \\
        --tilts=-1.6,-1.2,-0.8,-0.4,0 --bends=-1,-0.5,0,0.5,1
    python benchmarks/screen_schedules.py --checkpoint runs/deit_fashion_d12/last.safetensors \\
        --targets 0.35,0.24 --methods merge,inputmerge --tilts=0 --images 10000

Prints one JSON line per point and appends it (with the machine, command and date) to
``--out``, by default ``benchmarks/results/schedules.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sized
from pathlib import Path
from typing import cast

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Subset

from leanformer.apps.tradeoff import solve_method_budget, with_method
from leanformer.bench.flops import count_gflops
from leanformer.bench.results import results_path, run_stamp, write_jsonl
from leanformer.config import DataConfig
from leanformer.engine.builders import build_split
from leanformer.engine.checkpoint import load_model
from leanformer.engine.evaluate import evaluate
from leanformer.models.registry import create_model
from leanformer.pooling.budgets import check_gflops_budget
from leanformer.pooling.registry import pooling_method


def _numbers(parser: argparse.ArgumentParser, flag: str, text: str) -> list[float]:
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        parser.error(f"{flag} takes comma-separated numbers, got {text!r}")
    return values


def check_grid(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[float], list[str], list[tuple[float, float]]]:
    """The targets, methods and (tilt, bend) shapes, each checked; ``parser.error`` otherwise."""
    targets = _numbers(parser, "--targets", args.targets)
    shapes = [
        (t, b)
        for t in _numbers(parser, "--tilts", args.tilts)
        for b in _numbers(parser, "--bends", args.bends)
    ]
    methods = args.methods.split(",")
    for method in methods:
        try:
            pooling_method(method)
        except ValueError as err:
            parser.error(f"--methods: {err}")
        if method == "none":
            parser.error("--methods: none keeps every token; its top-1 is printed first anyway")
    for target in targets:
        for tilt, bend in shapes:
            try:
                check_gflops_budget({"gflops": target, "tilt": tilt, "bend": bend})
            except ValueError as err:
                parser.error(str(err))
    return targets, methods, shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="0.5,0.36,0.24", help="GFLOPs fractions of the unpooled model")
    parser.add_argument("--tilts", default="-1.2,-0.9,-0.6,-0.3,0,0.3,0.6,0.9")
    parser.add_argument("--bends", default="0")
    parser.add_argument("--methods", default="merge,stepmerge")
    parser.add_argument("--start", type=int, default=0, help="first validation image used")
    parser.add_argument("--images", type=int, default=2000, help="validation images used")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, help="append the JSON lines here (default: benchmarks/results/schedules.jsonl)"
    )
    parser.add_argument(
        "--checkpoint", type=Path, help="a trained Fashion-MNIST model (default: the shipped deit_fashion)"
    )
    args = parser.parse_args()
    # Every point is checked before the model and data load: a typo in the last of a
    # list would otherwise stop the script after minutes of the earlier points.
    targets, methods, shapes = check_grid(parser, args)
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if args.out is not None and not args.out.parent.is_dir():
        parser.error(f"--out {args.out}: the folder {args.out.parent} does not exist")
    torch.set_num_threads(args.threads)
    out = args.out if args.out is not None else results_path("schedules")
    stamp = run_stamp()

    if args.checkpoint is not None and not args.checkpoint.is_file():
        parser.error(f"checkpoint {args.checkpoint} does not exist")
    base = (
        create_model("deit_fashion", pretrained=True)
        if args.checkpoint is None
        else load_model(args.checkpoint)
    ).eval()
    data = DataConfig(name="fashion_mnist", eval_batch_size=500, options={"validation": 10000})
    val = build_split(data, "val")
    count = len(cast(Sized, val))
    if not 0 <= args.start < count or args.images < 1:
        parser.error(f"--start must lie in [0, {count}) and --images be positive")
    images = range(args.start, min(args.start + args.images, count))
    loader = DataLoader(Subset(val, images), batch_size=500)
    # GFLOPs on a real image, as the sweep counts them: a clustering's iterations (and so
    # its cost) depend on the tokens, and a blank image stops them early. Always the first
    # validation image, so runs over other --start ranges solve the same schedules.
    image = (cast(Tensor, val[0][0])[None],)
    full = count_gflops(base, image)

    def variant(method: str, keep: list[float]) -> torch.nn.Module:
        return with_method(base, method, keep, carry=True, options={})

    def cost(method: str, keep: list[float]) -> float:
        return count_gflops(variant(method, keep), image) / full

    unpooled = {**stamp, "method": "none", "top1": evaluate(base, loader)["top1"], "gflops": full}
    print(json.dumps(unpooled), flush=True)
    write_jsonl([unpooled], out, append=True)
    for target in targets:
        for method in methods:
            for tilt, bend in shapes:
                budget = {"gflops": target, "tilt": tilt, "bend": bend}
                keep = solve_method_budget(
                    base, method, budget, image[0], carry=True, options={}, name=method
                )
                row = {
                    **stamp,
                    "target": target,
                    "method": method,
                    "tilt": tilt,
                    "bend": bend,
                    "keep": [round(r, 4) for r in keep],
                    "gflops_fraction": round(cost(method, keep), 4),
                    "top1": evaluate(variant(method, keep), loader)["top1"],
                    "images": f"{images.start}-{images.stop - 1}",
                }
                print(json.dumps(row), flush=True)
                write_jsonl([row], out, append=True)


if __name__ == "__main__":
    main()
