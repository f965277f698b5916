"""Whole-detector inference speed: ``detr_fashion_enact`` against ``detr_fashion`` on real canvases.

Both detectors are built with the same seed (random weights: their speed does not depend
on training, but ENACT's region count depends on the images, so the batches are real
``fashion_detect`` test canvases and Fashion-MNIST must be installed). For each thread
count and batch size the two ``predict`` calls are timed side by side, interleaved
(``leanformer.bench.timing.time_interleaved``), and the median img/s and the ENACT / dense
ratio are reported. Set the allocator first:

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=1073741824 \\
        python benchmarks/bench_detr_fashion.py --threads 1,2 --batch-sizes 1,8

Appends one JSON line per (threads, batch, model) to ``--out`` (machine, command, date, figures).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from leanformer.bench.results import markdown_rows, results_path, run_stamp, write_jsonl
from leanformer.bench.timing import time_interleaved
from leanformer.commands._options import int_list
from leanformer.data.fashion_detect import build_fashion_detect
from leanformer.models.registry import create_model

MODELS = ("detr_fashion", "detr_fashion_enact")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int_list, default=[1, 2])
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--out", default=str(results_path("detr_fashion")))
    args = p.parse_args()
    for flag, values in (("--threads", args.threads), ("--batch-sizes", args.batch_sizes)):
        if not values or min(values) < 1:
            p.error(f"{flag} takes a comma-separated list of positive ints, got {values}")

    models = {}
    for name in MODELS:
        torch.manual_seed(0)
        models[name] = create_model(name).eval()
    canvases = build_fashion_detect(split="test", num_canvases=max(args.batch_sizes))
    images = torch.stack([canvases[i][0] for i in range(max(args.batch_sizes))])
    rows: list[dict[str, Any]] = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch_sizes:
            x = images[:batch]
            seconds = time_interleaved(
                {name: (lambda m=model, x=x: m.predict(x)) for name, model in models.items()},
                warmup=args.warmup,
                runs=args.runs,
            )
            for name in MODELS:
                rows.append(
                    {
                        **run_stamp(threads=threads),
                        "model": name,
                        "batch": batch,
                        "img_per_s": round(batch / seconds[name], 2),
                        "ratio_to_dense": round(seconds["detr_fashion"] / seconds[name], 3),
                    }
                )
    write_jsonl(rows, args.out, append=True)
    print(markdown_rows(rows, ["threads", "batch", "model", "img_per_s", "ratio_to_dense"]))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
