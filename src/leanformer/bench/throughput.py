"""Inference throughput: warm-up, then the median of several timed runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from leanformer.bench.flops import batch_input
from leanformer.bench.reliability import assess, read_load_average
from leanformer.progress import progress_bar


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_throughput(
    model: nn.Module,
    inputs: tuple[Any, ...],
    *,
    forward_kwargs: dict[str, Any] | None = None,
    warmup: int = 3,
    runs: int = 10,
    progress: bool = False,
    load: Callable[[], float | None] = read_load_average,
    computing_before: bool = False,
) -> dict[str, Any]:
    """Time ``model(*inputs)`` in eval mode; returns ``img_per_s``, ``ms_per_batch`` (median),
    ``threads``, and how far to trust them (:func:`leanformer.bench.reliability.assess`:
    ``spread_pct``, ``load_before``/``load_after`` read by ``load``, ``busy``, ``unreliable``).

    ``progress``: a bar over the runs (it advances between them, outside the timed calls).
    ``computing_before``: the process was busy just before (its own load is not others')."""
    if warmup < 0 or runs < 1:
        raise ValueError(f"need warmup >= 0 and runs >= 1, got warmup={warmup}, runs={runs}")
    kwargs = forward_kwargs or {}
    first = batch_input(inputs, kwargs)
    was_training = model.training
    model.eval()
    device = first.device
    load_before = load()
    try:
        for _ in range(warmup):
            model(*inputs, **kwargs)
        _sync(device)
        times = []
        for _ in progress_bar(range(runs), desc="timing", show=progress, leave=False):
            start = time.perf_counter()
            model(*inputs, **kwargs)
            _sync(device)
            times.append(time.perf_counter() - start)
    finally:
        model.train(was_training)
    median = statistics.median(times)
    threads = torch.get_num_threads()
    return {
        "img_per_s": first.shape[0] / median,
        "ms_per_batch": median * 1e3,
        "ms_per_batch_min": min(times) * 1e3,
        "threads": threads,
        **assess(
            times,
            cores_in_use=threads,
            load_before=load_before,
            load_after=load(),
            computing_before=computing_before,
        ),
    }
