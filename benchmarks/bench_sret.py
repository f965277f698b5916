"""SReT benchmark: sliced group attention vs full attention, and whole models sliced vs unsliced.

1. Attention at SReT-T's stage-1 shape (28x28 = 784 tokens, dim 64, 2 heads): the fused
   attention kernel on G groups (``[B*G, H, N/G, D]``) against full attention
   (``[B, H, N, D]``), and the whole sliced-attention layer (qkv, permutation, inverse,
   proj) against the same layer with G = 1. Goal: kernel time <= 1.5 / G of full.
2. The same kernel timed inside the layer (``--layer-batches``): every attention call of
   the layer, full (G = 1) and sliced, on the q/k/v its own qkv projection has just
   written, as in a model. Step 1 times the kernel alone, interleaved with the other
   variants, so its inputs are cold; the sliced kernel does 1/G of the arithmetic on
   the same bytes, so reading them cold costs it relatively more.
3. Kernel cost per attention score at several sequence lengths with the same number of
   tokens (``--score-lengths``): why G short sequences cost more than 1/G of one long one.
4. Whole models at 224x224: GFLOPs (multiply-adds) and img/s, sliced vs unsliced.

Timings alternate between the variants in one process and report medians. Run with
the allocator setting of docs/BENCHMARKS.md. Prints a markdown table and appends JSON
lines (with the machine, command and date) to ``--out``, by default
``benchmarks/results/sret.jsonl``.

    python benchmarks/bench_sret.py --threads 1 --batch 8 --runs 10 --model-batch 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from leanformer import create_model
from leanformer.bench.flops import count_gflops
from leanformer.bench.results import results_path, run_stamp, write_jsonl
from leanformer.bench.throughput import measure_throughput
from leanformer.bench.timing import time_interleaved
from leanformer.layers import sliced_attention
from leanformer.layers.sliced_attention import SlicedGroupAttention


def time_side_by_side(fns: dict[str, Callable[[], object]], *, warmup: int, runs: int) -> dict[str, float]:
    """Median milliseconds per call of each function, the calls interleaved round-robin."""
    with torch.inference_mode():
        seconds = time_interleaved(fns, warmup=warmup, runs=runs)
    return {name: value * 1e3 for name, value in seconds.items()}


def bench_attention(batch: int, groups: int, tokens: int, dim: int, heads: int, runs: int) -> list[dict]:
    torch.manual_seed(0)
    d = dim // heads
    q, k, v = (torch.randn(batch, heads, tokens, d) for _ in range(3))

    # The layer's layout: group g of sample b is row b*G + g (prepared outside the timing,
    # as the layer's qkv projection produces it directly).
    n = tokens // groups
    qs, ks, vs = (t.transpose(1, 2).reshape(batch * groups, n, heads, d).transpose(1, 2) for t in (q, k, v))

    qc, kc, vc = (t.contiguous() for t in (qs, ks, vs))

    def sliced_kernel() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, ks, vs)

    def sliced_kernel_contiguous() -> torch.Tensor:
        return F.scaled_dot_product_attention(qc, kc, vc)

    layer = SlicedGroupAttention(dim, num_heads=heads).eval()
    x = torch.randn(batch, tokens, dim)
    ms = time_side_by_side(
        {
            "full kernel": lambda: F.scaled_dot_product_attention(q, k, v),
            "sliced kernel": sliced_kernel,
            "sliced kernel, contiguous inputs": sliced_kernel_contiguous,
            "full layer": lambda: layer(x, groups=1),
            "sliced layer": lambda: layer(x, groups=groups),
            "sliced layer + permutation": lambda: layer(x, groups=groups, permute=True),
        },
        warmup=3,
        runs=runs,
    )
    shape = f"B={batch}, N={tokens}, C={dim}, H={heads}, G={groups}"
    rows = []
    for name, t in ms.items():
        base = ms["full kernel"] if "kernel" in name else ms["full layer"]
        rows.append(
            {
                "bench": "sret_attention",
                "variant": name,
                "shape": shape,
                "ms": round(t, 3),
                "ratio_to_full": round(t / base, 4),
                "goal_ratio": round(1.5 / groups, 4) if name.startswith("sliced kernel") else None,
                "threads": torch.get_num_threads(),
            }
        )
    return rows


@contextmanager
def timed_layer_attention(record: list[float]) -> Iterator[None]:
    """Append the wall time of every attention call the sliced layer makes to ``record``."""
    original = sliced_attention.attention

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = original(*args, **kwargs)
        record.append(time.perf_counter() - start)
        return out

    sliced_attention.attention = timed
    try:
        yield
    finally:
        sliced_attention.attention = original


def bench_attention_in_layer(
    batches: list[int], groups: int, tokens: int, dim: int, heads: int, runs: int
) -> list[dict]:
    """The attention kernel's time inside :class:`SlicedGroupAttention`, full vs sliced.

    Each call of the layer runs its qkv projection, then the kernel on that fresh output
    (the layer's strided layout), then the output projection; only the kernel is timed.
    Full (G = 1), sliced and sliced with permutation alternate call by call.
    """
    rows = []
    variants = {"full": (1, False), "sliced": (groups, False), "sliced + permutation": (groups, True)}
    for batch in batches:
        torch.manual_seed(0)
        layer = SlicedGroupAttention(dim, num_heads=heads).eval()
        x = torch.randn(batch, tokens, dim)
        times: dict[str, list[float]] = {name: [] for name in variants}
        record: list[float] = []
        with torch.inference_mode(), timed_layer_attention(record):
            for i in range(3 + runs):
                for name, (g, permute) in variants.items():
                    record.clear()
                    layer(x, groups=g, permute=permute)
                    if i >= 3:  # warm-up calls are not counted
                        times[name].extend(record)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        for name, t in ms.items():
            rows.append(
                {
                    "bench": "sret_attention_in_layer",
                    "variant": name,
                    "shape": f"B={batch}, N={tokens}, C={dim}, H={heads}, G={groups}",
                    "batch": batch,
                    "ms": round(t, 3),
                    "ratio_to_full": round(t / ms["full"], 4),
                    "goal_ratio": None if name == "full" else round(1.5 / groups, 4),
                    "threads": torch.get_num_threads(),
                }
            )
    return rows


def bench_score_cost(total_tokens: int, lengths: list[int], dim: int, heads: int, runs: int) -> list[dict]:
    """Nanoseconds per attention score (query-key pair and head) of the fused kernel.

    Every length gets the same number of tokens (``total_tokens // n`` sequences of
    ``n``) with contiguous ``[S, H, n, D]`` inputs, so only the sequence length changes.
    """
    torch.manual_seed(0)
    d = dim // heads
    inputs = {n: [torch.randn(total_tokens // n, heads, n, d) for _ in range(3)] for n in lengths}
    ms = time_side_by_side(
        {f"n={n}": (lambda t=t: F.scaled_dot_product_attention(*t)) for n, t in inputs.items()},
        warmup=3,
        runs=runs,
    )
    rows = []
    for n in lengths:
        scores = (total_tokens // n) * heads * n * n
        rows.append(
            {
                "bench": "sret_score_cost",
                "seq_len": n,
                "sequences": total_tokens // n,
                "heads": heads,
                "head_dim": d,
                "ms": round(ms[f"n={n}"], 3),
                "ns_per_score": round(ms[f"n={n}"] * 1e6 / scores, 3),
                "threads": torch.get_num_threads(),
            }
        )
    return rows


def bench_models(names: list[str], batch: int, img_size: int, runs: int) -> list[dict]:
    rows = []
    models = {n: create_model(n, img_size=img_size).eval() for n in names}
    x = torch.randn(batch, 3, img_size, img_size)
    gflops = {n: count_gflops(m, (x[:1],)) for n, m in models.items()}
    # Alternate whole measurements so load changes hit every model alike.
    speeds: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(3):
        for n, m in models.items():
            speeds[n].append(measure_throughput(m, (x,), warmup=1, runs=runs)["img_per_s"])
    for n, m in models.items():
        rows.append(
            {
                "bench": "sret_model",
                "model": n,
                "img_size": img_size,
                "batch": batch,
                "params_m": round(sum(p.numel() for p in m.parameters()) / 1e6, 3),
                "gflops": round(gflops[n], 4),
                "img_per_s": round(statistics.median(speeds[n]), 2),
                "threads": torch.get_num_threads(),
            }
        )
    return rows


def print_ratio_table(title: str, rows: list[dict], label: Callable[[dict], str]) -> None:
    """A markdown table of attention rows: ms, ratio to full, and the goal where it applies."""
    print(f"\n{title}, median ms, {rows[0]['threads']} threads\n")
    print("| variant | ms | ratio to full | goal |")
    print("|---|---:|---:|---:|")
    for r in rows:
        goal = f"<= {r['goal_ratio']:.3f}" if r["goal_ratio"] is not None else ""
        print(f"| {label(r)} | {r['ms']:.2f} | {r['ratio_to_full']:.3f} | {goal} |")


def print_tables(att: list[dict], in_layer: list[dict], score: list[dict], mod: list[dict]) -> None:
    print_ratio_table(f"Sliced group attention ({att[0]['shape']})", att, lambda r: r["variant"])
    if in_layer:
        print_ratio_table(
            "Attention kernel inside the layer", in_layer, lambda r: f"B={r['batch']}, {r['variant']}"
        )
    if score:
        print(f"\nFused kernel cost per score, {score[0]['heads']} heads of dim {score[0]['head_dim']}\n")
        print("| sequence length | sequences | ms | ns per score |")
        print("|---:|---:|---:|---:|")
        for r in score:
            print(f"| {r['seq_len']} | {r['sequences']} | {r['ms']:.2f} | {r['ns_per_score']:.2f} |")
    print("\nWhole models\n")
    print("| model | img size | params (M) | GFLOPs | img/s (batch) |")
    print("|---|---:|---:|---:|---:|")
    for r in mod:
        print(
            f"| {r['model']} | {r['img_size']} | {r['params_m']:.2f} | {r['gflops']:.3f} | "
            f"{r['img_per_s']:.1f} ({r['batch']}) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(results_path("sret")), help="JSON lines output")
    parser.add_argument("--batch", type=int, default=32, help="attention benchmark batch size")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--runs", type=int, default=10, help="timed runs per variant")
    parser.add_argument("--model-batch", type=int, default=16)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument(
        "--models", default="sret_tiny,sret_tiny_unsliced", help="comma-separated models to compare"
    )
    parser.add_argument(
        "--score-lengths",
        default="784,392,196,128,98,96",
        help="comma-separated sequence lengths for the per-score kernel cost ('' to skip)",
    )
    parser.add_argument(
        "--layer-batches",
        default="4,8,16,32",
        help="comma-separated batch sizes for the kernel timed inside the layer ('' to skip)",
    )
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    att = bench_attention(args.batch, args.groups, tokens=784, dim=64, heads=2, runs=args.runs)
    layer_batches = [int(b) for b in args.layer_batches.split(",") if b]
    in_layer = bench_attention_in_layer(
        layer_batches, args.groups, tokens=784, dim=64, heads=2, runs=args.runs
    )
    lengths = [int(n) for n in args.score_lengths.split(",") if n]
    score = bench_score_cost(args.batch * 784, lengths, dim=64, heads=2, runs=args.runs) if lengths else []
    mod = bench_models(
        [n for n in args.models.split(",") if n], args.model_batch, args.img_size, max(args.runs // 2, 2)
    )
    print_tables(att, in_layer, score, mod)
    stamp = run_stamp()
    rows = [{**stamp, **row} for row in att + in_layer + score + mod]
    out = write_jsonl(rows, args.out, append=True)
    print(f"\nwrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
