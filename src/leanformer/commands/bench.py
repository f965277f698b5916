"""`leanformer bench`: parameters, GFLOPs (multiply-adds), img/s and peak memory of one model."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from leanformer.commands import _hf_detr
from leanformer.commands._hosts import add_host_arguments, build_host_model, host_name
from leanformer.commands._options import (
    add_model_arguments,
    forward_kwargs,
    model_options,
    parse_size,
    refuse_beside_checkpoint,
)

COMMAND = ("bench",)
# Model options every row reports, given or not (the token-pooling ones).
STANDARD_OPTIONS = ("pool", "keep", "carry")
HELP = "measure params, GFLOPs, throughput and peak memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--checkpoint", help="bench a trained checkpoint (file or run folder) instead of --model"
    )
    parser.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="load a checkpoint whose weights hold NaN or inf (refused otherwise)",
    )
    add_host_arguments(parser)
    # One input size or the other: an encoder's feature map comes from --feature-size when
    # given, so an --img-size beside it would be reported but unused.
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--img-size",
        type=parse_img_size,
        help="input size, or HxW for --hf-model detr (default: the model's)",
    )
    size.add_argument(
        "--feature-size",
        type=parse_size,
        help="feature-map size HxW for encoder models (default: the model's)",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="images per forward pass")
    parser.add_argument("--warmup", type=int, default=3, help="untimed forward passes before timing")
    parser.add_argument("--runs", type=int, default=10, help="timed forward passes")
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the forward activations peak measurement"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="time torch.compile(model, fullgraph=True); the compile time is reported separately",
    )
    _hf_detr.add_arguments(parser)


def parse_img_size(text: str) -> int | tuple[int, int]:
    """``"224"`` -> 224; ``"800x1066"`` -> ``(800, 1066)``."""
    h, w = parse_size(text)
    return h if "x" not in text.lower() else (h, w)


def _int_or_none(size: Any) -> int | None:
    if isinstance(size, int):
        return size
    if isinstance(size, tuple | list) and size and isinstance(size[0], int):
        return size[0]
    return None


def run(args: argparse.Namespace) -> list[dict]:
    if args.allow_nonfinite and not args.checkpoint:
        raise ValueError("--allow-nonfinite is for the weights of a --checkpoint; give --checkpoint")
    if _hf_detr.is_requested(args):
        return _hf_detr.run(args)
    _hf_detr.refuse_detr_flags(args)
    if isinstance(args.img_size, tuple):
        raise ValueError("--img-size HxW is for --hf-model detr; give one number for other models")
    if host_name(args):
        return _run_host(args)
    from leanformer.bench.report import bench_model, example_inputs
    from leanformer.models.registry import accepted_options, create_model, model_info

    options = model_options(args)
    torch.manual_seed(args.seed)
    refuse_beside_checkpoint(args, "--model", "--pretrained")
    if args.checkpoint:
        from leanformer.engine.checkpoint import load_model

        model = load_model(args.checkpoint, allow_nonfinite=args.allow_nonfinite, **options)
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
    check_batch_budget(model, args)
    inputs = example_inputs(
        model, args.batch_size, img_size=args.img_size, feature_size=args.feature_size, device=args.device
    )
    kwargs = forward_kwargs(args, model)
    # The same keys, in the same order, for every model and option (None where one does
    # not apply): a table of rows from several runs needs no guessing which fields exist.
    # An image model reports its own size when none is given; a model that makes its own
    # example inputs (feature maps, pairs) reports only what was given.
    own_size = None if callable(getattr(model, "example_inputs", None)) else getattr(model, "img_size", None)
    row: dict[str, Any] = {
        "model": name,
        **{key: options.get(key) for key in STANDARD_OPTIONS},
        "batch_size": args.batch_size,
        "img_size": args.img_size if args.img_size is not None else _int_or_none(own_size),
        "feature_size": None if args.feature_size is None else "{}x{}".format(*args.feature_size),
        "peak_mem_mb": None,
    }
    row.update({key: value for key, value in options.items() if key not in row})
    row.update(kwargs)
    row.update(
        bench_model(
            model,
            inputs,
            forward_kwargs=kwargs,
            warmup=args.warmup,
            runs=args.runs,
            memory=not args.no_memory,
            compile=args.compile,
            progress=not (args.quiet or args.json),
        )
    )
    row.update(solved_budget(model, inputs, kwargs))
    _print(args, name, row)
    return [row]


def solved_budget(model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``keep_schedule`` (the per-block budgets a GFLOPs fraction such as ``0.5x`` was solved
    into) and ``gflops_ratio`` (the model's GFLOPs over its unpooled copy's, counted on
    ``inputs``); None for a model without such a budget."""
    from leanformer.pooling.state import TokenPooling

    pooling = getattr(model, "token_pooling", None)
    keep = pooling.keep if isinstance(pooling, TokenPooling) else None
    if not isinstance(pooling, TokenPooling) or keep is None or keep.gflops is None:
        return {"keep_schedule": None, "gflops_ratio": None}
    import copy

    from leanformer.bench.flops import count_gflops
    from leanformer.patch.api import remove_token_pooling

    unpooled = remove_token_pooling(copy.deepcopy(model))
    ratio = count_gflops(model, inputs, forward_kwargs=kwargs) / count_gflops(
        unpooled, inputs, forward_kwargs=kwargs
    )
    schedule = pooling.schedule
    assert schedule is not None
    if schedule.blocks is not None:  # solved ratios: three digits say enough
        text = ",".join(f"{b:.3g}" if isinstance(b, float) else str(b) for b in schedule.blocks)
    else:
        text = str(schedule)
    counts = pooling.counts_after_blocks(pooling.num_tokens, pooling.grid_size)
    return {
        "keep_schedule": f"{text} (patch tokens after each block: {','.join(map(str, counts))})",
        "gflops_ratio": ratio,
    }


