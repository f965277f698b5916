"""`leanformer visualize enact`: ENACT's entropy map, curvature signs and regions for one input.

The input is a photo (one of the two scikit-learn ships, ``china`` or ``flower``, or any
image file via ``--input``) run through a fixed, seeded conv stem of stride
``--stride``, or smooth noise (``--image noise``). The features go through an
:class:`EntropyClusteredAttention` (seeded, untrained unless ``--checkpoint`` names a
``detr_encoder`` checkpoint, whose first layer is then used) and the figure shows the
input, the entropy map ``-p log2 p``, the curvature signs and the region boundaries
(row-major runs of equal sign) over the input; see :mod:`leanformer.apps.enact_maps`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from leanformer.commands._options import figure_path
from leanformer.ops.entropy_map import check_sigma

# The keys of leanformer.apps.enact_maps.SAMPLES, spelled here: every command's parser is
# built at start-up, and importing that module would load matplotlib and scikit-learn.
_SAMPLES = ("china", "flower")

COMMAND = ("visualize", "enact")
HELP = "plot ENACT's entropy map, curvature signs and region boundaries for an image (PNG)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--image", choices=[*_SAMPLES, "noise"], help="bundled input (default: china, unless --input)"
    )
    parser.add_argument("--input", help="an image file instead of --image")
    parser.add_argument("--stride", type=int, default=16, help="conv stem stride, a power of 2 (default 16)")
    parser.add_argument(
        "--sigma",
        type=float,
        help="entropy smoothing sigma, 0 disables (default: the --checkpoint's, else 3)",
    )
    parser.add_argument("--checkpoint", help="a trained detr_encoder checkpoint: use its first ENACT layer")
    detector = parser.add_argument_group("a detector on a fashion_detect test canvas (instead of an image)")
    detector.add_argument(
        "--detector",
        help="a detector with ENACT: a registered name (detr_fashion_enact) or a training run / checkpoint",
    )
    detector.add_argument(
        "--pretrained", action="store_true", help="with a --detector name: its shipped weights"
    )
    detector.add_argument("--canvas", type=int, default=0, help="which test canvas (default 0)")
    detector.add_argument("--data-root", help="the Fashion-MNIST folder (default: the installed one)")
    detector.add_argument(
        "--min-score", type=float, default=0.3, help="draw detections scoring at least this"
    )
    parser.add_argument(
        "--out",
        help="PNG path, or a folder to write the default name in (default: "
        "runs/enact_<image>_s<stride>_sigma<sigma>[_<checkpoint>].png, named after what it shows: "
        "the bundled image, or the --input file's name and type; the checkpoint's folder and file)",
    )


def default_out(args: argparse.Namespace, name: str, sigma: float) -> Path:
    """The figure's path when no ``--out`` is given: one file per image and setting.

    An ``--input`` file is named with its type (``photo-jpg``), so neither a bundled
    image of the same stem (``china``) nor ``photo.png`` shares its figure; a checkpoint
    file by its folder and stem (``run-last``, ``run-best``), a run folder by its name.
    ``sigma`` is the one the figure shows (a checkpoint's own when ``--sigma`` is not given).
    """
    if args.input:
        file = Path(name)
        image = file.stem + (f"-{file.suffix.lstrip('.')}" if file.suffix else "")
    else:
        image = name + (f"_seed{args.seed}" if args.image == "noise" else "")
    parts = [f"enact_{image}", f"s{args.stride}", f"sigma{sigma:g}"]
    if args.checkpoint:
        checkpoint = Path(args.checkpoint)
        if checkpoint.is_file():
            parts.append(f"{checkpoint.resolve().parent.name}-{checkpoint.stem}")
        else:
            parts.append(checkpoint.name)
    return Path("runs") / ("_".join(parts) + ".png")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.detector:
        return _run_detector(args)
    for flag in ("pretrained", "data_root"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} goes with --detector")
    from leanformer.apps.enact_maps import conv_stem, enact_attention, enact_maps, load_image, plot_enact_maps

    if args.sigma is not None:
        check_sigma(args.sigma)
    if args.input and args.image:
        raise ValueError("give --image (a bundled input) or --input (an image file), not both")
    args.image = args.image or "china"
    stem = conv_stem(args.stride, 256, args.seed).eval()
    image, name = load_image(args.input, args.image, seed=args.seed)
    attn = enact_attention(args.checkpoint, d_model=256, sigma=args.sigma, seed=args.seed).eval()
    if attn.d_model != 256:
        stem = conv_stem(args.stride, attn.d_model, args.seed).eval()
    maps = enact_maps(image, stem, attn)
    H, W = maps.regions.shape
    title = f"{name}: {H}x{W} features"
    named = default_out(args, name, attn.sigma)
    target = figure_path(args.out, named.name) if args.out else named
    out = plot_enact_maps(image, maps, target, title=title)
    L = maps.count
    row = {
        "image": name,
        "feature_size": f"{H}x{W}",
        "sigma": attn.sigma,
        "regions": L,
        "positions": H * W,
        "cluster_ratio": round(L / (H * W), 4),
        "out": str(out),
    }
    if not args.json:
        print(
            f"{name}: {H}x{W} features, sigma {attn.sigma:g}: {L} regions for {H * W} positions "
            f"(L/HW = {L / (H * W):.3f}); wrote {out}"
        )
    return [row]


def _run_detector(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--detector``: its boxes and its first ENACT layer's regions on one test canvas."""
    from leanformer.apps.detector_maps import detector_maps, plot_detector_maps
    from leanformer.data.fashion_detect import build_fashion_detect
    from leanformer.data.fashion_mnist import CLASSES

    for flag in ("input", "image", "checkpoint", "sigma"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag} draws a photo; --detector draws a fashion_detect canvas: give one")
    if args.canvas < 0:
        raise ValueError(f"--canvas must be >= 0, got {args.canvas}")
    if not 0.0 <= args.min_score <= 1.0:
        raise ValueError(f"--min-score must be in [0, 1], got {args.min_score}")
    source = Path(args.detector)
    if source.exists():
        from leanformer.engine.checkpoint import load_model

        if args.pretrained:
            raise ValueError("--pretrained goes with a registered --detector name, not a checkpoint")
        model = load_model(source)
        name = source.name
    else:
        import torch

        from leanformer.models.registry import create_model

        torch.manual_seed(args.seed)
        model = create_model(args.detector, pretrained=args.pretrained)
        name = args.detector
    side = getattr(model, "img_size", None)
    if not isinstance(side, int):
        raise ValueError(f"{name} is not a detector of fashion_detect canvases (no img_size)")
    canvases = build_fashion_detect(
        split="test", root=args.data_root, num_canvases=args.canvas + 1, img_size=side
    )
    image, truth = canvases[args.canvas]
    detections, maps = detector_maps(model, image)
    out_name = f"enact_{Path(name).stem}_canvas{args.canvas}.png"
    target = figure_path(args.out, out_name) if args.out else Path("runs") / out_name
    H, W = maps.regions.shape
    title = f"{name} on fashion_detect test canvas {args.canvas}: {H}x{W} features"
    out = plot_detector_maps(
        image, truth, detections, maps, target, min_score=args.min_score, class_names=CLASSES, title=title
    )
    shown = int((detections["scores"] >= args.min_score).sum())
    row = {
        "detector": name,
        "canvas": args.canvas,
        "objects": len(truth["labels"]),
        "detections_shown": shown,
        "regions": maps.count,
        "positions": H * W,
        "out": str(out),
    }
    if not args.json:
        print(
            f"{name}, canvas {args.canvas}: {len(truth['labels'])} garments, {shown} detections >= "
            f"{args.min_score:g}, {maps.count} ENACT regions for {H * W} positions; wrote {out}"
        )
    return [row]
