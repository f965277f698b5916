"""Throughput figures carry their spread; a busy machine or a wide spread marks them;
without a terminal, long loops print one plain line per step."""

from __future__ import annotations

import io
import sys

import pytest

import leanformer
from leanformer.apps.tradeoff import markdown_table, speed_note, summarise_seeds
from leanformer.bench.reliability import assess, machine_busy, spread_pct
from leanformer.bench.throughput import measure_throughput
from leanformer.progress import PlainProgress, progress_bar


@pytest.mark.parametrize(
    ("before", "after", "threads", "cores", "computing_before", "busy"),
    [
        (0.1, 0.3, 2, 2, False, False),  # quiet
        (0.1, 2.2, 2, 2, False, False),  # after: only the timing's own two threads
        (1.2, 1.5, 2, 2, False, True),  # another job holds a core the timing used
        (0.2, 3.3, 2, 2, False, True),  # ... seen after the timing
        (2.1, 2.2, 2, 2, True, False),  # before: the process's own evaluation
        (3.4, 2.2, 2, 2, True, True),  # ... and another job beside it
        (2.3, 3.1, 1, 4, False, False),  # 1 thread on 4 cores: a free core was left
        (3.9, 4.0, 1, 4, False, True),
        (None, None, 2, 2, False, False),  # no load average on this system: not judged
    ],
)
def test_busy_is_load_of_other_work_above_the_free_cores(
    before: float | None, after: float | None, threads: int, cores: int, computing_before: bool, busy: bool
) -> None:
    assert (
        machine_busy(before, after, cores_in_use=threads, cores=cores, computing_before=computing_before)
        is busy
    )


def test_spread_and_unreliable() -> None:
    assert spread_pct([1.0, 1.0, 1.0]) == 0.0
    assert spread_pct([1.0, 1.1, 1.3]) == pytest.approx(100 * 0.3 / 1.1)  # range over the median
    steady = assess([1.0, 1.02, 1.01], cores_in_use=1, load_before=0.0, load_after=1.0, cores=2)
    assert steady["spread_pct"] == pytest.approx(100 * 0.02 / 1.01) and not steady["unreliable"]
    wide = assess([1.0, 1.5, 1.1], cores_in_use=1, load_before=0.0, load_after=1.0, cores=2)
    assert wide["unreliable"] and not wide["busy"]
    busy = assess([1.0, 1.0, 1.0], cores_in_use=2, load_before=3.0, load_after=5.0, cores=2)
    assert busy["busy"] and busy["unreliable"]


def test_measure_throughput_reads_the_load_around_the_timing() -> None:
    model = leanformer.create_model("deit_test")
    import torch

    readings = iter([9.0, 9.5])  # an injected, very busy machine
    row = measure_throughput(
        model, (torch.randn(2, 3, 16, 16),), warmup=0, runs=2, load=lambda: next(readings)
    )
    assert row["load_before"] == 9.0 and row["load_after"] == 9.5
    assert row["busy"] and row["unreliable"] and row["spread_pct"] >= 0


def _row(method: str, img_per_s: float, *, unreliable: bool, busy: bool = False, **extra: object) -> dict:
    base = {"method": method, "keep": "0.5", "top1": 90.0, "gflops": 0.01, "spread_pct": 4.0}
    return {**base, "img_per_s": img_per_s, "unreliable": unreliable, "busy": busy, **extra}


def test_the_table_marks_unreliable_rows_and_a_line_names_them() -> None:
    rows = [_row("baseline", 1705.0, unreliable=False), _row("tome", 27.0, unreliable=True, busy=True)]
    table = markdown_table(rows)
    assert "1705 ±2%" in table and "1705 ±2%*" not in table
    assert "27 ±2%*" in table
    note = speed_note(rows)
    assert (
        note is not None and "the machine was busy" in note and "tome 0.5" in note and "baseline" not in note
    )
    assert speed_note(rows[:1]) is None
    # Over seeds, one doubtful timing makes the mean doubtful.
    seeds = [_row("random", 50.0, unreliable=False, seed=0), _row("random", 60.0, unreliable=True, seed=1)]
    assert summarise_seeds(seeds)[0]["unreliable"] is True


class _Log(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_without_a_terminal_outer_loops_print_one_line_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    log = _Log()
    monkeypatch.setattr(sys, "stderr", log)
    bar = progress_bar(range(3), desc="sweep demo")
    assert isinstance(bar, PlainProgress)
    for step in bar:
        bar.set_postfix_str(f"point {step}")
    for _ in progress_bar(range(5), desc="timing", leave=False):  # inner loop: silent
        pass
    for _ in progress_bar(range(5), desc="quiet", show=False):
        pass
    assert log.getvalue().splitlines() == [
        "sweep demo: 1/3 point 0",
        "sweep demo: 2/3 point 1",
        "sweep demo: 3/3 point 2",
    ]


def test_demo_tables_mark_their_img_per_s_too(capsys: pytest.CaptureFixture[str]) -> None:
    from leanformer.apps.table import markdown_table as demo_table
    from leanformer.apps.table import print_speed_note, trained_model_columns

    base = {"top1": 90.0, "params_m": 0.1, "gflops": 0.01, "threads": 2}
    rows = [
        {"model": "deit_digits", "img_per_s": 900.0, "unreliable": False, **base},
        {"model": "sret_digits", "img_per_s": 27.0, "unreliable": True, "busy": True, **base},
    ]
    table = demo_table(rows, trained_model_columns())
    assert "| 900 |" in table and "| 27* |" in table
    print_speed_note(rows)
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("leanformer: warning: throughput figures marked *") and "re-measure sret_digits" in err
    )
    print_speed_note(rows[:1])
    assert capsys.readouterr().err == ""
