"""Result files: one JSON object per line."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


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
