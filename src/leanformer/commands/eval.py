"""`leanformer eval`: top-1 of a checkpoint (or a registered model) on a dataset split; COCO box AP
of a detector on a detection dataset, mIoU of a semantic segmenter on label maps."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

import torch

from leanformer.commands._hosts import ClassifierLogits, add_host_arguments, build_host_model, host_name
from leanformer.commands._options import (
    add_config_flags,
    add_data_arguments,
    add_model_arguments,
    add_split_argument,
    config_flags_given,
    dotted_overrides,
    forward_kwargs,
    model_options,
    refuse_beside_checkpoint,
)
from leanformer.config import RunConfig, apply_overrides, from_dict, load_config

COMMAND = ("eval",)
HELP = "evaluate a checkpoint (optionally with token pooling, fewer queries or DQS)"
ACCEPTS_OVERRIDES = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", help="a checkpoint written by `leanformer train`, or its run folder")
    parser.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="load a checkpoint whose weights hold NaN or inf (refused otherwise)",
    )
    parser.add_argument("--config", help="YAML config (for the data) when no checkpoint is given")
    add_split_argument(parser)
    add_model_arguments(parser)
    add_host_arguments(parser)
    add_data_arguments(parser)
    add_config_flags(parser, "compile")
    parser.add_argument(
        "--ema", action="store_true", help="evaluate the EMA of the weights a run trained with --ema kept"
    )


def _config(args: argparse.Namespace) -> tuple[RunConfig, Any]:
    from leanformer.engine.checkpoint import load_model, read_checkpoint_meta

    overrides = {**config_flags_given(args, "data", "compile"), **dotted_overrides(args.extra)}
    if args.ema and not args.checkpoint:
        raise ValueError("--ema evaluates the EMA weights a training run kept: give its --checkpoint")
    if args.allow_nonfinite and not args.checkpoint:
        raise ValueError("--allow-nonfinite is for the weights of a --checkpoint; give --checkpoint")
    if args.checkpoint:
        hint = " (change the model with --pool/--keep/--opt KEY=VALUE)"
        refuse_beside_checkpoint(
            args,
            "--model",
            "--config",
            "--pretrained",
            "--timm-model",
            "--hf-model",
            names="model and config",
            hint=hint,
        )
        meta = read_checkpoint_meta(args.checkpoint)
        cfg = from_dict(RunConfig, meta["config"])
        cfg = apply_overrides(cfg, overrides) if overrides else cfg
        # --model_options.KEY VALUE applies to the rebuilt model, like --opt KEY=VALUE.
        # (--model_options.pool_options.max_iters sets the top-level key pool_options.)
        dotted = [key.split(".")[1] for key in overrides if key.startswith("model_options.")]
        options = {**{key: cfg.model_options[key] for key in dotted}, **model_options(args)}
        model = load_model(
            args.checkpoint, device=args.device, ema=args.ema, allow_nonfinite=args.allow_nonfinite, **options
        )
        _warn_untrained(model)
        return cfg, model
    from leanformer.engine.builders import build_model, build_split

    if host_name(args):
        return _host_config(args, overrides)
    if not args.model:
        raise ValueError(
            "give --checkpoint PATH (a trained run), --model NAME [--pretrained], --timm-model or --hf-model"
        )

    if args.pretrained and args.config is None and "data.name" not in overrides:
        from leanformer.models.pretrained import card_data_overrides

        # Shipped weights are sized for their own data (deit_fashion: 28x28 grey images).
        overrides = card_data_overrides(args.model, overrides)
    cfg = load_config(args.config, {"model": args.model, **overrides})
    info = build_split(cfg.data, args.split).info  # type: ignore[attr-defined]
    torch.manual_seed(args.seed)
    options = {**cfg.model_options, **model_options(args)}
    model, _ = build_model(cfg.model, options, info, pretrained=args.pretrained)
    return cfg, model.to(args.device)


def _host_config(args: argparse.Namespace, overrides: dict[str, Any]) -> tuple[RunConfig, Any]:
    """``--timm-model`` / ``--hf-model`` on the data of ``--config``/``--data`` (random weights
    unless a local file is given), token-pooled when ``--pool`` is."""
    from leanformer.engine.builders import build_split

    refuse_beside_checkpoint(args, "--timm-model", "--hf-model")
    if args.model:
        raise ValueError("--timm-model/--hf-model replace --model")
    cfg = load_config(args.config, overrides)
    info = build_split(cfg.data, args.split).info  # type: ignore[attr-defined]
    torch.manual_seed(args.seed)
    name, model, _, _ = build_host_model(args, data=info)
    if args.hf_model:
        if "ForImageClassification" not in type(model).__name__:
            raise ValueError(
                f"eval needs a classifier: {args.hf_model} has no logits (try *ForImageClassification)"
            )
        model = ClassifierLogits(model)
    model.leanformer_name = name  # type: ignore[assignment]
    return replace(cfg, model=name), model.to(args.device)


def _warn_untrained(model: torch.nn.Module) -> None:
    """Say which parameters an option added that the checkpoint cannot fill (they stay random)."""
    missing: list[str] = getattr(model, "leanformer_missing_keys", [])
    if not missing:
        return
    # Group by module: "blocks.7.attn.qkv.weight" -> "blocks.7".
    modules = sorted({".".join(key.split(".")[:2]) for key in missing})
    shown = ", ".join(modules[:6]) + (", ..." if len(modules) > 6 else "")
    print(
        f"leanformer: warning: {len(missing)} tensors are not in the checkpoint and keep their "
        f"initial (untrained) values: {shown}",
        file=sys.stderr,
    )


def run(args: argparse.Namespace) -> list[dict]:
    from leanformer.data.loaders import eval_loader
    from leanformer.engine.builders import build_split, check_model_fits
    from leanformer.engine.evaluate import evaluate

    cfg, model = _config(args)
    dataset = build_split(cfg.data, args.split, evaluation=True)
    info = dataset.info  # type: ignore[attr-defined]
    check_model_fits(model, info)
    if info.task == "detection":
        return _run_detection(args, cfg, model, dataset)
    kept: list[torch.Tensor] = []

    def collect(m: torch.nn.Module) -> None:
        counts = getattr(m, "last_kept_counts", None)
        if counts is not None:
            kept.append(counts.detach().float().cpu())

    kwargs = forward_kwargs(args, model)
    compiled = cfg.compile
    name = getattr(model, "leanformer_name", cfg.model)
    if compiled:
        from leanformer.bench.compiled import check_compilable_call, compile_model

        check_compilable_call(kwargs)
        model = compile_model(model)
    if info.task == "semantic":
        return _run_segmentation(args, cfg, model, dataset, name=name, forward_kwargs=kwargs)
    metrics = evaluate(
        model,
        eval_loader(dataset, batch_size=args.batch_size or cfg.data.eval_batch_size),
        forward_kwargs=kwargs,
        device=args.device,
        progress=not args.quiet and not args.json,
        after_batch=collect if "dqs_threshold" in kwargs else None,
    )
    row: dict[str, Any] = {
        "model": getattr(model, "leanformer_name", cfg.model),
        "split": args.split,
        **metrics,
        "compiled": bool(compiled),
    }
    row.update({k: v for k, v in model_options(args).items()})
    row.update(kwargs)
    if kept:
        counts = torch.cat(kept)
        row.update(
            kept_mean=counts.mean().item(),
            kept_std=counts.std().item() if counts.numel() > 1 else 0.0,
            kept_min=int(counts.min().item()),  # query counts: integers
            kept_max=int(counts.max().item()),
        )
    if not args.json:
        extra = (
            f", kept queries {row['kept_mean']:.1f} ± {row['kept_std']:.1f} "
            f"(min {row['kept_min']}, max {row['kept_max']})"
            if kept
            else ""
        )
        print(
            f"{row['model']} on {cfg.data.name}/{args.split}: top-1 {row['top1']:.2f}% "
            f"(loss {row['loss']:.4f}, n={row['n']}){extra}"
        )
    return [row]


def _run_detection(args: argparse.Namespace, cfg: RunConfig, model: Any, dataset: Any) -> list[dict]:
    """COCO box AP, AP50, AP75 and AP by object size of a detector on a detection dataset."""
    from leanformer.engine.detection_eval import evaluate_detector

    name = getattr(model, "leanformer_name", cfg.model)  # check_model_fits matched model and data tasks
    if cfg.compile:
        raise ValueError("--compile is for classifiers; a detector is evaluated eagerly")
    forward_kwargs(args, model)  # refuses the Perceivers' call-time options by name
    batch_size = args.batch_size or cfg.data.eval_batch_size
    metrics = evaluate_detector(model, dataset, batch_size=batch_size, device=args.device)
    row: dict[str, Any] = {"model": name, "split": args.split, **metrics, "n": int(metrics["n"] or 0)}
    row.update(model_options(args))
    if not args.json:
        sizes = ", ".join(f"{size} {_percent(row['ap_' + size])}" for size in ("small", "medium", "large"))
        print(
            f"{name} on {cfg.data.name}/{args.split}: AP {_percent(row['ap'])}, "
            f"AP50 {_percent(row['ap50'])}, AP75 {_percent(row['ap75'])} (by size: {sizes}; n={row['n']})"
        )
    return [row]


def _run_segmentation(
    args: argparse.Namespace,
    cfg: RunConfig,
    model: Any,
    dataset: Any,
    *,
    name: str,
    forward_kwargs: dict[str, Any],
) -> list[dict]:
    """Mean IoU and pixel accuracy of a semantic segmenter (compiled when asked, ``run``'s
    ``forward_kwargs`` checked) on a label-map dataset."""
    from leanformer.data.loaders import eval_loader
    from leanformer.engine.segmentation_train import segmentation_scores

    metrics = segmentation_scores(
        model,
        eval_loader(dataset, batch_size=args.batch_size or cfg.data.eval_batch_size),
        num_classes=dataset.info.num_classes,
        forward_kwargs=forward_kwargs,
        device=args.device,
        progress=not args.quiet and not args.json,
    )
    row: dict[str, Any] = {"model": name, "split": args.split, **metrics, "compiled": bool(cfg.compile)}
    row.update(model_options(args))
    if not args.json:
        print(
            f"{name} on {cfg.data.name}/{args.split}: mIoU {row['miou']:.2f}%, pixel accuracy "
            f"{row['pixel_accuracy']:.2f}% (loss {row['loss']:.4f}, n={row['n']})"
        )
    return [row]


def _percent(value: float | None) -> str:
    """COCO AP as the field prints it (x100); an area range without objects has none."""
    return "n/a" if value is None else f"{100 * value:.1f}"
