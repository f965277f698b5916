"""ENACT vs dense attention in a DETR encoder: time and peak tensor memory, side by side.

For each feature size, smoothing sigma and mode (forward / forward+backward) it times the
attention module, one encoder layer and the whole 6-layer encoder, dense and ENACT
(same weights), alternating the two runs so that load on the machine hits both alike.
It also times the cluster op (entropy + curvature signs + regions + weighted reduction)
against one ENACT encoder layer. Inputs are ``detr_encoder``'s ``example_inputs``:
bilinearly upsampled Gaussian noise (spatially smooth, like backbone features), every
other image padded.

Run (stable allocator, see docs/BENCHMARKS.md)::

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=1073741824 \
        python benchmarks/bench_enact.py --threads 1 --sizes 25x34,32x32 --runs 3 --warmup 1

Prints markdown tables and appends one JSON object per measurement (with the machine,
command and date) to ``--out``, by default ``benchmarks/results/enact.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

from leanformer import create_model
from leanformer.bench.memory import cpu_peak_mb
from leanformer.bench.results import results_path, run_stamp, write_jsonl
from leanformer.bench.timing import time_interleaved
from leanformer.models.detr import DETREncoder
from leanformer.ops.region_cluster import region_cluster


def time_pair(fns: dict[str, Callable[[], Any]], *, warmup: int, runs: int) -> dict[str, float]:
    """Median ms of each function, runs interleaved so that background load hits all alike."""
    return {name: value * 1e3 for name, value in time_interleaved(fns, warmup=warmup, runs=runs).items()}


def build_pair(sigma: float, seed: int = 0) -> tuple[DETREncoder, DETREncoder]:
    torch.manual_seed(seed)
    enact = create_model("detr_encoder", attention="enact", sigma=sigma)
    dense = create_model("detr_encoder", attention="dense")
    dense.load_state_dict(enact.state_dict(), strict=False)  # same weights; ENACT adds entropy_proj
    return dense, enact  # type: ignore[return-value]


def encoder_inputs(model: DETREncoder, feats: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """What the first encoder layer sees: ``src, pos [B, HW, d]``, spatial shape, key padding mask."""
    with torch.no_grad():
        pos = model.position(mask, dtype=feats.dtype).flatten(2).transpose(1, 2).contiguous()
        src = model.input_proj(feats).flatten(2).transpose(1, 2).contiguous()
    return {"src": src, "pos": pos, "shape": tuple(feats.shape[2:]), "kpm": mask.flatten(1)}


def scope_fn(model: DETREncoder, scope: str, feats: torch.Tensor, mask: torch.Tensor, mode: str):
    """A closure running ``scope`` of ``model`` once, forward or forward+backward."""
    inp = encoder_inputs(model, feats, mask)
    src = inp["src"].clone().requires_grad_(mode == "train")
    if scope == "attention":
        attn = model.layers[0].self_attn

        def run() -> torch.Tensor:
            return attn(src, inp["pos"], inp["shape"], inp["kpm"])
    elif scope == "layer":
        layer = model.layers[0]

        def run() -> torch.Tensor:
            return layer(src, inp["pos"], inp["shape"], inp["kpm"])
    else:

        def run() -> torch.Tensor:
            return model.forward_features(feats, mask)

    if mode == "fwd":

        def fwd() -> None:
            with torch.inference_mode():
                run()

        return fwd

    def train() -> None:
        run().square().mean().backward()
        # Freed inside the call so that the measured peak holds the gradients, as training would.
        model.zero_grad(set_to_none=True)

    return train


def cluster_share(sigma: float, feats: torch.Tensor, mask: torch.Tensor, *, warmup: int, runs: int) -> dict:
    """Forward time of the cluster op (entropy, signs, regions, reduction) vs one ENACT encoder layer."""
    _, enact = build_pair(sigma)
    enact.eval()
    inp = encoder_inputs(enact, feats, mask)
    layer = enact.layers[0]
    attn = layer.self_attn
    valid = ~inp["kpm"]
    x, pos = inp["src"], inp["pos"]

    def cluster_op() -> None:
        with torch.inference_mode():
            qk = x + pos
            entropy = attn.entropy(qk, valid)
            plan = attn.plan(entropy, inp["shape"], valid)
            region_cluster(entropy, plan, qk, x)

    def one_layer() -> None:
        with torch.inference_mode():
            layer(x, pos, inp["shape"], inp["kpm"])

    t = time_pair({"cluster": cluster_op, "layer": one_layer}, warmup=warmup, runs=runs)
    return {"cluster_ms": t["cluster"], "layer_ms": t["layer"], "share": t["cluster"] / t["layer"]}


def parse_size(text: str) -> tuple[int, int]:
    h, _, w = text.lower().partition("x")
    return int(h), int(w)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="25x34,32x32,50x68", help="feature sizes HxW, comma-separated")
    p.add_argument("--sigmas", default="3,0", help="ENACT smoothing sigmas, comma-separated")
    p.add_argument("--modes", default="fwd,train", help="fwd and/or train (forward+backward)")
    p.add_argument("--scopes", default="attention,layer,encoder", help="comma-separated, or 'none'")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    p.add_argument("--out", default=str(results_path("enact")))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    sigmas = [float(s) for s in args.sigmas.split(",")]
    modes = args.modes.split(",")
    scopes = [] if args.scopes == "none" else args.scopes.split(",")
    if any(s not in ("attention", "layer", "encoder") for s in scopes):
        p.error(f"--scopes: expected attention, layer, encoder or none, got {args.scopes!r}")
    rows: list[dict[str, Any]] = []
    env = {**run_stamp(), "batch_size": args.batch_size}

    for H, W in sizes:
        for sigma in sigmas:
            dense, enact = build_pair(sigma)
            feats, mask = enact.example_inputs(args.batch_size, feature_size=(H, W))
            for mode in modes:
                dense.train(mode == "train")
                enact.train(mode == "train")
                for scope in scopes:
                    fns = {
                        "dense": scope_fn(dense, scope, feats, mask, mode),
                        "enact": scope_fn(enact, scope, feats, mask, mode),
                    }
                    t = time_pair(fns, warmup=args.warmup, runs=args.runs)
                    per_layer = enact.cluster_ratios()
                    ratio = statistics.mean(per_layer) if scope == "encoder" else per_layer[0]
                    row: dict[str, Any] = {
                        "size": f"{H}x{W}",
                        "sigma": sigma,
                        "mode": mode,
                        "scope": scope,
                        "dense_ms": round(t["dense"], 3),
                        "enact_ms": round(t["enact"], 3),
                        "time_ratio": round(t["enact"] / t["dense"], 3),
                        "cluster_ratio": round(ratio, 4),
                        **env,
                    }
                    if not args.no_memory:
                        md, me = cpu_peak_mb(fns["dense"]), cpu_peak_mb(fns["enact"])
                        row.update(dense_mb=round(md, 2), enact_mb=round(me, 2), mem_ratio=round(me / md, 3))
                    rows.append(row)
                    write_jsonl([row], args.out, append=True)  # as measured: a stopped run keeps its rows
                    print(json.dumps(row), flush=True)
    share_rows = []
    H, W = sizes[0]
    for sigma in sigmas:
        _, enact = build_pair(sigma)
        feats, mask = enact.example_inputs(args.batch_size, feature_size=(H, W))
        s = cluster_share(sigma, feats, mask, warmup=args.warmup, runs=args.runs)
        row = {"size": f"{H}x{W}", "sigma": sigma, "kind": "cluster_share", **s, **env}
        share_rows.append(row)
        write_jsonl([row], args.out, append=True)

    print()
    print(
        f"batch {args.batch_size}, {env['threads']} threads, median of {args.runs} runs (ms); "
        "memory = peak tensor MB"
    )
    print()
    print(
        "| size | sigma | mode | scope | L/HW | dense ms | ENACT ms | time ratio "
        "| dense MB | ENACT MB | mem ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mem = (
            f"{r['dense_mb']:.1f} | {r['enact_mb']:.1f} | {r['mem_ratio']:.2f}"
            if "dense_mb" in r
            else "- | - | -"
        )
        print(
            f"| {r['size']} | {r['sigma']:g} | {r['mode']} | {r['scope']} | {r['cluster_ratio']:.3f} "
            f"| {r['dense_ms']:.2f} | {r['enact_ms']:.2f} | {r['time_ratio']:.2f} | {mem} |"
        )
    print()
    print("| size | sigma | cluster op ms | ENACT layer ms | share |")
    print("|---|---|---|---|---|")
    for r in share_rows:
        print(
            f"| {r['size']} | {r['sigma']:g} | {r['cluster_ms']:.2f} | {r['layer_ms']:.2f} "
            f"| {r['share']:.1%} |"
        )
    print(f"\nappended to {args.out}")


if __name__ == "__main__":
    main()
