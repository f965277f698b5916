"""The one table printer of the demos and applications: columns declared once, markdown out.

A table is a sequence of :class:`Column` (a header, how a row becomes the cell text, and
whether the column is right-aligned) applied to rows that are plain dicts, the same rows
``--json`` prints. Markdown is what every table is read as: on a terminal, in ``table.md``
files and pasted into the docs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from leanformer.bench.reliability import marked, remeasure_note

Row = Mapping[str, Any]


@dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[Row], str]  # the cell text of one row
    right: bool = False  # numbers: right-aligned ("---:") where markdown is rendered


def column(
    key: str, header: str | None = None, fmt: Callable[[Any], str] = str, *, right: bool = False
) -> Column:
    """A column showing ``fmt(row[key])``; a row without ``key`` shows an empty cell."""
    return Column(key if header is None else header, lambda row: fmt(row[key]) if key in row else "", right)


def markdown_table(rows: Sequence[Row], columns: Sequence[Column], *, title: str | None = None) -> str:
    """``rows`` as a markdown table (the header alone when there are none), ``title`` in
    bold above it."""
    lines = [f"**{title}**", ""] if title else []
    lines.append("| " + " | ".join(c.header for c in columns) + " |")
    lines.append("|" + "|".join("---:" if c.right else "---" for c in columns) + "|")
    lines += ["| " + " | ".join(c.cell(row) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def trained_model_columns() -> list[Column]:
    """The columns of a row from ``bench.report.trained_model_row``, as the demos print it."""
    return [
        column("model"),
        column("top1", "top-1 %", "{:.2f}".format, right=True),
        column("params_m", "params (M)", "{:.3f}".format, right=True),
        column("gflops", "GFLOPs", "{:.4f}".format, right=True),
        Column("img/s", lambda r: marked(f"{r['img_per_s']:.0f}", r) if "img_per_s" in r else "", right=True),
    ]


def print_speed_note(rows: Sequence[Row]) -> None:
    """After a demo table: one line on stderr naming the models whose img/s is unreliable."""
    import sys

    note = remeasure_note(rows, lambda r: str(r.get("model")))
    if note:
        print(f"leanformer: warning: {note}", file=sys.stderr)
