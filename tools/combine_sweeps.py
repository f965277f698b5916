"""Join sweeps of one model run in parts (e.g. two processes, each with some of the methods).

    python tools/combine_sweeps.py OUT_DIR PART_DIR [PART_DIR ...] [--title TITLE]

Each part's ``results.jsonl`` holds its own unpooled baseline (and, with ``tome_r``, its own
ToMe points): the first part's are kept, later parts contribute only what earlier ones
lack. Writes ``OUT_DIR/results.jsonl``, ``table.md`` (seeds summarised) and
``tradeoff.png``, as ``leanformer tradeoff`` does for one process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from leanformer.apps.plots import plot_tradeoff
from leanformer.apps.tradeoff import add_relative, iter_rows, markdown_table, summarise_seeds


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("parts", type=Path, nargs="+")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    rows: list[dict] = []
    seen: set[tuple] = set()
    for part in args.parts:
        for row in iter_rows(part / "results.jsonl"):
            key = (row["method"], row["keep"], row.get("seed"), row.get("finetuned"))
            if key not in seen:
                seen.add(key)
                rows.append(row)
    add_relative(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarise_seeds(rows)
    title = args.title or rows[0].get("sweep", "")
    (args.out / "table.md").write_text(markdown_table(summary, title=title) + "\n")
    plot_tradeoff(summary, args.out / "tradeoff.png", title=title)
    print(markdown_table(summary, title=title))
    print(f"\nwrote {args.out / 'results.jsonl'}, {args.out / 'table.md'}, {args.out / 'tradeoff.png'}")


if __name__ == "__main__":
    main()
