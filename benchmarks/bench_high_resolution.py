"""Token reduction as the token count grows: 196, 576 and 784 patch tokens.

Three parts, each timed side by side in one process, interleaved run by run (every run
times each candidate once, in turn); figures are medians.

1. ``received``: one attention call (batch 8, 6 heads, head size 64, N tokens) that also
   returns the attention each key received: through the whole ``[B, H, N, N]``
   probability matrix (``whole``) and in the default blocks (``blocked``, what
   ``attention(..., return_received=True)`` runs; eager on the CPU, one item and the
   heads whose logits fit in cache), beside the fused kernel without scores (``sdpa``):
   time and peak tensor memory.
2. ``models``: timm ``deit_small_patch16_224`` built at 224 / 384 / 448 (196 / 576 / 784
   patch tokens), unpatched and patched with each method at one per-block schedule that
   removes the same number ``r`` of patch tokens in every block, ``r`` chosen so the
   patched model costs about ``--flops-target`` of the unpatched GFLOPs. Reported:
   GFLOPs (multiply-adds), img/s, speedup over the unpatched model, and speedup divided
   by the FLOPs ratio (1.0 = the time falls as much as the FLOPs). With ``--compile``
   every model is also compiled (``torch.compile(fullgraph=True)``, inductor) and timed
   beside its eager self, each mode against the unpatched model in the same mode;
   compile times are reported apart.
3. ``memory``: peak of live tensor bytes during one forward (inference mode) at the
   largest size, per method and unpatched (:func:`leanformer.bench.memory.cpu_peak_mb`).

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=1073741824 \\
        python benchmarks/bench_high_resolution.py --parts models --threads 1,2 --compile --runs 9

Prints markdown tables and appends JSON lines (with the machine, command and date) to
``--out``, by default ``benchmarks/results/high_resolution.jsonl``.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable
from typing import Any

import timm
import torch
from torch import Tensor, nn

from leanformer.bench.compiled import compile_for_inference
from leanformer.bench.flops import count_gflops
from leanformer.bench.memory import cpu_peak_mb
from leanformer.bench.results import markdown_rows, results_path, run_stamp, write_jsonl
from leanformer.bench.speedup import speedup_rows
from leanformer.bench.timing import CLOCKS, add_clock_argument, time_interleaved
from leanformer.ops.attention import attention, size_bias
from leanformer.ops.received import BlockShape, blocked_attention_received

ALLOCATOR = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
MODEL = "deit_small_patch16_224"
PATCH = 16
CLOCK: Callable[[], float] = time.perf_counter


def patch_model(base: nn.Module, method: str, keep: list[int]) -> nn.Module:
    """A patched copy of ``base``: the one place this script calls the patch API."""
    from leanformer.patch.api import apply_token_pooling

    return apply_token_pooling(copy.deepcopy(base), keep=keep, method=method, carry=True).eval()


def constant_schedule(tokens: int, depth: int, remove: int) -> list[int]:
    """Patch tokens kept after each block when every block removes ``remove`` of them."""
    return [max(tokens - remove * (i + 1), 1) for i in range(depth)]


def schedule_for_target(base: nn.Module, image: int, target: float) -> tuple[int, list[int]]:
    """The per-block removal ``r`` whose schedule brings powerbert's GFLOPs closest to
    ``target`` x the unpatched model's (GFLOPs fall as ``r`` grows: bisection)."""
    x = torch.randn(1, 3, image, image)
    tokens, depth = (image // PATCH) ** 2, len(base.blocks)
    full = count_gflops(base, (x,))

    def ratio(r: int) -> float:
        keep = constant_schedule(tokens, depth, r)
        return count_gflops(patch_model(base, "powerbert", keep), (x,)) / full

    lo, hi = 1, tokens // depth  # ratio(lo) > target > ratio(hi) for the targets used here
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ratio(mid) > target else (lo, mid)
    best = min((lo, hi), key=lambda r: abs(ratio(r) - target))
    return best, constant_schedule(tokens, depth, best)


def received_rows(n: int, runs: int) -> list[dict[str, Any]]:
    """Attention with scores at ``n`` tokens: whole matrix vs blocks vs fused without scores."""
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(8, 6, n, 64, generator=g) for _ in range(3))
    token_sizes = torch.randint(1, 5, (8, n), generator=g).float()
    bias = size_bias(token_sizes, q.dtype)
    fns: dict[str, Callable[[], Any]] = {
        "whole": lambda: blocked_attention_received(
            q, k, v, mask=bias, dropout_p=0.0, scale=64**-0.5, block=BlockShape(*q.shape[:3])
        ),
        "blocked": lambda: attention(q, k, v, sizes=token_sizes, return_received=True),
        "sdpa": lambda: attention(q, k, v, sizes=token_sizes),
    }
    with torch.inference_mode():
        t = time_interleaved(fns, warmup=1, runs=runs, clock=CLOCK)
        peak = {name: cpu_peak_mb(fn) for name, fn in fns.items()}
    return [
        {
            "part": "received",
            "tokens": n,
            "name": name,
            "ms": t[name] * 1e3,
            "time_vs_whole": t[name] / t["whole"],
            "peak_mb": peak[name],
        }
        for name in fns
    ]


