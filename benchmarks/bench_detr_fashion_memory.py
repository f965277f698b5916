"""Peak training memory of one step: ``detr_fashion_enact`` against ``detr_fashion``.

ENACT's claim is a training-memory saving measured against DETR's explicit attention
matrix. For each ``--matrix`` (``explicit``: every attention holds its probabilities as
tensors, the paper's baseline; ``fused``: fused kernels) and canvas size, both detectors
are built with the same seed and one training step (forward with the Hungarian-matched
loss, backward) runs on the first ``--batch`` real ``fashion_detect`` training canvases
and their boxes (ENACT's region count depends on the images; Fashion-MNIST must be
installed). The peak of live tensor memory during the step is measured as ``bench``
measures it (:func:`leanformer.bench.memory.peak_memory_mb`), after one step that is not
measured, so gradients exist in both measurements::

    python benchmarks/bench_detr_fashion_memory.py --batch 8 --sizes 128,256

Memory does not depend on timing, so this needs no quiet machine. Appends one JSON line
per (matrix, size, model) to ``--out``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from leanformer.bench.memory import peak_memory_mb
from leanformer.bench.results import markdown_rows, results_path, run_stamp, write_jsonl
from leanformer.commands._options import int_list
from leanformer.data.fashion_detect import build_fashion_detect
from leanformer.layers.enact_attention import ATTENTION_MATRICES
from leanformer.models.registry import create_model

MODELS = ("detr_fashion", "detr_fashion_enact")


def step_peak_mb(
    model: torch.nn.Module, images: torch.Tensor, targets: list[dict[str, torch.Tensor]]
) -> float:
    def step() -> None:
        model(images, targets).loss.backward()

    step()  # gradients allocated, as in every step of a training but the first
    peak = peak_memory_mb(step)
    assert peak is not None  # measured on the CPU
    return peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--sizes", type=int_list, default=[128])
    p.add_argument("--matrix", type=lambda s: s.split(","), default=list(ATTENTION_MATRICES))
    p.add_argument("--out", default=str(results_path("detr_fashion_memory")))
    args = p.parse_args()
    if args.batch < 1 or not args.sizes or min(args.sizes) < 16:
        p.error("--batch must be >= 1 and --sizes a comma-separated list of canvas sizes >= 16")
    for matrix in args.matrix:
        if matrix not in ATTENTION_MATRICES:
            p.error(f"--matrix takes {', '.join(ATTENTION_MATRICES)}, got {matrix!r}")

    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        canvases = build_fashion_detect(split="train", num_canvases=args.batch, img_size=size)
        images = torch.stack([canvases[i][0] for i in range(args.batch)])
        targets = [canvases[i][1] for i in range(args.batch)]
        for matrix in args.matrix:
            peaks = {}
            for name in MODELS:
                torch.manual_seed(0)
                model = create_model(name, img_size=size, attention_matrix=matrix).train()
                peaks[name] = step_peak_mb(model, images, targets)
            for name in MODELS:
                rows.append(
                    {
                        **run_stamp(),
                        "model": name,
                        "matrix": matrix,
                        "canvas": size,
                        "batch": args.batch,
                        "peak_mb": round(peaks[name], 1),
                        "ratio_to_dense": round(peaks[name] / peaks["detr_fashion"], 3),
                    }
                )
    write_jsonl(rows, args.out, append=True)
    print(markdown_rows(rows, ["matrix", "canvas", "model", "peak_mb", "ratio_to_dense"]))


if __name__ == "__main__":
    main()
