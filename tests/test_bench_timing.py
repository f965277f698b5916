"""The side-by-side timer: call counts, medians, bad arguments (a fake clock, no real timing)."""

from __future__ import annotations

import itertools

import pytest

from leanformer.bench.timing import time_interleaved


def test_round_robin_medians_with_fake_clock() -> None:
    calls: list[str] = []
    ticks = itertools.count()
    # Each call advances the fake clock by one tick between start and stop.
    result = time_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        warmup=2,
        runs=3,
        clock=lambda: float(next(ticks)),
    )
    assert calls == ["a", "b"] * 5  # interleaved: warm-up then timed runs
    assert result == {"a": 1.0, "b": 1.0}


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="runs >= 1"):
        time_interleaved({"a": lambda: None}, warmup=0, runs=0)


def test_speedup_rows_set_speed_against_flops() -> None:
    from leanformer.bench.speedup import speedup_rows

    rows = speedup_rows({"none": 2.0, "half": 1.25}, {"none": 4.0, "half": 2.0}, batch=10)
    by_name = {r["name"]: r for r in rows}
    assert by_name["none"]["speedup_over_flops_ratio"] == 1.0
    half = by_name["half"]
    assert (half["flops_ratio"], half["speedup"], half["img_per_s"]) == (2.0, 1.6, 8.0)
    assert half["speedup_over_flops_ratio"] == 0.8
    with pytest.raises(ValueError, match="reference"):
        speedup_rows({"half": 1.0}, {"half": 1.0}, batch=1)


def test_markdown_rows() -> None:
    from leanformer.bench.results import markdown_rows

    table = markdown_rows([{"name": "a", "x": 0.5}, {"name": "b"}], ["name", "x"])
    assert table.splitlines() == ["| name | x |", "|---|---|", "| a | 0.500 |", "| b |  |"]