def build_models(image: int, methods: list[str], target: float) -> tuple[dict[str, nn.Module], int]:
    torch.manual_seed(0)
    base = timm.create_model(MODEL, pretrained=False, img_size=image).eval()
    remove, keep = schedule_for_target(base, image, target)
    models: dict[str, nn.Module] = {"none": base}
    for method in methods:
        models[method] = patch_model(base, method, keep)
    return models, remove


def model_rows(image: int, methods: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Unpatched vs each method at one input side: GFLOPs, img/s, speedup / FLOPs ratio;
    with ``--compile`` also each model compiled, against the compiled unpatched model."""
    models, remove = build_models(image, methods, args.flops_target)
    x = torch.randn(args.batch, 3, image, image)
    gflops = {name: count_gflops(m, (x[:1],)) for name, m in models.items()}
    modes = ("eager", "compiled") if args.compile else ("eager",)
    fns = {f"{name}|eager": (lambda m=m: m(x)) for name, m in models.items()}
    compile_s: dict[str, float] = {}
    if args.compile:
        for name, model in models.items():
            compiled, compile_s[name] = compile_for_inference(model, (x,))
            fns[f"{name}|compiled"] = lambda m=compiled: m(x)
    with torch.inference_mode():
        t = time_interleaved(fns, warmup=1, runs=args.runs, clock=CLOCK)
    rows = []
    for mode in modes:
        seconds = {key.split("|")[0]: s for key, s in t.items() if key.endswith(f"|{mode}")}
        for row in speedup_rows(seconds, gflops, batch=args.batch):
            row.update(part="models", mode=mode, tokens=(image // PATCH) ** 2, image=image)
            row["remove_per_block"] = 0 if row["name"] == "none" else remove
            row["compile_s"] = compile_s.get(row["name"]) if mode == "compiled" else None
            rows.append(row)
    return rows


def bench_memory(image: int, methods: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    models, remove = build_models(image, methods, args.flops_target)
    x: Tensor = torch.randn(args.batch, 3, image, image)
    with torch.inference_mode():
        for m in models.values():
            m(x)  # first call: one-time allocations stay out of the figure
        peak = {name: cpu_peak_mb(lambda m=m: m(x)) for name, m in models.items()}
    return [
        {
            "part": "memory",
            "tokens": (image // PATCH) ** 2,
            "name": name,
            "remove_per_block": 0 if name == "none" else remove,
            "peak_mb": peak[name],
            "peak_vs_unpatched": peak[name] / peak["none"],
        }
        for name in models
    ]


MODEL_COLS = [
    "tokens",
    "name",
    "mode",
    "remove_per_block",
    "gflops",
    "flops_ratio",
    "img_per_s",
    "speedup",
    "speedup_over_flops_ratio",
    "compile_s",
]


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--parts", default="received,models,memory")
    p.add_argument("--threads", default="1,2", help="torch intra-op thread counts, run one after another")
    p.add_argument("--images", default="224,384,448", help="input sides (patch 16: 196/576/784 tokens)")
    p.add_argument("--methods", default="merge,wkmedoids,powerbert")
    p.add_argument("--flops-target", type=float, default=0.73, help="patched / unpatched GFLOPs")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--runs", type=int, default=5, help="timed runs of each model")
    p.add_argument(
        "--compile", action="store_true", help="models: also time each model compiled (fullgraph=True)"
    )
    p.add_argument("--received-tokens", default="197,577,785")
    p.add_argument("--received-runs", type=int, default=15)
    add_clock_argument(p)
    p.add_argument("--out", default=str(results_path("high_resolution")))
    args = p.parse_args()
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    parts = args.parts.split(",")
    unknown = set(parts) - {"received", "models", "memory"}
    if unknown:
        p.error(f"unknown parts: {', '.join(sorted(unknown))}")
    methods = [m for m in args.methods.split(",") if m]
    images = _ints(args.images)
    env = {k: os.environ.get(k) for k in ALLOCATOR}
    rows: list[dict[str, Any]] = []
    for threads in _ints(args.threads):
        torch.set_num_threads(threads)
        meta = {**run_stamp(threads=threads), "clock": args.clock, "batch": args.batch}
        meta |= {"timm": timm.__version__}
        meta |= {"allocator": env}
        new: list[dict[str, Any]] = []
        if "received" in parts:
            print(f"\n### attention + received, B=8, H=6, D=64, {threads} thread(s)\n")
            received = [r for n in _ints(args.received_tokens) for r in received_rows(n, args.received_runs)]
            print(markdown_rows(received, ["tokens", "name", "ms", "time_vs_whole", "peak_mb"]), flush=True)
            new += received
        if "models" in parts:
            print(
                f"\n### timm {MODEL}, ~{args.flops_target}x GFLOPs, batch {args.batch}, {threads} thread(s)\n"
            )
            for image in images:
                models = model_rows(image, methods, args)
                print(markdown_rows(models, MODEL_COLS), flush=True)
                new += models
        rows += [{**r, **meta} for r in new]
    if "memory" in parts:
        memory = bench_memory(max(images), methods, args)
        print(f"\n### forward peak tensor memory, {max(images)}px, batch {args.batch}\n")
        print(markdown_rows(memory, ["tokens", "name", "remove_per_block", "peak_mb", "peak_vs_unpatched"]))
        rows += [{**r, **run_stamp(), "batch": args.batch} for r in memory]
    out = write_jsonl(rows, args.out, append=True)
    print(f"\nallocator={env}; wrote {out}")


if __name__ == "__main__":
    main()
