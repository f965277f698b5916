"""Speedup against a reference model, set against how much the FLOPs fell."""

from __future__ import annotations

from typing import Any


def speedup_rows(
    seconds: dict[str, float], gflops: dict[str, float], *, batch: int, reference: str = "none"
) -> list[dict[str, Any]]:
    """One row per model: GFLOPs, FLOPs ratio, img/s, speedup, speedup / FLOPs ratio.

    ``seconds``: median time of one batch per model name; ``gflops``: per sample.
    ``speedup_over_flops_ratio`` is 1.0 when the time falls exactly as much as the FLOPs.
    """
    if reference not in seconds or reference not in gflops:
        raise ValueError(f"the reference model {reference!r} is missing from the measurements")
    rows = []
    for name, t in seconds.items():
        speedup = seconds[reference] / t
        ratio = gflops[reference] / gflops[name]
        rows.append(
            {
                "name": name,
                "gflops": gflops[name],
                "flops_ratio": ratio,
                "img_per_s": batch / t,
                "speedup": speedup,
                "speedup_over_flops_ratio": speedup / ratio,
            }
        )
    return rows