def _run_host(args: argparse.Namespace) -> list[dict]:
    """``--timm-model`` / ``--hf-model``: a third-party ViT, token-pooled when ``--pool`` is given."""
    from leanformer.bench.report import bench_model, input_channels

    refuse_beside_checkpoint(args, "--timm-model", "--hf-model")
    if args.model or args.feature_size is not None:
        raise ValueError(
            "--timm-model/--hf-model replace --model and take images (--img-size), not --feature-size"
        )
    forward_kwargs(args, None)  # Perceiver-only flags are refused by name
    torch.manual_seed(args.seed)
    if args.img_size is not None:
        key = "img_size" if args.timm_model else "image_size"
        args.opt = [*args.opt, (key, args.img_size)]
    name, model, size, options = build_host_model(args)
    model = model.to(args.device).eval()
    images = torch.randn(args.batch_size, input_channels(model), size, size, device=args.device)
    # The keys and their order of every other bench row.
    row: dict[str, Any] = {
        "model": name,
        **{key: options.get(key) for key in STANDARD_OPTIONS},
        "batch_size": args.batch_size,
        "img_size": size,
        "feature_size": None,
        "peak_mem_mb": None,
    }
    row.update({key: value for key, value in options.items() if key not in row})
    row.update(
        bench_model(
            model,
            (images,),
            warmup=args.warmup,
            runs=args.runs,
            memory=not args.no_memory,
            compile=args.compile,
            progress=not (args.quiet or args.json),
        )
    )
    row.update(solved_budget(model, (images,), {}))
    _print(args, name, row)
    return [row]


def check_batch_budget(model: Any, args: argparse.Namespace) -> None:
    """Refuse a batch whose inputs and activations would not fit in memory (one example's
    inputs and forward pass, measured, times the batch)."""
    from leanformer.bench.report import example_inputs
    from leanformer.memory_budget import ESTIMATE_ABOVE_BATCH, check_batch_fits

    if args.batch_size <= ESTIMATE_ABOVE_BATCH:
        return
    one = example_inputs(model, 1, img_size=args.img_size, feature_size=args.feature_size, device=args.device)

    def forward() -> None:
        with torch.inference_mode():
            model(*one)

    check_batch_fits(
        forward,
        input_bytes=sum(x.numel() * x.element_size() for x in one if isinstance(x, torch.Tensor)),
        batch_size=args.batch_size,
        what="--batch-size",
        device=args.device,
    )


def _print(args: argparse.Namespace, name: str, row: dict[str, Any]) -> None:
    if not args.json:
        mem = row.get("peak_mem_mb")
        # Tensor bytes the forward pass allocates above what was live before it, at their
        # peak: weights and the process's own memory are not in it.
        mem_text = f", forward activations peak {mem:.2f} MB" if mem is not None else ""
        if mem is None and row["compile_s"] is not None and not args.no_memory:
            mem_text = ", memory not measured (compiled, on the CPU)"
        compiled = row["compile_s"]
        compile_text = f", compiled in {compiled:.1f} s (not in img/s)" if compiled is not None else ""
        print(
            f"{name}: {row['params_m']:.2f}M params, {row['gflops']:.4g} GFLOPs/sample, "
            f"{row['img_per_s']:.1f} img/s ±{row['spread_pct'] / 2:.0f}% (batch {args.batch_size}, "
            f"{int(row['threads'])} threads){mem_text}{compile_text}"
        )
        if row.get("keep_schedule") is not None:
            print(
                f"keep {row['keep']} solved as {row['keep_schedule']}: "
                f"{row['gflops_ratio']:.3f}x the unpooled model's GFLOPs"
            )
        if row.get("unreliable"):
            why = "the machine was busy" if row.get("busy") else "its runs spread widely"
            print(
                f"leanformer: warning: {name}'s img/s is unreliable ({why}); re-measure on a quiet machine",
                file=sys.stderr,
            )
