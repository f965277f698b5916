"""Result files: one JSON object per line, each stamped with where and how it was measured.

Every script under ``benchmarks/`` writes its figures this way, to
``benchmarks/results/NAME.jsonl`` (:func:`results_path`); ``tools/render_benchmarks.py``
renders ``docs/BENCHMARKS.md`` from those files, so a row must say which command, machine
and date its figures come from (:func:`run_stamp`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RESULTS_DIR = Path("benchmarks") / "results"


def results_path(name: str) -> Path:
    """``benchmarks/results/NAME.jsonl``: where a benchmark's figures go by default."""
    return RESULTS_DIR / f"{name}.jsonl"


def run_stamp(*, threads: int | None = None) -> dict[str, Any]:
    """What a results row records besides its figures: machine, command, date, threads, torch.

    The command is the script's name and arguments as given, so that it can be run again
    from the repository's root; ``threads`` defaults to torch's current setting.
    """
    import torch  # here, so that writing rows does not need torch

    return {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join(["python", f"benchmarks/{os.path.basename(sys.argv[0])}", *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "threads": torch.get_num_threads() if threads is None else threads,
        "torch": torch.__version__,
    }


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | Path, *, append: bool = False) -> Path:
    """Write (or append) ``rows`` to ``path`` as JSON lines, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return path


def markdown_rows(rows: Iterable[dict[str, Any]], cols: list[str]) -> str:
    """Rows as a markdown table of the columns ``cols`` (floats with 3 decimals)."""

    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
