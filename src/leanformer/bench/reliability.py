"""Whether a throughput figure can be trusted: its spread over runs, and the machine's load.

A figure measured while other jobs share the cores is not the model's speed (a demo run
beside other jobs printed a small fraction of what a quiet bench times for the same model;
docs/BENCHMARKS.md, "How we measure"). Every throughput row carries
``spread_pct``, the range of its timed runs over their median, and ``load_before`` /
``load_after``, the one-minute load average around the timing. A row is *unreliable* when
the spread is wide (:data:`WIDE_SPREAD_PCT`) or the machine was busy
(:func:`machine_busy`). Tables mark such rows (:data:`MARK`) and :func:`remeasure_note`
says which figures to measure again.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Any

WIDE_SPREAD_PCT = 25.0  # (slowest - fastest) / median of the timed runs, in percent
MARK = "*"  # after a figure in a table: spread wide or machine busy


def read_load_average() -> float | None:
    """The one-minute load average, or None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def spread_pct(times: Iterable[float]) -> float:
    """``100 * (max - min) / median`` of the timed runs (0 for a single run)."""
    values = list(times)
    median = statistics.median(values)
    return 100.0 * (max(values) - min(values)) / median if median > 0 else 0.0


def machine_busy(
    load_before: float | None,
    load_after: float | None,
    *,
    cores_in_use: int,
    cores: int | None = None,
    computing_before: bool = False,
) -> bool:
    """Whether other work shared the cores a timing used: the load that is not the timing's
    own exceeds the cores it left free (with half a core of slack for the load's noise).

    Other work is estimated from the load after the timing less its ``cores_in_use``
    threads, and from the load before it (less those threads too when the process was
    ``computing_before``, e.g. evaluating the model it then times). The load average lags,
    so a short burst of other work can pass unseen; a sustained one cannot.
    """
    cores = cores or os.cpu_count() or 1
    own_before = cores_in_use if computing_before else 0
    readings = ((load_before, own_before), (load_after, cores_in_use))
    others = [load - own for load, own in readings if load is not None]
    return bool(others) and max(others) > max(0, cores - cores_in_use) + 0.5


def assess(
    times: list[float],
    *,
    cores_in_use: int,
    load_before: float | None,
    load_after: float | None,
    cores: int | None = None,
    computing_before: bool = False,
) -> dict[str, Any]:
    """The reliability fields of a throughput row (see the module doc)."""
    spread = spread_pct(times)
    busy = machine_busy(
        load_before, load_after, cores_in_use=cores_in_use, cores=cores, computing_before=computing_before
    )
    return {
        "spread_pct": spread,
        "load_before": load_before,
        "load_after": load_after,
        "busy": busy,
        "unreliable": busy or spread > WIDE_SPREAD_PCT,
    }


def marked(text: str, row: Mapping[str, Any]) -> str:
    """``text`` (a formatted figure) with :data:`MARK` when ``row`` is unreliable."""
    return f"{text}{MARK}" if row.get("unreliable") else text


def remeasure_note(
    rows: Iterable[Mapping[str, Any]], label: Callable[[Mapping[str, Any]], str]
) -> str | None:
    """One line naming the rows whose throughput is unreliable, or None when every one is fine."""
    bad = [row for row in rows if row.get("unreliable")]
    if not bad:
        return None
    busy = any(row.get("busy") for row in bad)
    why = "the machine was busy" if busy else f"their runs spread over more than {WIDE_SPREAD_PCT:.0f}%"
    names = ", ".join(label(r) for r in bad)
    return f"throughput figures marked {MARK} are unreliable ({why}): re-measure {names} on a quiet machine"
