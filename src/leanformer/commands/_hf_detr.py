"""`leanformer bench --hf-model detr`: dense vs ENACT in a Hugging Face DETR, side by side.

The detector is built offline from its config with random weights (DETR-R50, or DC5 with
``--dc5``); see :mod:`leanformer.apps.hf_detr` for what is measured.
"""

from __future__ import annotations

import argparse
from typing import Any

DEFAULT_IMG_SIZE = (800, 1066)
_NAMES = ("detr", "detrforobjectdetection")
# Options of the other bench paths that mean nothing for the DETR detector (its row
# would not show them, so taking them would report a run other than the one asked for).
_REGISTRY_ONLY = (
    "model",
    "pretrained",
    "checkpoint",
    "timm_model",
    "feature_size",
    "pool",
    "keep",
    "carry",
    "num_queries",
    "dqs_threshold",
    "dqs_rule",
    "compile",
)


DEFAULT_SCOPES = "encoder_fwd,encoder_train,model_fwd"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Hugging Face DETR (--hf-model detr)")
    group.add_argument(
        "--dc5",
        action="store_true",
        help="DETR-DC5: dilated last ResNet stage, a map twice as large each way",
    )
    group.add_argument(
        "--scopes",
        default=DEFAULT_SCOPES,
        help="comma-separated: encoder_fwd, encoder_train (forward+backward), model_fwd",
    )


def is_requested(args: argparse.Namespace) -> bool:
    return str(getattr(args, "hf_model", None) or "").lower() in _NAMES


def refuse_detr_flags(args: argparse.Namespace) -> None:
    """``--dc5`` and ``--scopes`` mean something only to ``--hf-model detr``."""
    given = [flag for flag, on in (("--dc5", args.dc5), ("--scopes", args.scopes != DEFAULT_SCOPES)) if on]
    if given:
        raise ValueError(
            f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} only to --hf-model detr"
        )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from leanformer.apps.hf_detr import build_detr_pair, compare_dense_enact, photo_batch

    given = [f"--{name.replace('_', '-')}" for name in _REGISTRY_ONLY if getattr(args, name, None)]
    if given:
        raise ValueError(f"--hf-model detr does not take {', '.join(given)}")
    if args.attention not in (None, "enact"):
        raise ValueError(
            "--hf-model detr measures dense and ENACT side by side: "
            f"--attention enact, not {args.attention!r}"
        )
    size = args.img_size if args.img_size is not None else DEFAULT_IMG_SIZE
    img_size = (size, size) if isinstance(size, int) else tuple(size)
    sigma = 3.0 if args.sigma is None else args.sigma
    # --opt KEY=VALUE overrides DetrConfig fields (e.g. backbone=resnet18, encoder_layers=2).
    dense, enact = build_detr_pair(dilation=args.dc5, sigma=sigma, seed=args.seed, **dict(args.opt))
    dense, enact = dense.to(args.device), enact.to(args.device)
    pixels, mask = photo_batch(args.batch_size, img_size)
    rows = compare_dense_enact(
        dense,
        enact,
        pixels.to(args.device),
        mask.to(args.device),
        scopes=tuple(args.scopes.split(",")),
        warmup=args.warmup,
        runs=args.runs,
        memory=not args.no_memory,
    )
    head = {
        "model": f"detr-{dict(args.opt).get('backbone', 'resnet50')}" + ("-dc5" if args.dc5 else ""),
        "hf_model": "DetrForObjectDetection",
        "config": dict(args.opt),
        "attention": "enact",
        "sigma": sigma,
        "img_size": f"{img_size[0]}x{img_size[1]}",
    }
    rows = [{**head, **row} for row in rows]
    if not args.json:
        for r in rows:
            mem = f", peak {r['dense_mb']:.0f} -> {r['enact_mb']:.0f} MB" if "dense_mb" in r else ""
            print(
                f"{r['model']} {r['img_size']} (map {r['feature_size']}, "
                f"batch {r['batch_size']}) {r['scope']}: "
                f"dense {r['dense_ms']:.1f} ms, ENACT {r['enact_ms']:.1f} ms ({r['time_ratio']:.2f}x){mem}, "
                f"clusters/positions {r['cluster_ratio']:.3f}"
            )
    return rows
