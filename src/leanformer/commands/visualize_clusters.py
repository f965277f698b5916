"""`leanformer visualize clusters`: token clusters coloured over the input (paper fig. 1c).

Which input patches does each token stand for after block ``--layer``? The trace is
:func:`leanformer.apps.cluster_maps.trace_token_sources`; this module picks the model and
the examples, and writes one PNG per example.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanformer.commands import given
from leanformer.commands._options import keep_argument
from leanformer.pooling.budgets import KEEP_HELP, KeepSchedule, parse_keep

COMMAND = ("visualize", "clusters")
HELP = "colour the token clusters of a token-pooled model over input images (PNG per example)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="trained leanformer checkpoint (e.g. from the token-pooling demo)")
    src.add_argument("--model", help="registry model (untrained unless --checkpoint)")
    src.add_argument("--timm-model", help="timm ViT/DeiT name (pretrained=False: random weights)")
    parser.add_argument(
        "--pretrained", action="store_true", help="with --model: the weights shipped with leanformer"
    )
    parser.add_argument("--method", default="wkmedoids", help="pooling method (default: wkmedoids)")
    parser.add_argument(
        "--keep", type=keep_argument, default=KeepSchedule(ratio=0.7), help=f"{KEEP_HELP} (default: 0.7)"
    )
    parser.add_argument("--layer", type=int, default=-1, help="block whose output to show (default: last)")
    parser.add_argument("--no-carry", action="store_true", help="do not carry token sizes")
    parser.add_argument(
        "--data",
        help="dataset to draw examples from (default: a --pretrained model's own, else digits)",
    )
    parser.add_argument("--data-root", help="dataset folder (cifar10 / imagefolder)")
    parser.add_argument(
        "--img-size",
        type=int,
        default=None,
        help="resize the examples to this size (default: the dataset's own; with --timm-model, the "
        "model's input size, e.g. 224, so that its patch grid is the one it was designed for)",
    )
    parser.add_argument("--num-examples", type=int, default=4)
    parser.add_argument("--out", default="runs/clusters", help="output folder for the PNGs")


def _build(args: argparse.Namespace, info: Any) -> nn.Module:
    """The model of ``--timm-model`` or ``--model`` (a checkpoint is loaded before the data)."""
    if args.timm_model:
        from leanformer.patch.timm import create_timm_model

        return create_timm_model(
            args.timm_model,
            num_classes=info.num_classes,
            in_chans=info.in_chans,
            img_size=info.img_size,
        )
    from leanformer.engine.builders import build_model

    return build_model(args.model or "deit_digits", {}, info, pretrained=args.pretrained)[0]


def _img_size(args: argparse.Namespace, trained: nn.Module | None) -> int | None:
    """The example size: ``--img-size``, else the size the ``trained`` checkpoint model takes
    or a timm model's own input size, else None (the dataset's)."""
    if args.img_size is not None:
        if args.img_size < 1:
            raise ValueError(f"--img-size must be >= 1, got {args.img_size}")
        return args.img_size
    if trained is not None:
        height, width = getattr(trained, "img_size", (None, None))
        return height if height == width else None
    if args.timm_model:
        from leanformer.patch.timm import timm_input_size

        return timm_input_size(args.timm_model)
    return None


def run(args: argparse.Namespace) -> list[dict]:
    from leanformer.apps.cluster_maps import grid_of, patch_assignment, to_image, trace_token_sources
    from leanformer.apps.plots import plot_cluster_maps
    from leanformer.apps.sweep_config import BASELINE
    from leanformer.apps.tradeoff import check_poolable, with_method
    from leanformer.data.registry import build_dataset
    from leanformer.engine.builders import check_model_fits
    from leanformer.models.pretrained import model_card

    if args.num_examples < 1:
        raise ValueError(f"--num-examples must be >= 1, got {args.num_examples}")
    ignored = [flag for flag in ("--keep", "--no-carry") if given(args, flag)]
    if args.method == BASELINE and ignored:
        raise ValueError(f"{' and '.join(ignored)} cannot be combined with --method none: nothing is pooled")
    if args.pretrained and not args.model:
        raise ValueError("--pretrained goes with --model (a checkpoint or timm model brings its own weights)")
    if args.data is None:
        args.data = model_card(args.model)["data"]["name"] if args.pretrained else "digits"
    options: dict[str, Any] = {"root": args.data_root} if args.data_root else {}
    trained = None
    if args.checkpoint:
        from leanformer.engine.checkpoint import load_model

        trained = load_model(args.checkpoint, device=args.device)
    img_size = _img_size(args, trained)
    if img_size is not None:
        options["img_size"] = img_size
    data: Any = build_dataset(args.data, split="test", **options)  # a Dataset with info and a length
    torch.manual_seed(args.seed)
    base = (trained if trained is not None else _build(args, data.info)).to(args.device).eval()
    check_model_fits(base, data.info)
    check_poolable(type(base))  # the maps follow patch tokens through a ViT's blocks
    grid = grid_of(base)
    keep = parse_keep(args.keep)  # already a KeepSchedule from the command line; as is then
    budgets = keep.per_block(depth=len(base.blocks), num_tokens=grid[0] * grid[1])  # type: ignore[arg-type]
    if any(isinstance(b, int) and b < 1 for b in budgets):
        raise ValueError(
            f"--keep {args.keep}: a block would keep no patch tokens, so there is nothing to draw"
        )
    model = with_method(base, args.method, keep, carry=not args.no_carry, options={})
    n = min(args.num_examples, len(data))
    x = torch.stack([data[i][0] for i in range(n)]).to(args.device)
    trace = trace_token_sources(model, x)
    depth = len(trace)
    layer = args.layer if args.layer >= 0 else depth + args.layer
    if not 0 <= layer < depth:
        raise ValueError(f"--layer must be in [0, {depth}) (or negative from the end), got {args.layer}")
    grid = grid_of(model)
    assign = patch_assignment(trace, layer, grid[0] * grid[1], n)
    out = Path(args.out)
    rows = []
    for i in range(n):
        path = plot_cluster_maps(
            to_image(x[i]),
            assign[i].cpu().numpy(),
            grid,
            out / f"clusters_{args.method}_l{layer}_{i}.png",
            title=f"{args.method}, keep={args.keep}, after block {layer}",
        )
        tokens = int(assign[i].max()) + 1
        rows.append({"example": i, "layer": layer, "method": args.method, "tokens": tokens, "png": str(path)})
        if not args.json:
            print(f"{path}: {tokens} tokens for {grid[0] * grid[1]} patches")
    return rows
