"""Token Pooling cost and speed: one pooling layer vs one DeiT-S block, then whole models.

Three parts, each timed side by side in one process, interleaved run by run (every
run times each candidate once, in turn) so that load on the machine hits all alike;
the figure is the median over runs.

1. ``layer``: one pooling layer (batch 32, N=197 tokens incl. the class token, C=384,
   K=98, 5 clustering iterations) as a fraction of one DeiT-S block (fused attention)
   on the same input. Also the price of the significance scores: a block that must
   return attention-received leaves the fused SDPA kernel (``scores`` row).
2. ``deit_small``: leanformer ``deit_small`` with ``keep=deit_s_level3`` for each method
   vs ``pool=none``: GFLOPs (multiply-adds, the paper's convention), img/s, speedup and
   speedup / FLOPs-ratio (the goal is >= 0.9).
3. ``timm``: the same through :mod:`leanformer.patch.timm` on
   ``timm.create_model("deit_small_patch16_224", pretrained=False)``.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=1073741824 \\
        python benchmarks/bench_token_pooling.py

``--profile METHOD`` prints the profiler's operator table for one method's layer instead
(where its time goes). Prints markdown tables and appends JSON lines (with the machine, command and date) to
``--out``, by default ``benchmarks/results/token_pooling.jsonl``. On a
busy machine, wall-clock ratios mostly measure the scheduler (threads of a pooled model
wait for each other on its many small ops); ``--clock cpu --threads 1`` times this
process's CPU work instead.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from timm.models.vision_transformer import Block
from torch import Tensor, nn

from leanformer.bench.flops import count_gflops
from leanformer.bench.results import markdown_rows, results_path, run_stamp, write_jsonl
from leanformer.bench.speedup import speedup_rows
from leanformer.bench.timing import CLOCKS, add_clock_argument, time_interleaved
from leanformer.models.registry import create_model
from leanformer.patch.timm import block_parts
from leanformer.pooling.registry import build_reducers, list_methods

CLUSTERING = {"kmeans", "kmedoids", "wkmeans", "wkmedoids"}
ALLOCATOR = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


CLOCK: Callable[[], float] = time.perf_counter


LAYER_SHAPE = {"tokens": 197, "dim": 384, "heads": 6, "keep": 98}  # DeiT-S at 224, K = N/2


class LayerInputs(NamedTuple):
    """One DeiT-S block (timm's, as in the DeiT family), its input, and what a pooling layer after it gets."""

    block: Block
    x: Tensor  # block input [B, 197, 384]
    tokens: Tensor  # block output without the class token [B, 196, 384]
    scores: Tensor  # attention each of those tokens received [B, 196]


def layer_inputs(batch: int) -> LayerInputs:
    torch.manual_seed(0)
    N, C = LAYER_SHAPE["tokens"], LAYER_SHAPE["dim"]
    block = Block(C, num_heads=LAYER_SHAPE["heads"], qkv_bias=True).eval()
    x = torch.randn(batch, N, C)
    with torch.inference_mode():
        _, received = block_parts(block).attention(block.norm1(x), None, "received")
        feats = block(x)
    assert received is not None
    return LayerInputs(block, x, feats[:, 1:].contiguous(), received[:, 1:].contiguous())


def pooling_layer(method: str) -> nn.Module:
    """The layer of ``method`` keeping K=98 of the 196 patch tokens (5 clustering iterations)."""
    opts = {"max_iters": 5} if method in CLUSTERING else {}
    reducer = build_reducers(
        method=method,
        keep=[LAYER_SHAPE["keep"]],
        depth=1,
        num_tokens=LAYER_SHAPE["tokens"] - 1,
        dim=LAYER_SHAPE["dim"],
        grid_size=(14, 14),
        carry=True,
        **opts,
    )[0]
    assert reducer is not None
    return reducer.eval()


def bench_layer(args: argparse.Namespace) -> list[dict[str, Any]]:
    block, x, tokens, scores = layer_inputs(args.batch)
    attention = block_parts(block).attention  # the attention the host adapter runs
    fns: dict[str, Callable[[], Any]] = {
        "block": lambda: block(x),
        "scores": lambda: attention(block.norm1(x), None, "received"),
        "block_fused_attn": lambda: attention(block.norm1(x), None, None),
    }
    for method in args.methods:
        layer = pooling_layer(method)
        fns[method] = lambda r=layer: r(tokens, None, scores)
    with torch.inference_mode():
        t = time_interleaved(fns, warmup=args.warmup, runs=args.runs, clock=CLOCK)
    # "scores": the extra time of the unfused attention that also returns attention received.
    cost = {m: t[m] for m in args.methods} | {
        "scores": t["scores"] - t["block_fused_attn"],
        "block": t["block"],
    }
    return [
        {"part": "layer", "name": k, "ms": v * 1e3, "fraction_of_block": v / t["block"]}
        for k, v in cost.items()
    ]


def profile_layer(args: argparse.Namespace, method: str, calls: int = 5) -> str:
    """Operator table (torch profiler, self CPU time) of ``calls`` calls of one pooling layer.

    Same input as :func:`bench_layer`; ``# of Calls`` divided by ``calls`` gives the
    number of times each operator runs per layer call (e.g. clustering iterations).
    """
    from torch.profiler import ProfilerActivity, profile

    _, _, tokens, scores = layer_inputs(args.batch)
    reducer = pooling_layer(method)
    with torch.inference_mode():
        for _ in range(args.warmup):
            reducer(tokens, None, scores)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                reducer(tokens, None, scores)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def _model_rows(part: str, models: dict[str, nn.Module], args: argparse.Namespace) -> list[dict[str, Any]]:
    x = torch.randn(args.model_batch, 3, 224, 224)
    gflops = {k: count_gflops(m, (x[:2],)) for k, m in models.items()}
    with torch.inference_mode():
        t = time_interleaved(
            {k: (lambda m=m: m(x)) for k, m in models.items()}, warmup=1, runs=args.model_runs, clock=CLOCK
        )
    rows = speedup_rows(t, gflops, batch=args.model_batch)
    for row in rows:
        row.update(part=part, keep="all" if row["name"] == "none" else args.keep)
    return rows


def bench_deit(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    base = create_model("deit_small").eval()
    models: dict[str, nn.Module] = {"none": base}
    for method in args.model_methods:
        m = create_model("deit_small", pool=method, keep=args.keep, carry=True).eval()
        m.load_state_dict(base.state_dict())  # same weights; pooling has no parameters here
        models[method] = m
    return _model_rows("deit_small", models, args)


def bench_timm(args: argparse.Namespace) -> list[dict[str, Any]]:
    import copy

    import timm

    from leanformer.patch.api import apply_token_pooling

    torch.manual_seed(0)
    base = timm.create_model("deit_small_patch16_224", pretrained=False).eval()
    models: dict[str, nn.Module] = {"none": base}
    for method in args.model_methods:
        models[method] = apply_token_pooling(copy.deepcopy(base), keep=args.keep, method=method, carry=True)
    rows = _model_rows("timm", models, args)
    for r in rows:
        r["timm"] = timm.__version__
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--parts", default="layer,deit_small,timm")
    p.add_argument("--batch", type=int, default=32, help="batch of the layer benchmark")
    p.add_argument("--runs", type=int, default=15, help="timed runs of the layer benchmark")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--methods", default="wkmedoids,kmedoids,wkmeans,kmeans,powerbert,random,importance,merge,conv"
    )
    p.add_argument("--model-methods", default="wkmedoids,kmedoids,powerbert,merge")
    p.add_argument("--keep", default="deit_s_level3")
    p.add_argument("--model-batch", type=int, default=32)
    p.add_argument("--model-runs", type=int, default=5)
    add_clock_argument(p)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--profile",
        default=None,
        metavar="METHOD",
        help="print the profiler's operator table of 5 calls of this method's layer, then exit",
    )
    p.add_argument("--out", default=str(results_path("token_pooling")))
    args = p.parse_args()
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.profile is not None:
        if args.profile not in list_methods() or args.profile == "none":
            p.error(f"--profile: unknown method {args.profile!r}; choose from {', '.join(list_methods())}")
        print(profile_layer(args, args.profile))
        return
    args.methods = [m for m in args.methods.split(",") if m]
    args.model_methods = [m for m in args.model_methods.split(",") if m]
    parts = args.parts.split(",")
    unknown = set(parts) - {"layer", "deit_small", "timm"}
    if unknown:
        p.error(f"unknown parts: {', '.join(sorted(unknown))}")

    env = {k: os.environ.get(k) for k in ALLOCATOR}
    meta = {**run_stamp(), "clock": args.clock, "allocator": env}
    rows: list[dict[str, Any]] = []
    if "layer" in parts:
        layer = bench_layer(args)
        rows += layer
        print(f"\n### One pooling layer vs one DeiT-S block (B={args.batch}, N=197, C=384, K=98, 5 iters)\n")
        print(markdown_rows(layer, ["name", "ms", "fraction_of_block"]))
    cols = ["name", "keep", "gflops", "flops_ratio", "img_per_s", "speedup", "speedup_over_flops_ratio"]
    if "deit_small" in parts:
        deit = bench_deit(args)
        rows += deit
        print(f"\n### deit_small, keep={args.keep}, batch {args.model_batch}\n")
        print(markdown_rows(deit, cols))
    if "timm" in parts:
        tm = bench_timm(args)
        rows += tm
        print(
            f"\n### timm deit_small_patch16_224 via the patch, keep={args.keep}, batch {args.model_batch}\n"
        )
        print(markdown_rows(tm, cols))
    out = write_jsonl([{**r, **meta} for r in rows], args.out, append=True)
    print(f"\nclock={args.clock}, threads={meta['threads']}, allocator={env}; wrote {out}")


if __name__ == "__main__":
    main()
