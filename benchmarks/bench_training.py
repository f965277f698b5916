"""Training-step speed: forward + backward + optimizer step, side by side in one process.

Each candidate (a precision, and optionally a token-pooling method) is a copy of the same
model with its own optimizer (``leanformer.engine.recipe.build_optimizer``, AdamW) stepping
on the same random batch; candidates are called in turn on every round
(``leanformer.bench.timing.time_interleaved``) and the median is reported as img/s, with
the ratio to the first candidate. Set the allocator first, and ``--threads``:

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=1073741824 \\
        python benchmarks/bench_training.py --model deit_fashion --batch-size 128 \\
        --precisions fp32,bf16 --threads 2

Appends one JSON line per candidate to ``--out`` (machine, command, date, figures).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from leanformer.bench.results import markdown_rows, results_path, run_stamp, write_jsonl
from leanformer.bench.timing import time_interleaved
from leanformer.config import OptimConfig
from leanformer.engine.recipe import autocast_for, build_optimizer
from leanformer.models.registry import create_model

ALLOCATOR = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _step_fn(model: torch.nn.Module, precision: str, images: torch.Tensor, target: torch.Tensor) -> Callable:
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4))
    device = images.device

    def step() -> None:
        with autocast_for(device, precision):
            loss = F.cross_entropy(model(images), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deit_fashion")
    parser.add_argument("--model-options", default="", help="KEY=VALUE,... for create_model")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--pools", default="none", help="token-pooling methods, comma-separated")
    parser.add_argument("--keep", default=None, help="the budget of every pooled candidate")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default=str(results_path("training")))
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    options: dict[str, Any] = {}
    for item in filter(None, args.model_options.split(",")):
        key, value = item.split("=", 1)
        options[key] = int(value) if value.isdigit() else value
    torch.manual_seed(0)
    base = create_model(args.model, **options)
    size = getattr(base, "img_size", None) or options.get("img_size", 224)
    size = size[0] if isinstance(size, list | tuple) else size
    images = torch.randn(args.batch_size, getattr(base, "in_chans", 3), size, size)
    target = torch.randint(0, getattr(base, "num_classes", 10), (args.batch_size,))
    candidates: dict[str, Callable[[], None]] = {}
    for pool in args.pools.split(","):
        for precision in args.precisions.split(","):
            extra = {} if pool == "none" else {"pool": pool, "keep": args.keep}
            torch.manual_seed(0)
            model = create_model(args.model, **options, **extra).train()
            candidates[f"{pool}/{precision}"] = _step_fn(model, precision, images, target)
    seconds = time_interleaved(candidates, warmup=args.warmup, runs=args.runs, progress=True)
    first = next(iter(seconds.values()))
    stamp = {
        **run_stamp(threads=args.threads),
        "allocator": all(os.environ.get(name) for name in ALLOCATOR),
    }
    rows = [
        {
            **stamp,
            "model": args.model,
            "candidate": name,
            "batch": args.batch_size,
            "img_per_s": args.batch_size / value,
            "ratio_to_first": first / value,
        }
        for name, value in seconds.items()
    ]
    print(markdown_rows(rows, ["candidate", "batch", "img_per_s", "ratio_to_first"]))
    write_jsonl(rows, args.out, append=True)


if __name__ == "__main__":
    main()
