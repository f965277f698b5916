"""`leanformer visualize perceiver-attention`: average cross-attention map of every query.

Averages each latent query's attention over the patch grid across a dataset split and
saves the maps as one PNG grid (paper figures 3-5): with Query Masking the first
queries spread over the image, without it each query settles on one patch.
"""

from __future__ import annotations

import argparse

from leanformer.commands._options import add_data_arguments, argument_type, figure_path
from leanformer.commands._perceiver import load_perceiver
from leanformer.config import positive_int
from leanformer.models.query_budget import check_query_count, query_budget

_FIGURE = "perceiver_attention.png"

COMMAND = ("visualize", "perceiver-attention")
HELP = "average cross-attention map per Perceiver query over a dataset, saved as a PNG grid"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", help="a last.safetensors of a trained Visual Perceiver")
    parser.add_argument("--model", help="a registered Perceiver (untrained) when no checkpoint is given")
    parser.add_argument("--split", default="test", choices=("train", "test"))
    parser.add_argument("--num-queries", type=int, help="draw only the first K queries")
    parser.add_argument("--limit", type=int, help="average over the first N images only")
    parser.add_argument(
        "--cols", type=argument_type(positive_int), help="maps per row (default: about square)"
    )
    parser.add_argument("--shared-scale", action="store_true", help="one colour scale for all maps")
    parser.add_argument(
        "--out",
        default=f"runs/{_FIGURE}",
        help=f"PNG path, or a folder to write {_FIGURE} in",
    )
    add_data_arguments(parser)


def run(args: argparse.Namespace) -> list[dict]:
    from leanformer.apps.attention_maps import average_cross_attention, save_attention_grid
    from leanformer.data.loaders import eval_loader

    model, dataset = load_perceiver(args, split=args.split, command="visualize perceiver-attention")
    if args.num_queries is not None:
        check_query_count(args.num_queries, query_budget(model), name="--num-queries")
    maps = average_cross_attention(
        model,
        eval_loader(dataset, batch_size=args.batch_size or 128),
        num_queries=args.num_queries,
        device=args.device,
        progress=not (args.quiet or args.json),
    )
    name = getattr(model, "leanformer_name", type(model).__name__)
    path = save_attention_grid(
        maps,
        figure_path(args.out, _FIGURE),
        cols=args.cols,
        shared_scale=args.shared_scale,
        title=f"{name}: average cross-attention per query ({len(dataset)} images)",
    )
    # How spread out is each query? The entropy of its average map, in patches (exp H).
    p = maps.flatten(1).clamp_min(1e-12)
    spread = (-(p * p.log()).sum(-1)).exp()
    row = {
        "model": name,
        "images": len(dataset),
        "queries": maps.shape[0],
        "png": str(path),
        "spread_first_query": float(spread[0]),
        "spread_median": float(spread.median()),
    }
    if not args.json:
        print(
            f"saved {path}: {maps.shape[0]} query maps over {len(dataset)} images; "
            f"effective patches attended: first query {row['spread_first_query']:.1f}, "
            f"median {row['spread_median']:.1f} (of {maps[0].numel()})"
        )
    return [row]
