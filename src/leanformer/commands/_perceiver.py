"""The Visual Perceiver the perceiver commands work on, as they name it: ``--checkpoint``
(with its own data config) or ``--model`` with ``--data``."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from leanformer.commands._options import data_overrides, refuse_beside_checkpoint
from leanformer.models.query_budget import query_budget


def load_perceiver(args: argparse.Namespace, *, split: str, command: str) -> tuple[Any, Any]:
    """``(model, dataset)`` from ``--checkpoint`` (its own data config) or ``--model`` + ``--data``;
    ``command`` names the subcommand in the error for a model that is not a Perceiver."""
    from leanformer.config import RunConfig, apply_overrides, from_dict, load_config
    from leanformer.engine.builders import build_model, build_split, check_model_fits

    overrides = data_overrides(args)
    if getattr(args, "limit", None) is not None:
        if args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        overrides["data.limit_test" if split == "test" else "data.limit_train"] = args.limit
    refuse_beside_checkpoint(args, "--model")
    if args.checkpoint:
        from leanformer.engine.checkpoint import load_model, read_checkpoint_meta

        cfg = from_dict(RunConfig, read_checkpoint_meta(args.checkpoint)["config"])
        cfg = apply_overrides(cfg, overrides) if overrides else cfg
        model = load_model(args.checkpoint, device=args.device)
    elif args.model:
        cfg = load_config(None, {"model": args.model, **overrides})
        torch.manual_seed(args.seed)
        model, _ = build_model(cfg.model, {}, build_split(cfg.data, split).info)  # type: ignore[attr-defined]
    else:
        raise ValueError("give --checkpoint PATH (a trained Visual Perceiver) or --model NAME")
    query_budget(model, needed_by=command)
    dataset = build_split(cfg.data, split, evaluation=True)
    info = dataset.info  # type: ignore[attr-defined]
    check_model_fits(model, info)
    return model.to(args.device).eval(), dataset
