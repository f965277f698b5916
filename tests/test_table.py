"""The one table printer: columns declared once, markdown out."""

from __future__ import annotations

from leanformer.apps.table import Column, column, markdown_table


def test_markdown_table_columns_alignment_and_missing_cells() -> None:
    columns = [
        Column("name", lambda r: r["name"].upper()),
        column("top1", "top-1 %", "{:.1f}".format, right=True),
        column("note"),
    ]
    rows = [{"name": "a", "top1": 71.25, "note": "x"}, {"name": "b", "top1": 9.0}]
    assert markdown_table(rows, columns, title="T").splitlines() == [
        "**T**",
        "",
        "| name | top-1 % | note |",
        "|---|---:|---|",
        "| A | 71.2 | x |",
        "| B | 9.0 |  |",
    ]


def test_markdown_table_without_rows_is_its_header() -> None:
    assert markdown_table([], [column("k", "K", right=True)]) == "| K |\n|---:|"
