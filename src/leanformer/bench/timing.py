"""Side-by-side timing: several functions called round-robin, so background load and
frequency changes hit all of them alike, and the median of each."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

from leanformer.progress import progress_bar

Key = TypeVar("Key", bound=Hashable)  # what names each timed function (a string, a query count, ...)


def time_interleaved(
    fns: Mapping[Key, Callable[[], Any]],
    *,
    warmup: int,
    runs: int,
    clock: Callable[[], float] = time.perf_counter,
    progress: bool = False,
) -> dict[Key, float]:
    """Median seconds per call of every function (``clock``: wall by default, or e.g. process
    time). ``progress``: a bar over the rounds (it advances between them, outside the timed calls)."""
    if warmup < 0 or runs < 1:
        raise ValueError(f"need warmup >= 0 and runs >= 1, got warmup={warmup}, runs={runs}")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[Key, list[float]] = {name: [] for name in fns}
    for _ in progress_bar(range(runs), desc="timing", show=progress, leave=False):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {name: statistics.median(values) for name, values in times.items()}


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def add_clock_argument(parser: argparse.ArgumentParser) -> None:
    """``--clock wall|cpu`` for a benchmark script; look the choice up in :data:`CLOCKS`."""
    parser.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time, which on a busy machine stays close to "
        "the quiet-machine wall time when run with --threads 1",
    )
