"""Render docs/BENCHMARKS.md from the results files under benchmarks/results/.

    python tools/render_benchmarks.py           # write the page
    python tools/render_benchmarks.py --check   # exit 1 if the page on disk differs

The page is a hand-written template (``benchmarks/page_template.md``: the prose, what each
section claims) in which a line holding only a directive becomes a table or the commands
that produced it, read from a results file (JSON lines, one object per measurement, as
``leanformer.bench.results.write_jsonl`` writes them). Three directives:

    {{table FILE columns="Header={field:.2f} | Header={field}" [where="key=value,..."]}}
        one markdown row per result row, in file order;
    {{pivot FILE rows="Header={field}" cols=FIELD cell="{field:.2f}" [where=...]}}
        one markdown row per distinct row label, one column per distinct value of FIELD
        (both in order of first appearance), each cell formatted from its result row;
    {{commands FILE [where=...]}}
        a bash block of the distinct commands of the rows, each with a comment naming
        its machine, threads and dates (fields left out, or "not recorded", are not named).

FILE is a name under the results folder (``.jsonl`` may be left out). A format may give
alternatives separated by ``||``: the first whose fields the row has is used (e.g. a
standard deviation only for rows that have one); with none, the cell is empty.
Standard library only, so ``make test`` runs it without importing torch.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import string
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DIRECTIVE = re.compile(r"^\{\{(\w+)(.*)\}\}$")
NOT_RECORDED = "not recorded"
HEADER = (
    "<!-- Rendered by tools/render_benchmarks.py from benchmarks/page_template.md"
    " and benchmarks/results/. -->\n"
)

Row = dict[str, Any]


class TemplateError(Exception):
    """A template or results file the renderer cannot use; the message is one line."""


def read_rows(results: Path, name: str) -> list[Row]:
    """The rows of one results file, refusing a missing file or a line that is not an object."""
    path = results / (name if name.endswith(".jsonl") else f"{name}.jsonl")
    if not path.is_file():
        raise TemplateError(f"no results file {path}")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise TemplateError(f"{path}:{number}: not JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise TemplateError(f"{path}:{number}: a results line must be a JSON object")
        rows.append(row)
    return rows


def select(rows: list[Row], where: str) -> list[Row]:
    """The rows whose fields equal every ``key=value`` of ``where`` (compared as text)."""
    wanted = []
    for item in filter(None, (part.strip() for part in where.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise TemplateError(f"where={where!r}: each condition is key=value")
        wanted.append((key.strip(), value.strip()))
    chosen = [row for row in rows if all(key in row and str(row[key]) == value for key, value in wanted)]
    if not chosen:
        raise TemplateError(f"no result row matches where={where!r}")
    return chosen


def fields_of(fmt: str) -> list[str]:
    """The row fields a format string reads (``{top1:.2f}`` reads ``top1``)."""
    return [field for _, field, _, _ in string.Formatter().parse(fmt) if field]


def fill(fmt: str, row: Row) -> str:
    """``fmt`` filled from ``row``: the first ``||`` alternative whose fields the row has."""
    for alternative in fmt.split("||"):
        if all(field in row for field in fields_of(alternative)):
            try:
                return alternative.strip().format(**row)
            except (ValueError, TypeError) as error:
                raise TemplateError(f"cannot format {alternative.strip()!r}: {error}") from None
    return ""


def parse_columns(spec: str) -> list[tuple[str, str]]:
    """``"Header={fmt} | Header={fmt}"`` as (header, format) pairs."""
    columns = []
    for part in spec.split(" | "):
        header, sep, fmt = part.partition("=")
        if not sep or not header.strip():
            raise TemplateError(f"column {part.strip()!r}: write it as Header={{field}}")
        columns.append((header.strip(), fmt.strip()))
    return columns


def is_figure(cell: str) -> bool:
    """Whether a cell reads as a number (right-aligned): ``88.42 (0.90x)``, ``+1.55``, ``—``."""
    return cell in ("", "—") or bool(re.match(r"[-+]?[0-9.]", cell))


def markdown_table(headers: list[str], body: list[list[str]]) -> list[str]:
    """A markdown table; columns of figures right-aligned, the first column always left."""
    align = ["---"] + [
        "---:" if all(is_figure(cells[i]) for cells in body) else "---" for i in range(1, len(headers))
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def render_table(rows: list[Row], args: dict[str, str]) -> list[str]:
    columns = parse_columns(args["columns"])
    body = [[fill(fmt, row) for _, fmt in columns] for row in rows]
    if any("\n" in cell or "|" in cell for cells in body for cell in cells):
        raise TemplateError("table: a cell may not hold a line break or '|' (use the commands directive)")
    return markdown_table([header for header, _ in columns], body)


def render_pivot(rows: list[Row], args: dict[str, str]) -> list[str]:
    (label_header, label_fmt), *extra = parse_columns(args["rows"])
    if extra:
        raise TemplateError("pivot: rows= takes one column")
    key = args["cols"]
    labels: list[str] = []
    keys: list[str] = []
    cells: dict[tuple[str, str], str] = {}
    for row in rows:
        if key not in row:
            raise TemplateError(f"pivot: a row has no {key!r} field")
        label, column = fill(label_fmt, row), str(row[key])
        labels += [] if label in labels else [label]
        keys += [] if column in keys else [column]
        if (label, column) in cells:
            raise TemplateError(f"pivot: two rows for {label!r} at {key}={column}")
        cells[label, column] = fill(args["cell"], row)
    body = [[label, *(cells.get((label, column), "") for column in keys)] for label in labels]
    return markdown_table([label_header, *keys], body)


def provenance(seen: dict[str, list[str]]) -> str:
    """``Zen 3 machine, 2 threads, 2026-11-27``: what a command ran on, and when."""
    machine = ", ".join(seen["machine"]).replace(NOT_RECORDED, f"machine {NOT_RECORDED}")
    threads = "/".join(seen["threads"])
    parts = [machine, f"{threads} thread{'' if threads == '1' else 's'}", ", ".join(sorted(seen["date"]))]
    return ", ".join(part for part in parts if not part.startswith(NOT_RECORDED))


def render_commands(rows: list[Row], args: dict[str, str]) -> list[str]:
    commands: dict[str, dict[str, list[str]]] = {}
    for row in rows:
        if "command" not in row:
            raise TemplateError("commands: a row has no 'command' field")
        seen = commands.setdefault(row["command"], {"machine": [], "threads": [], "date": []})
        for field, values in seen.items():
            value = str(row.get(field, NOT_RECORDED))
            values += [] if value in values else [value]
    lines = ["```bash"]
    for command, seen in commands.items():
        first, *rest = command.splitlines()
        lines += [f"{first}  # {provenance(seen)}", *rest]
    return [*lines, "```"]


RENDERERS: dict[str, tuple[Callable[[list[Row], dict[str, str]], list[str]], set[str]]] = {
    "table": (render_table, {"columns"}),
    "pivot": (render_pivot, {"rows", "cols", "cell"}),
    "commands": (render_commands, set()),
}


def render_directive(name: str, text: str, results: Path) -> list[str]:
    """The lines one directive stands for."""
    if name not in RENDERERS:
        raise TemplateError(f"unknown directive {name!r} (known: {', '.join(RENDERERS)})")
    renderer, required = RENDERERS[name]
    try:
        words = shlex.split(text)
    except ValueError as error:
        raise TemplateError(f"{name}: {error}") from None
    if not words or "=" in words[0]:
        raise TemplateError(f"{name}: give the results file first")
    args = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or key not in required | {"where"}:
            raise TemplateError(f"{name}: unknown argument {word!r}")
        args[key] = value
    if missing := required - args.keys():
        raise TemplateError(f"{name}: missing {', '.join(sorted(missing))}")
    return renderer(select(read_rows(results, words[0]), args.get("where", "")), args)


def render(template: Path, results: Path) -> str:
    """The page: the template with every directive line replaced by what it renders."""
    lines = []
    for number, line in enumerate(template.read_text().splitlines(), 1):
        match = DIRECTIVE.match(line.strip())
        if match is None:
            lines.append(line)
            continue
        try:
            lines += render_directive(match[1], match[2], results)
        except TemplateError as error:
            raise TemplateError(f"{template.name}:{number}: {error}") from None
    return HEADER + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the render")
    parser.add_argument("--template", type=Path, default=ROOT / "benchmarks" / "page_template.md")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--page", type=Path, default=ROOT / "docs" / "BENCHMARKS.md")
    args = parser.parse_args(argv)
    if not args.template.is_file():
        print(f"render_benchmarks: no template {args.template}", file=sys.stderr)
        return 2
    try:
        page = render(args.template, args.results)
    except TemplateError as error:
        print(f"render_benchmarks: {error}", file=sys.stderr)
        return 2
    if args.check:
        if not args.page.is_file() or args.page.read_text() != page:
            print(
                f"render_benchmarks: {args.page} differs from what the results render: "
                "run python tools/render_benchmarks.py",
                file=sys.stderr,
            )
            return 1
        return 0
    args.page.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
