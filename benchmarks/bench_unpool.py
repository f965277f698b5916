"""What unpooling costs: the bookkeeping of ``unpool=True`` against one transformer block.

On timm DeiT-S (random weights, nothing downloaded) at ``--keep`` for each method, the
bookkeeping is everything ``unpool=True`` adds to a forward: each selection block's search
for the kept token nearest to every dropped one (the other reducers' assignments are part
of their reduction and cost nothing more), then composing the blocks' assignments and
gathering the last block's tokens back onto every position (``token_pooling.unpool``). Each
piece is timed on the tensors of a real forward, side by side with one unpooled block at
the same batch (``leanformer.bench.timing.time_interleaved``), and reported as a percentage
of that block (a whole forward's time varies by more than this from run to run). Set the
allocator first:

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
from torch import Tensor, nn

from leanformer.bench.results import markdown_rows, results_path, run_stamp, write_jsonl
from leanformer.bench.timing import time_interleaved
from leanformer.patch.api import apply_token_pooling
from leanformer.pooling.reducer import fill_dropped
from leanformer.pooling.registry import list_methods
from leanformer.pooling.state import TokenPooling

ALLOCATOR = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _selection_inputs(model: nn.Module, images: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(tokens, kept tokens, where each token went) of every block that dropped tokens in a
    forward of ``images``."""
    pooling: TokenPooling = model.token_pooling  # type: ignore[assignment]
    seen: list[tuple[Tensor, Tensor, Tensor]] = []

    def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        # A block that keeps no token has no nearest one to find (its tokens show the class token).
        if getattr(module, "keeps_input_tokens", False) and out[0].shape[1] > 0:
            seen.append((args[0].detach(), out[0].detach(), module.last_assign))  # type: ignore[arg-type]

    handles = [r.register_forward_hook(hook) for r in pooling.reducers.values()]
    with torch.no_grad():
        model.forward_features(images)
    for h in handles:
        h.remove()
    return seen


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
        selections = _selection_inputs(dense, images)
        pooling.unpool_output = False
        pooling.trace_source = True  # records assignments, leaves the output reduced
        with torch.no_grad():
            reduced = dense.forward_features(images)

        def fill(selections: list[tuple[Tensor, Tensor, Tensor]] = selections) -> None:
            for tokens, kept, assign in selections:
                fill_dropped(tokens, kept, assign, tokens.shape[1] - kept.shape[1])

        fns: dict[str, Callable[[], Any]] = {
            "block": lambda: block(block_input),
            "fill": fill,
            "unpool": lambda pooling=pooling, reduced=reduced: pooling.unpool(reduced),
        }
        with torch.no_grad():
            seconds = time_interleaved(fns, warmup=args.warmup, runs=args.runs, progress=True)
        bookkeeping = seconds["fill"] + seconds["unpool"]
        rows.append(
            {
                **stamp,
                "model": "timm deit_small_patch16_224",
                "method": method,
                "keep": args.keep,
                "batch": args.batch_size,
                "block_ms": 1e3 * seconds["block"],
                "fill_ms": 1e3 * seconds["fill"],
                "unpool_ms": 1e3 * seconds["unpool"],
                "bookkeeping_pct_of_block": 100 * bookkeeping / seconds["block"],
            }
        )
        print(
            markdown_rows(
                rows[-1:], ["method", "block_ms", "fill_ms", "unpool_ms", "bookkeeping_pct_of_block"]
            )
        )
    print(
        markdown_rows(
            rows,
            [
                "method",
                "block_ms",
                "fill_ms",
                "unpool_ms",
                "bookkeeping_pct_of_block",
            ],
        )
    )
    write_jsonl(rows, args.out, append=True)


if __name__ == "__main__":
    main()
