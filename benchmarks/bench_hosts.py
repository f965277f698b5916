"""Token reduction on third-party hosts: a timm ViT-S/16 and a Hugging Face ``ViTModel`` of
the same shape, unpatched and patched through ``leanformer.apply_token_pooling``.

Every model runs round-robin in one process (``time_interleaved``), so background load
hits all alike; the figures to quote are each host's speedup over its own unpatched
model, next to its GFLOPs ratio. Random weights (nothing is downloaded); the cost does
not depend on them. Prints a markdown table and appends JSON lines (with the machine,
command and date) to ``--out``, by default ``benchmarks/results/hosts.jsonl``.

    python benchmarks/bench_hosts.py --batch 8 --runs 5
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from typing import Any

import timm
import torch
from torch import nn

import leanformer
from leanformer.bench.flops import count_gflops
from leanformer.bench.results import results_path, run_stamp, write_jsonl
from leanformer.bench.timing import time_interleaved

ALLOCATOR = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
VARIANTS = (("merge", "r16"), ("wkmedoids", "deit_s_level3"), ("powerbert", "deit_s_level3"))


def hosts() -> dict[str, nn.Module]:
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=384, num_attention_heads=6, intermediate_size=1536)
    return {
        f"timm {timm.__version__} vit_small_patch16_224": timm.create_model(
            "vit_small_patch16_224", pretrained=False
        ).eval(),
        f"transformers {transformers.__version__} ViTModel (ViT-S shape)": transformers.ViTModel(
            config, add_pooling_layer=False
        ).eval(),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    models: dict[tuple[str, str, str], nn.Module] = {}
    for host, base in hosts().items():
        models[(host, "none", "all")] = base
        for method, keep in VARIANTS:
            patched = leanformer.apply_token_pooling(copy.deepcopy(base), keep=keep, method=method)
            models[(host, method, keep)] = patched
    x = torch.randn(args.batch, 3, 224, 224)
    gflops = {key: count_gflops(m, (x[:1],)) for key, m in models.items()}
    with torch.inference_mode():
        t = time_interleaved(
            {str(key): (lambda m=m: m(x)) for key, m in models.items()},
            warmup=args.warmup,
            runs=args.runs,
            clock=time.perf_counter,
        )
    rows = []
    for (host, method, keep), _ in models.items():
        ref = (host, "none", "all")
        rows.append(
            {
                "host": host,
                "method": method,
                "keep": keep,
                "gflops": gflops[(host, method, keep)],
                "flops_ratio": gflops[ref] / gflops[(host, method, keep)],
                "img_per_s": args.batch / t[str((host, method, keep))],
                "speedup": t[str(ref)] / t[str((host, method, keep))],
                "batch": args.batch,
                "threads": torch.get_num_threads(),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default=str(results_path("hosts")))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [{**run_stamp(), **row} for row in run(args)]
    write_jsonl(rows, args.out, append=True)
    print("| host | method | keep | GFLOPs | FLOPs ratio | img/s | speedup |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['host']} | {r['method']} | {r['keep']} | {r['gflops']:.2f} | {r['flops_ratio']:.2f}x "
            f"| {r['img_per_s']:.1f} | {r['speedup']:.2f}x |"
        )
    allocator = {k: os.environ.get(k) for k in ALLOCATOR}
    print(f"\nbatch={args.batch}, runs={args.runs}, threads={torch.get_num_threads()}, allocator={allocator}")


if __name__ == "__main__":
    main()
