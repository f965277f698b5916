"""`leanformer bench`: parameters, GFLOPs (multiply-adds), img/s and peak memory of one model."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from leanformer.commands._options import (
    add_model_arguments,
    forward_kwargs,
    model_options,
    parse_size,
    refuse_beside_checkpoint,
)

COMMAND = ("bench",)
HELP = "measure params, GFLOPs, throughput and peak memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, model_required=False)
    parser.add_argument("--checkpoint", help="bench a trained checkpoint instead of --model")
    # One input size or the other: an encoder's feature map comes from --feature-size when
    # given, so an --img-size beside it would be reported but unused.
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--img-size", type=int, help="input size (default: the model's)")
    size.add_argument("--feature-size", type=parse_size, help="feature-map size HxW for encoder models")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")


def run(args: argparse.Namespace) -> list[dict]:
    from leanformer.bench.report import bench_model, example_inputs
    from leanformer.models.registry import accepted_options, create_model, model_info

    options = model_options(args)
    torch.manual_seed(args.seed)
    refuse_beside_checkpoint(args, "--model", "--pretrained")
    if args.checkpoint:
        from leanformer.engine.checkpoint import load_model

        model = load_model(args.checkpoint, **options)
        name = getattr(model, "leanformer_name", "checkpoint")
    elif args.model:
        name = args.model
        accepted = accepted_options(model_info(name).cls) or set()
        if args.img_size is not None and "img_size" in accepted:
            options.setdefault("img_size", args.img_size)
        model = create_model(name, pretrained=args.pretrained, **options)
    else:
        raise ValueError("give --model NAME or --checkpoint PATH")
    model = model.to(args.device).eval()
    inputs = example_inputs(
        model, args.batch_size, img_size=args.img_size, feature_size=args.feature_size, device=args.device
    )
    kwargs = forward_kwargs(args, model)
    row: dict[str, Any] = {"model": name, **options, **kwargs, "batch_size": args.batch_size}
    if args.img_size is not None:
        row["img_size"] = args.img_size
    if args.feature_size is not None:
        row["feature_size"] = f"{args.feature_size[0]}x{args.feature_size[1]}"
    row.update(
        bench_model(
            model,
            inputs,
            forward_kwargs=kwargs,
            warmup=args.warmup,
            runs=args.runs,
            memory=not args.no_memory,
        )
    )
    if not args.json:
        mem = row.get("peak_mem_mb")
        mem_text = f", peak memory {mem:.1f} MB" if mem is not None else ""
        print(
            f"{name}: {row['params_m']:.2f}M params, {row['gflops']:.4g} GFLOPs/sample, "
            f"{row['img_per_s']:.1f} img/s (batch {args.batch_size}, {int(row['threads'])} threads){mem_text}"
        )
    return [row]
