"""What unpooling costs: the bookkeeping of ``unpool=True`` against one transformer block.

On timm DeiT-S (random weights, nothing downloaded) at ``--keep`` for each method, the
bookkeeping is what ``unpool=True`` adds to a forward: composing the blocks' records of
where each token went (a merge or clustering has its map as part of its reduction; a
selection's is one small ``[B, N]`` scatter, not timed here), the
selections' fill of dropped patches (the nearest surviving patch on the grid) and gathering
the last block's tokens back onto every position: ``token_pooling.unpool``, timed on the
tensors of a real forward, side by side with one unpooled block at the same batch
(``leanformer.bench.timing.time_interleaved``), and reported as a percentage of that block
(a whole forward's time varies by more than this from run to run). Set the allocator first:

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=1073741824 \\
        python benchmarks/bench_unpool.py --batch-size 32 --threads 2

Appends one JSON line per method to ``--out``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import timm
import torch

from leanformer.bench.results import markdown_rows, results_path, run_stamp, write_jsonl
from leanformer.bench.timing import time_interleaved
from leanformer.patch.api import apply_token_pooling
from leanformer.pooling.registry import list_methods
from leanformer.pooling.state import TokenPooling

ALLOCATOR = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
COLUMNS = ["method", "block_ms", "unpool_ms", "bookkeeping_pct_of_block"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--keep", default="0.5x")
    parser.add_argument("--methods", default=",".join(m for m in list_methods() if m != "none"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out", default=str(results_path("unpool")))
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    images = torch.randn(args.batch_size, 3, 224, 224)
    host = timm.create_model("deit_small_patch16_224", pretrained=False).eval()
    with torch.no_grad():
        block_input = host.forward_features(images)  # [B, 197, 384]: one block's input
    block = host.blocks[0]
    stamp = {**run_stamp(threads=args.threads), "allocator": all(os.environ.get(n) for n in ALLOCATOR)}
    rows = []
    for method in args.methods.split(","):
        torch.manual_seed(0)
        dense = apply_token_pooling(
            timm.create_model("deit_small_patch16_224", pretrained=False).eval(),
            keep=args.keep,
            method=method,
            unpool=True,
        )
        pooling: TokenPooling = dense.token_pooling  # type: ignore[assignment]
        pooling.unpool_output = False
        pooling.trace_source = True  # records assignments, leaves the output reduced
        with torch.no_grad():
            reduced = dense.forward_features(images)
        fns: dict[str, Callable[[], Any]] = {
            "block": lambda: block(block_input),
            "unpool": lambda pooling=pooling, reduced=reduced: pooling.unpool(reduced),
        }
        with torch.no_grad():
            seconds = time_interleaved(fns, warmup=args.warmup, runs=args.runs, progress=True)
        rows.append(
            {
                **stamp,
                "model": "timm deit_small_patch16_224",
                "method": method,
                "keep": args.keep,
                "batch": args.batch_size,
                "block_ms": 1e3 * seconds["block"],
                "unpool_ms": 1e3 * seconds["unpool"],
                "bookkeeping_pct_of_block": 100 * seconds["unpool"] / seconds["block"],
            }
        )
        print(markdown_rows(rows[-1:], COLUMNS))
    print(markdown_rows(rows, COLUMNS))
    write_jsonl(rows, args.out, append=True)


if __name__ == "__main__":
    main()
