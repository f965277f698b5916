"""``tools/combine_sweeps.py``: joins parts of one sweep, and refuses anything else."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("combine_sweeps", REPO / "tools" / "combine_sweeps.py")
assert _spec is not None and _spec.loader is not None
combine_sweeps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(combine_sweeps)
CONFIG = {"name": "s", "model": "deit_test", "data": {"limit_test": 100}, "carry": True, "seed": 0}


def _row(method: str, keep: str, top1: float, gflops: float) -> dict[str, Any]:
    return {
        "sweep": "s",
        "method": method,
        "keep": keep,
        "keep_value": None if method == "none" else 0.5,
        "carry": method != "none",
        "finetuned": False,
        "seed": None,
        "gflops": gflops,
        "tokens_out": 9,
        "top1": top1,
        "loss": 1.0,
        "n": 100,
        "img_per_s": 50.0,
        "ms_per_batch": 20.0,
        "threads": 1,
    }


def _part(folder: Path, methods: list[str], base_top1: float = 90.0, **config: Any) -> Path:
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(json.dumps({**CONFIG, "methods": methods, **config}))
    rows = [_row("none", "all", base_top1, 1.0)] + [
        _row(m, "r0.5", 80.0 + i, 0.5) for i, m in enumerate(methods)
    ]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _combine(*args: Path | str) -> str:
    """Run the tool; ``""`` when it succeeds, else the message it stops with."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["combine_sweeps.py", *map(str, args)])
        try:
            combine_sweeps.main()
        except SystemExit as stop:
            return str(stop.code)
    return ""


def test_parts_of_one_sweep_are_joined_first_part_first(tmp_path: Path) -> None:
    a = _part(tmp_path / "a", ["merge", "kmeans"])
    b = _part(tmp_path / "b", ["kmeans", "powerbert"], name="other_name")
    assert _combine(tmp_path / "out", a, b) == ""
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [(r["method"], r["top1"]) for r in rows] == [
        ("none", 90.0),
        ("merge", 80.0),
        ("kmeans", 81.0),  # a's: the first part's row is kept
        ("powerbert", 81.0),
    ]
    assert (tmp_path / "out" / "table.md").is_file() and (tmp_path / "out" / "tradeoff.png").is_file()
    # A second join into the same folder needs --overwrite.
    assert "already holds results.jsonl" in _combine(tmp_path / "out", b, a)
    assert _combine(tmp_path / "out", b, a, "--overwrite") == ""


def test_parts_of_different_sweeps_are_refused(tmp_path: Path) -> None:
    a = _part(tmp_path / "a", ["merge"])
    other_data = _part(tmp_path / "b", ["kmeans"], data={"limit_test": 50})
    stop = _combine(tmp_path / "out", a, other_data)
    assert "not a part of the same sweep" in stop and "data differ" in stop
    other_base = _part(tmp_path / "c", ["kmeans"], base_top1=91.0)
    assert "the baselines differ" in _combine(tmp_path / "out", a, other_base)
    assert not (tmp_path / "out").exists()  # nothing written


def test_missing_empty_and_own_folders_are_refused(tmp_path: Path) -> None:
    a = _part(tmp_path / "a", ["merge"])
    assert "holds no sweep.json" in _combine(tmp_path / "out", a, tmp_path / "missing")
    empty = _part(tmp_path / "e", ["merge"])
    (empty / "results.jsonl").write_text("")
    assert "holds no results" in _combine(tmp_path / "out", a, empty)
    assert "is one of the parts" in _combine(a, a)
    b = _part(tmp_path / "b", ["kmeans"])
    assert "is a sweep's own folder" in _combine(b, a)
    assert json.loads((b / "results.jsonl").read_text().splitlines()[1])["method"] == "kmeans"  # untouched
