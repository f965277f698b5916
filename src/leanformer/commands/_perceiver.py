"""The Visual Perceiver the perceiver commands work on, as they name it: ``--checkpoint``
(with its own data config) or ``--model`` with ``--data``."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from leanformer.commands._options import data_overrides, dotted_overrides, refuse_beside_checkpoint
from leanformer.models.query_budget import query_budget


def load_perceiver(args: argparse.Namespace, *, split: str, command: str) -> tuple[Any, Any]:
    """``(model, dataset)`` from ``--checkpoint`` (its own data config) or ``--model`` + ``--data``;
    ``command`` names the subcommand in the error for a model that is not a Perceiver."""
    from leanformer.config import RunConfig, apply_overrides, from_dict, load_config
    from leanformer.engine.builders import build_model, build_split, check_model_fits

    dotted = dotted_overrides(getattr(args, "extra", []))
    if other := [key for key in dotted if not key.startswith("data.")]:
        raise ValueError(
            f"{command} takes data overrides only (--data.options.KEY VALUE), not {', '.join(other)}"
        )
    overrides: dict[str, Any] = {**data_overrides(args), **dotted}
    if getattr(args, "limit", None) is not None:
        if args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        overrides["data.limit_train" if split == "train" else "data.limit_test"] = args.limit
    refuse_beside_checkpoint(args, "--model", "--pretrained")
    ema, pretrained = getattr(args, "ema", False), getattr(args, "pretrained", False)
    if ema and not args.checkpoint:
        raise ValueError("--ema evaluates the EMA weights a training run kept: give its --checkpoint")
    if pretrained and not args.model:
        raise ValueError("--pretrained loads the shipped weights of --model NAME: give --model")
    if args.checkpoint:
        from leanformer.engine.checkpoint import load_model, read_checkpoint_meta

        cfg = from_dict(RunConfig, read_checkpoint_meta(args.checkpoint)["config"])
        cfg = apply_overrides(cfg, overrides) if overrides else cfg
        model = load_model(args.checkpoint, device=args.device, ema=ema)
    elif args.model:
        if pretrained and "data.name" not in overrides:
            from leanformer.models.pretrained import card_data_overrides

            # Shipped weights come with their own data (perceiver_fashion: Fashion-MNIST).
            overrides = card_data_overrides(args.model, overrides)
        cfg = load_config(None, {"model": args.model, **overrides})
        torch.manual_seed(args.seed)
        info = build_split(cfg.data, split).info  # type: ignore[attr-defined]
        model, _ = build_model(cfg.model, {}, info, pretrained=pretrained)
    else:
        raise ValueError("give --checkpoint PATH (a trained Visual Perceiver) or --model NAME")
    query_budget(model, needed_by=command)
    dataset = build_split(cfg.data, split, evaluation=True)
    info = dataset.info  # type: ignore[attr-defined]
    check_model_fits(model, info)
    return model.to(args.device).eval(), dataset
