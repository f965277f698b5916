"""What a selection's dropped patches show when unpooled: the nearest surviving patch on the
grid (the library's fill) against the kept token most like it by cosine similarity in the
block that dropped it (a search this script adds, which the library dropped for its cost).

mIoU of the shipped ``segvit_fashion`` on the validation canvases (the fill is a choice,
so it is made on validation), each selection method at GFLOPs budgets solved as the
trade-off sweep solves them, no fine-tuning. Needs Fashion-MNIST installed:

    python benchmarks/bench_unpool_fill.py

Appends one JSON line per (method, budget) to ``--out``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import Tensor, nn

from leanformer import create_model
from leanformer.apps.tradeoff import solve_method_budget, with_method
from leanformer.bench.results import markdown_rows, results_path, run_stamp, write_jsonl
from leanformer.config import DataConfig
from leanformer.data.loaders import eval_loader
from leanformer.engine.builders import build_split
from leanformer.engine.segmentation_train import segmentation_scores
from leanformer.pooling.reducer import compose_assignments, sees_prefix
from leanformer.pooling.state import TokenPooling

COLUMNS = ["method", "gflops", "nearest_position_miou", "most_similar_miou"]


def most_similar(tokens: Tensor, kept: Tensor, assign: Tensor) -> Tensor:
    """``assign [B, N]`` with each dropped token (-1) given the kept token of ``kept [B, K, C]``
    with the highest cosine similarity to it (of ``tokens [B, N, C]``, the block's input)."""
    similarity = torch.nn.functional.normalize(tokens, dim=-1) @ torch.nn.functional.normalize(
        kept, dim=-1
    ).transpose(1, 2)
    return torch.where(assign >= 0, assign, similarity.argmax(dim=-1))


class MostSimilarFill:
    """Installs the cosine fill on a pooled model: each reducer's forward records its filled
    map, and the model's ``token_pooling.assignment(fill=True)`` composes those."""

    def __init__(self, model: nn.Module) -> None:
        self.pooling: TokenPooling = model.token_pooling  # type: ignore[assignment]
        self.filled: dict[int, Tensor] = {}
        for i, reducer in enumerate(self.pooling.reducers.values()):
            reducer.register_forward_hook(self._hook(i))
        self.pooling.assignment = self.assignment  # type: ignore[method-assign]

    def _hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            tokens, kept, assign = args[0], out[0], module.last_assign
            self.filled[index] = most_similar(tokens, kept, assign) if kept.shape[1] > 0 else assign  # type: ignore[arg-type]

        return hook

    def assignment(self, *, fill: bool) -> Tensor | None:
        composed: Tensor | None = None
        for i, reducer in enumerate(self.pooling.reducers.values()):
            step = self.filled[i] if fill else reducer.last_assign
            if not sees_prefix(reducer):
                prefix = torch.arange(self.pooling.num_prefix).expand(step.shape[0], -1)
                step = torch.cat([prefix, torch.where(step >= 0, step + self.pooling.num_prefix, step)], 1)
            composed = step if composed is None else compose_assignments(composed, step)
        return composed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="powerbert,importance,random")
    parser.add_argument("--gflops", default="0.9,0.7,0.5,0.35")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(results_path("unpool_fill")))
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    base = create_model("segvit_fashion", pretrained=True).eval()
    data = DataConfig(name="fashion_detect", eval_batch_size=100, options={"target": "semantic"})
    val = build_split(data, "val", evaluation=True)
    loader = eval_loader(val, batch_size=100)
    example = next(iter(loader))[0][:4]
    stamp = run_stamp(threads=args.threads)
    base_miou = segmentation_scores(base, loader, num_classes=11)["miou"]
    rows = []
    for method in args.methods.split(","):
        for gflops in (float(g) for g in args.gflops.split(",")):
            keep = solve_method_budget(
                base, method, {"gflops": gflops}, example, carry=True, options={}, name=method
            )
            scores = {}
            for fill in ("nearest_position", "most_similar"):
                torch.manual_seed(0)  # the same random draws for both fills
                model = with_method(
                    base,
                    method,
                    keep,
                    carry=True,
                    options={"seed": 0} if method in ("random", "importance") else {},
                )
                if fill == "most_similar":
                    MostSimilarFill(model)
                scores[fill] = segmentation_scores(model, loader, num_classes=11)["miou"]
            rows.append(
                {
                    **stamp,
                    "model": "segvit_fashion",
                    "split": "val",
                    "method": method,
                    "gflops": f"{gflops}x",
                    "unpooled_miou": base_miou,
                    "nearest_position_miou": scores["nearest_position"],
                    "most_similar_miou": scores["most_similar"],
                }
            )
            print(markdown_rows(rows[-1:], COLUMNS), flush=True)
    print(markdown_rows(rows, COLUMNS))
    write_jsonl(rows, args.out, append=True)


if __name__ == "__main__":
    main()
