"""Reducer speed where per-call overhead shows: a small model, batch 1, SReT's slices; eager and compiled.

Parts (``--parts``, comma-separated), each timed side by side in one process, every
candidate called in turn on every run (``leanformer.bench.timing.time_interleaved``),
medians over runs:

- ``digits``: ``deit_digits`` (65 tokens) at batch 64, every method of ``make demo`` at
  its four budgets, against ``pool=none``. Goal: img/s above the unpooled model's and
  speedup at least 0.6x the FLOPs ratio (base GFLOPs / pooled GFLOPs).
- ``deit_small``: ``deit_small`` at ``deit_s_level3``: ``wkmedoids`` and ``merge`` against
  ``none``, at ``--deit-batches`` (default 1 and 32). Goals: wkmedoids at least 0.95x
  merge's img/s; speedup at least 0.9x the FLOPs ratio at batch 32.
- ``reducers``: every reducer of ``deit_small`` at ``deit_s_level3`` (``wkmedoids`` and
  ``merge``), each called on the inputs it got in one forward of the model (the strided
  token views a block hands over, their sizes and scores), at ``--deit-batches``: where
  the two methods' reduction costs differ, layer by layer.
- ``layer``: one weighted K-Medoids layer (batch 32, N = 197 with the class token,
  C = 384, K = 98, 5 iterations; ``--layer-shape 8,785,392`` for the 448-px case) as a
  fraction of one DeiT-S block on the same input. Goal: at most 5% eager, 3% compiled.
- ``sret``: ``sret_tiny`` against ``sret_tiny_unsliced`` at 224, batch 32. Goal: speedup
  at least 0.9x their FLOPs ratio.
- ``fashion``: ``deit_fashion`` (197 tokens, width 64) at the ``tradeoff_fashion`` budgets:
  ``stepmerge`` against ``merge`` (and ``none``), at ``--deit-batches``; ``--fashion-methods``
  picks other methods and ``--fashion-gflops`` GFLOPs budgets instead of keep ratios. Goal:
  each method at least 0.9x merge's img/s at every budget.

With ``--compile`` every candidate is also compiled (``torch.compile(fullgraph=True)``,
inductor) and timed beside its eager self; compile times are reported apart. Set the
allocator first, and ``--threads``:

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=1073741824 \\
        python benchmarks/bench_small_models.py --parts digits --threads 1 --compile

Prints markdown tables and appends JSON lines (with the machine, command and date) to
``--out``, by default ``benchmarks/results/small_models.jsonl``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from leanformer.apps.tradeoff import solve_method_budget
from leanformer.bench.compiled import compile_for_inference
from leanformer.bench.flops import count_gflops
from leanformer.bench.results import results_path, run_stamp, write_jsonl
from leanformer.bench.timing import time_interleaved
from leanformer.commands.demo_tokenpool import DIGITS_SWEEP
from leanformer.layers.block import Block
from leanformer.models.registry import create_model
from leanformer.pooling.reducer import TokenReducer
from leanformer.pooling.registry import build_reducers

ALLOCATOR = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _label(keep: Any) -> str:
    return "/".join(str(k) for k in keep) if isinstance(keep, list) else str(keep)


def compare_models(
    part: str,
    models: dict[str, nn.Module],
    x: Tensor,
    *,
    baseline: str,
    args: argparse.Namespace,
    extra: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """img/s of every model (eager, and compiled with ``--compile``) on ``x``, interleaved."""
    fns: dict[str, Callable[[], Any]] = {}
    compile_s: dict[str, float] = {}
    gflops = {name: count_gflops(m.eval(), (x[:1],)) for name, m in models.items()}
    for name, model in models.items():
        fns[f"{name}|eager"] = lambda m=model: m(x)
        if args.compile:
            # No reset between models: every compiled model is timed after the last compiles.
            compiled, compile_s[name] = compile_for_inference(model, (x,))
            fns[f"{name}|compiled"] = lambda m=compiled: m(x)
    with torch.inference_mode():
        seconds = time_interleaved(fns, warmup=args.warmup, runs=args.runs)
    rows = []
    modes = ("eager", "compiled") if args.compile else ("eager",)
    for name in models:
        for mode in modes:
            t, t_base = seconds[f"{name}|{mode}"], seconds[f"{baseline}|{mode}"]
            flops_ratio = gflops[baseline] / gflops[name]
            rows.append(
                {
                    "part": part,
                    "name": name,
                    "mode": mode,
                    "batch": int(x.shape[0]),
                    "threads": torch.get_num_threads(),
                    "gflops": gflops[name],
                    "img_per_s": x.shape[0] / t,
                    "speedup": t_base / t,
                    "flops_ratio": flops_ratio,
                    "speedup_over_flops_ratio": (t_base / t) / flops_ratio,
                    "compile_s": compile_s.get(name) if mode == "compiled" else None,
                    **(extra or {}).get(name, {}),
                }
            )
    return rows


def bench_digits(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    base = create_model("deit_digits").eval()
    models: dict[str, nn.Module] = {"none": base}
    extra: dict[str, dict[str, Any]] = {"none": {"method": "none", "keep": "all"}}
    for method in args.methods or DIGITS_SWEEP["methods"]:
        for keep in [DIGITS_SWEEP["budgets"][i] for i in args.budgets]:
            name = f"{method} {_label(keep)}"
            model = create_model("deit_digits", pool=method, keep=keep, carry=True)
            model.load_state_dict(base.state_dict())
            models[name] = model.eval()
            extra[name] = {"method": method, "keep": _label(keep)}
    x = torch.randn(64, 1, 32, 32)
    return compare_models("digits", models, x, baseline="none", args=args, extra=extra)


def _deit_small_level3() -> dict[str, nn.Module]:
    """``deit_small`` unpooled (``none``) and with ``wkmedoids`` and ``merge`` at
    ``deit_s_level3``, all holding the same weights, in eval mode."""
    torch.manual_seed(0)
    base = create_model("deit_small").eval()
    models: dict[str, nn.Module] = {"none": base}
    for method in ("wkmedoids", "merge"):
        model = create_model("deit_small", pool=method, keep="deit_s_level3", carry=True)
        model.load_state_dict(base.state_dict())
        models[method] = model.eval()
    return models


def bench_deit_small(args: argparse.Namespace) -> list[dict[str, Any]]:
    models = _deit_small_level3()
    rows = []
    for batch in args.deit_batches:
        rows += compare_models(
            "deit_small", models, torch.randn(batch, 3, 224, 224), baseline="none", args=args
        )
    return rows


def _recorded_reducer_calls(model: nn.Module, x: Tensor) -> list[tuple[nn.Module, tuple[Any, ...]]]:
    """Every reducer of ``model`` with the arguments it was called with in one forward on ``x``."""
    calls: list[tuple[nn.Module, tuple[Any, ...]]] = []
    hooks = [
        module.register_forward_pre_hook(lambda mod, inputs: calls.append((mod, inputs)))
        for module in model.modules()
        if isinstance(module, TokenReducer)
    ]
    with torch.inference_mode():
        model(x)
    for hook in hooks:
        hook.remove()
    return calls


def _reducer_row(
    method: str, batch: int, layer: int | str, tokens: tuple[int, int] | None, seconds: float
) -> dict[str, Any]:
    tokens_in, tokens_out = tokens or (None, None)
    return {
        "part": "reducers",
        "name": method,
        "batch": batch,
        "layer": layer,
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
        "ms": seconds * 1e3,
        "threads": torch.get_num_threads(),
    }


def bench_reducers(args: argparse.Namespace) -> list[dict[str, Any]]:
    models = {name: model for name, model in _deit_small_level3().items() if name != "none"}
    rows = []
    for batch in args.deit_batches:
        x = torch.randn(batch, 3, 224, 224)
        fns: dict[tuple[str, int], Callable[[], Any]] = {}
        shapes: dict[tuple[str, int], tuple[int, int]] = {}
        for method, model in models.items():
            for layer, (reducer, inputs) in enumerate(_recorded_reducer_calls(model, x)):
                fns[method, layer] = lambda r=reducer, a=inputs: r(*a)
                with torch.inference_mode():
                    shapes[method, layer] = (inputs[0].shape[1], reducer(*inputs)[0].shape[1])
        with torch.inference_mode():
            seconds = time_interleaved(fns, warmup=args.warmup, runs=args.runs)
        for method in models:
            layers = [key for key in fns if key[0] == method]
            rows += [_reducer_row(method, batch, key[1], shapes[key], seconds[key]) for key in layers]
            rows.append(_reducer_row(method, batch, "all", None, sum(seconds[key] for key in layers)))
    return rows


def bench_layer(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    B, N, K = args.layer_shape
    C = 384
    side = math.isqrt(N - 1)
    if side * side != N - 1 or not 1 <= K < N - 1:
        raise SystemExit(
            f"--layer-shape: N - 1 = {N - 1} patch tokens must be a square grid and 1 <= K < N - 1"
        )
    block = Block(C, num_heads=6).eval()
    x = torch.randn(B, N, C)
    with torch.inference_mode():
        _, received = block.attn(block.norm1(x), need_received=True)
        feats = block(x)
    assert received is not None
    tokens, scores = feats[:, 1:].contiguous(), received[:, 1:].contiguous()
    (layer,) = build_reducers(
        method="wkmedoids",
        keep=[K],
        depth=1,
        num_tokens=N - 1,
        dim=C,
        grid_size=(side, side),
        carry=True,
        max_iters=5,
    )
    assert layer is not None
    layer.eval()
    fns: dict[str, Callable[[], Any]] = {
        "block|eager": lambda: block(x),
        "layer|eager": lambda: layer(tokens, None, scores),
    }
    compile_s: dict[str, float] = {}
    if args.compile:
        torch._dynamo.reset()
        block_c, compile_s["block"] = compile_for_inference(block, (x,))
        layer_c, compile_s["layer"] = compile_for_inference(layer, (tokens, None, scores))
        fns["block|compiled"] = lambda: block_c(x)
        fns["layer|compiled"] = lambda: layer_c(tokens, None, scores)
    with torch.inference_mode():
        seconds = time_interleaved(fns, warmup=args.warmup, runs=args.runs)
    rows = []
    for mode in ("eager", "compiled") if args.compile else ("eager",):
        rows.append(
            {
                "part": "layer",
                "name": "wkmedoids layer / DeiT-S block",
                "mode": mode,
                "batch": B,
                "tokens": N,
                "clusters": K,
                "threads": torch.get_num_threads(),
                "layer_ms": seconds[f"layer|{mode}"] * 1e3,
                "block_ms": seconds[f"block|{mode}"] * 1e3,
                "fraction_of_block": seconds[f"layer|{mode}"] / seconds[f"block|{mode}"],
                "compile_s": compile_s.get("layer") if mode == "compiled" else None,
            }
        )
    return rows


def bench_sret(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    models = {name: create_model(name).eval() for name in ("sret_tiny_unsliced", "sret_tiny")}
    x = torch.randn(32, 3, 224, 224)
    return compare_models("sret", models, x, baseline="sret_tiny_unsliced", args=args)


def _fashion_keeps(args: argparse.Namespace, base: nn.Module, method: str) -> list[Any]:
    """The keep ratios of configs/tradeoff_fashion.yaml, or with ``--fashion-gflops`` the
    constant per-block ratios solved to those GFLOPs fractions (as a sweep solves them)."""
    if not args.fashion_gflops:
        return list(FASHION_BUDGETS)
    example = torch.zeros(1, 1, 28, 28)
    return [
        solve_method_budget(
            base, method, {"gflops": g}, example, carry=True, options={}, name=f"{method} at g{g}"
        )
        for g in args.fashion_gflops
    ]


def bench_fashion(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    base = create_model("deit_fashion").eval()
    keeps = {method: _fashion_keeps(args, base, method) for method in args.fashion_methods}
    rows = []
    for point in range(len(next(iter(keeps.values())))):
        models: dict[str, nn.Module] = {"none": base}
        for method in args.fashion_methods:
            keep = keeps[method][point]
            model = create_model("deit_fashion", pool=method, keep=keep, carry=True)
            model.load_state_dict(base.state_dict())
            label = f"g{args.fashion_gflops[point]}" if args.fashion_gflops else keep
            models[f"{method} {label}"] = model.eval()
        for batch in args.deit_batches:
            rows += compare_models(
                "fashion", models, torch.randn(batch, 1, 28, 28), baseline="none", args=args
            )
    return rows


# The keep ratios of configs/tradeoff_fashion.yaml.
FASHION_BUDGETS = (0.97, 0.9, 0.8, 0.68, 0.62, 0.5)

PARTS = {
    "digits": bench_digits,
    "deit_small": bench_deit_small,
    "reducers": bench_reducers,
    "layer": bench_layer,
    "sret": bench_sret,
    "fashion": bench_fashion,
}


def _table(rows: list[dict[str, Any]]) -> str:
    cols = [c for c in rows[0] if c not in ("part", "threads")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        cells = [f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--parts", default="digits,deit_small,layer,sret")
    p.add_argument(
        "--methods", default=None, help="digits part: comma-separated methods (default: the demo's)"
    )
    p.add_argument(
        "--budgets", default="0,1,2,3", help="digits part: which of the demo's four budgets (0 = mildest)"
    )
    p.add_argument("--deit-batches", default="1,32")
    p.add_argument("--fashion-methods", default="merge,stepmerge", help="fashion part: methods compared")
    p.add_argument(
        "--fashion-gflops",
        default=None,
        help="fashion part: GFLOPs fractions, e.g. 0.5,0.35 (each method's constant ratio is solved "
        "to them); default: the keep ratios of configs/tradeoff_fashion.yaml",
    )
    p.add_argument(
        "--layer-shape",
        default="32,197,98",
        help="layer part: batch, tokens N (class token included) and clusters K, e.g. 8,785,392",
    )
    p.add_argument("--compile", action="store_true", help="also time every candidate compiled")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--out", default=str(results_path("small_models")))
    args = p.parse_args()
    args.methods = [m for m in args.methods.split(",") if m] if args.methods else None
    args.deit_batches = [int(b) for b in args.deit_batches.split(",")]
    args.fashion_methods = [m for m in args.fashion_methods.split(",") if m]
    args.fashion_gflops = [float(g) for g in args.fashion_gflops.split(",")] if args.fashion_gflops else None
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.layer_shape = [int(v) for v in args.layer_shape.split(",")]
    if len(args.layer_shape) != 3:
        p.error("--layer-shape takes three integers: batch,tokens,clusters")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts: {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    meta = run_stamp()
    meta["allocator"] = {k: os.environ.get(k) for k in ALLOCATOR}
    for part in parts:
        rows = PARTS[part](args)
        print(f"\n### {part} ({meta['threads']} threads)\n")
        print(_table(rows))
        write_jsonl([{**row, **meta} for row in rows], args.out, append=True)


if __name__ == "__main__":
    main()
