"""Join sweeps of one model run in parts (e.g. two processes, each with some of the methods).

    python tools/combine_sweeps.py OUT_DIR PART_DIR [PART_DIR ...] [--title TITLE] [--overwrite]

The parts must be one sweep split up: their ``sweep.json`` may differ only in the
methods, budgets, ToMe points and name, and their unpooled baselines must agree (top-1 or mIoU,
test images and GFLOPs); anything else is refused, since the joined table reads every
row against one baseline. Each part's ``results.jsonl`` holds its own baseline (and, with
``tome_r``, its own ToMe points): the first part's are kept, later parts contribute only
what earlier ones lack. Writes ``OUT_DIR/results.jsonl``, ``table.md`` (seeds summarised)
and ``tradeoff.png``, as ``leanformer tradeoff`` does for one process. OUT_DIR may not
be a sweep's own folder, and a previous join there is replaced only with ``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from leanformer.apps.plots import plot_tradeoff
from leanformer.apps.tradeoff import add_relative, iter_rows, markdown_table, summarise_seeds

# What parts of one sweep may differ in; every other sweep.json field must be equal.
MAY_DIFFER = ("name", "methods", "budgets", "tome_r")
OUTPUTS = ("results.jsonl", "table.md", "tradeoff.png")
BASELINE_FIELDS = ("top1", "miou", "n", "gflops")  # a segmentation sweep scores miou


def read_part(part: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A part's sweep.json and rows; SystemExit naming what is missing."""
    for name in ("sweep.json", "results.jsonl"):
        if not (part / name).is_file():
            raise SystemExit(f"{part} holds no {name}: give the folders of finished sweeps")
    rows = list(iter_rows(part / "results.jsonl"))
    if not rows:
        raise SystemExit(f"{part}/results.jsonl holds no results")
    return json.loads((part / "sweep.json").read_text()), rows


def check_same_sweep(parts: list[Path], configs: list[dict[str, Any]], rows: list[list[dict]]) -> None:
    first = {k: v for k, v in configs[0].items() if k not in MAY_DIFFER}
    for part, config in zip(parts[1:], configs[1:], strict=True):
        other = {k: v for k, v in config.items() if k not in MAY_DIFFER}
        differ = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
        if differ:
            raise SystemExit(
                f"{part} is not a part of the same sweep as {parts[0]}: its {', '.join(differ)} "
                f"differ (parts may differ only in {', '.join(MAY_DIFFER)})"
            )
    baselines = []
    for part, part_rows in zip(parts, rows, strict=True):
        base = next((r for r in part_rows if r["method"] == "none"), None)
        if base is None:
            raise SystemExit(f"{part} holds no baseline row (method none)")
        baselines.append({k: base.get(k) for k in BASELINE_FIELDS})
    for part, baseline in zip(parts[1:], baselines[1:], strict=True):
        if baseline != baselines[0]:
            raise SystemExit(
                f"the baselines differ: {baselines[0]} in {parts[0]}, {baseline} in {part} "
                "(each part trained or loaded another base model?)"
            )


def check_out_dir(out: Path, parts: list[Path], overwrite: bool) -> None:
    if any(out.resolve() == part.resolve() for part in parts):
        raise SystemExit(f"{out} is one of the parts: write the join to another folder")
    if (out / "sweep.json").exists():
        raise SystemExit(f"{out} is a sweep's own folder (sweep.json): write the join to another folder")
    present = [name for name in OUTPUTS if (out / name).exists()]
    if present and not overwrite:
        raise SystemExit(f"{out} already holds {', '.join(present)}: pass --overwrite to replace them")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("parts", type=Path, nargs="+")
    parser.add_argument("--title", default=None)
    parser.add_argument("--overwrite", action="store_true", help="replace a previous join in OUT")
    args = parser.parse_args()
    check_out_dir(args.out, args.parts, args.overwrite)
    configs, part_rows = zip(*(read_part(part) for part in args.parts), strict=True)
    check_same_sweep(args.parts, list(configs), list(part_rows))

    rows: list[dict] = []
    seen: set[tuple] = set()
    for part in part_rows:
        for row in part:
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
