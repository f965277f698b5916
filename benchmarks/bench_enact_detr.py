"""ENACT vs dense in a Hugging Face DETR-R50 (and DC5): encoder and whole-model time, peak memory.

Both detectors are ``DetrForObjectDetection`` with random weights built offline (timm
ResNet-50 backbone); the ENACT one is a copy patched with
``leanformer.patch.transformers.apply_enact``. For each backbone it times, side by side
and interleaved, the encoder forward, the encoder forward+backward and the whole-model
forward, and measures peak tensor memory (see ``leanformer.apps.hf_detr``).

Run (stable allocator, see docs/BENCHMARKS.md)::

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=1073741824 \
    HF_HUB_OFFLINE=1 python benchmarks/bench_enact_detr.py --backbones R50,DC5 --warmup 1 --runs 3

Prints a markdown table and appends one JSON object per measurement (with the machine,
command and date) to ``--out``, by default ``benchmarks/results/enact_detr.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from leanformer.apps.hf_detr import SCOPES, build_detr_pair, compare_dense_enact, photo_batch
from leanformer.bench.results import results_path, run_stamp, write_jsonl
from leanformer.commands._options import parse_size

BACKBONES = {"R50": False, "DC5": True}  # name -> dilation of the last ResNet stage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--img-size", type=parse_size, default=(800, 1066), help="HxW in pixels")
    p.add_argument("--backbones", default="R50,DC5", help="comma-separated: R50, DC5")
    p.add_argument("--scopes", default=",".join(SCOPES), help="comma-separated: " + ", ".join(SCOPES))
    p.add_argument("--sigma", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    p.add_argument("--out", default=str(results_path("enact_detr")))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    backbones = args.backbones.split(",")
    if any(b not in BACKBONES for b in backbones):
        p.error(f"--backbones: expected R50 and/or DC5, got {args.backbones!r}")
    stamp = run_stamp()
    pixels, mask = photo_batch(args.batch_size, args.img_size)
    rows: list[dict[str, Any]] = []
    for name in backbones:
        dense, enact = build_detr_pair(dilation=BACKBONES[name], sigma=args.sigma)
        for row in compare_dense_enact(
            dense,
            enact,
            pixels,
            mask,
            scopes=tuple(args.scopes.split(",")),
            warmup=args.warmup,
            runs=args.runs,
            memory=not args.no_memory,
        ):
            row = {
                **stamp,
                "backbone": name,
                "img_size": "{}x{}".format(*args.img_size),
                "sigma": args.sigma,
                **row,
            }
            rows.append(row)
            write_jsonl([row], args.out, append=True)  # as measured: a stopped run keeps its rows
            print(json.dumps(row), flush=True)
        del dense, enact

    print()
    print(
        f"batch {args.batch_size}, {rows[0]['threads'] if rows else '?'} threads, median of {args.runs} "
        "interleaved runs (ms); memory = peak tensor MB; L/HW = ENACT clusters per valid position"
    )
    print()
    print("| backbone | map | scope | L/HW | dense ms | ENACT ms | time ratio ", end="")
    print("| dense MB | ENACT MB | mem ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mem = (
            f"{r['dense_mb']:.0f} | {r['enact_mb']:.0f} | {r['mem_ratio']:.2f}"
            if "dense_mb" in r
            else "- | - | -"
        )
        print(
            f"| {r['backbone']} | {r['feature_size']} | {r['scope']} | {r['cluster_ratio']:.3f} "
            f"| {r['dense_ms']:.0f} | {r['enact_ms']:.0f} | {r['time_ratio']:.2f} | {mem} |"
        )
    print(f"\nappended to {args.out}")


if __name__ == "__main__":
    main()
