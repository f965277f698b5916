"""``tools/render_benchmarks.py``: the benchmarks page rendered from results files, and ``--check``.

The rendering is compared with pages written out by hand from small made-up results; the
real page is only ever rendered into a temporary folder (its figures are not tested here).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "render_benchmarks.py"
_spec = importlib.util.spec_from_file_location("render_benchmarks", TOOL)
assert _spec is not None and _spec.loader is not None
render_benchmarks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_benchmarks)

STAMP = {"machine": "Zen 3 machine", "threads": 2, "date": "2026-11-27", "torch": "2.14.1"}


def write_results(folder: Path, name: str, rows: list[dict[str, Any]]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def render_to(tmp_path: Path, template_text: str, *extra: str) -> tuple[int, str]:
    """Render ``template_text`` against ``tmp_path/results``; (exit code, page or stderr)."""
    template = tmp_path / "template.md"
    template.write_text(template_text)
    page = tmp_path / "page.md"
    args = ["--template", str(template), "--results", str(tmp_path / "results"), "--page", str(page)]
    done = subprocess.run([sys.executable, str(TOOL), *args, *extra], capture_output=True, text=True)
    return done.returncode, page.read_text() if done.returncode == 0 and not extra else done.stderr


def test_check_passes_on_the_rendered_page_and_fails_on_a_changed_one(tmp_path: Path) -> None:
    page = tmp_path / "BENCHMARKS.md"
    assert render_benchmarks.main(["--page", str(page)]) == 0  # the real template and results
    check = [sys.executable, str(TOOL), "--check", "--page", str(page)]
    assert subprocess.run(check, capture_output=True, text=True).returncode == 0

    page.write_text(page.read_text().replace("| `merge` |", "| `merge`  |", 1))
    done = subprocess.run(check, capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "differs from what the results render" in done.stderr
    assert "Traceback" not in done.stderr

    page.unlink()
    assert subprocess.run(check, capture_output=True, text=True).returncode == 1


def test_the_real_page_fits_its_budget(tmp_path: Path) -> None:
    page = tmp_path / "BENCHMARKS.md"
    assert render_benchmarks.main(["--page", str(page)]) == 0
    assert len(page.read_text().splitlines()) <= 300


def test_table_pivot_and_commands_render_as_written_by_hand(tmp_path: Path) -> None:
    write_results(
        tmp_path / "results",
        "sweep",
        [
            {
                **STAMP,
                "command": "leanformer tradeoff --out a",
                "method": "merge",
                "budget": "r0.9",
                "top1": 88.2,
            },
            {
                **STAMP,
                "command": "leanformer tradeoff --out a",
                "method": "merge",
                "budget": "r0.5",
                "top1": 72.19,
            },
            {
                **STAMP,
                "command": "leanformer tradeoff --out b",
                "method": "random",
                "budget": "r0.9",
                "top1": 86.95,
                "std": 0.3,
                "threads": 1,
                "date": "2026-11-25",
            },
        ],
    )
    template = (
        "# Page\n"
        "Prose stays as it is.\n"
        '{{pivot sweep rows="method=`{method}`" cols=budget cell="{top1:.2f} ± {std:.2f} || {top1:.1f}"}}\n'
        '{{table sweep where="method=merge" columns="budget={budget} | top-1={top1:.2f} | on={machine}"}}\n'
        "{{commands sweep}}\n"
    )
    code, page = render_to(tmp_path, template)
    assert code == 0, page
    assert page == (
        render_benchmarks.HEADER + "# Page\n"
        "Prose stays as it is.\n"
        "| method | r0.9 | r0.5 |\n"
        "|---|---:|---:|\n"
        "| `merge` | 88.2 | 72.2 |\n"
        "| `random` | 86.95 ± 0.30 |  |\n"
        "| budget | top-1 | on |\n"
        "|---|---:|---|\n"
        "| r0.9 | 88.20 | Zen 3 machine |\n"
        "| r0.5 | 72.19 | Zen 3 machine |\n"
        "```bash\n"
        "leanformer tradeoff --out a  # Zen 3 machine, 2 threads, 2026-11-27\n"
        "leanformer tradeoff --out b  # Zen 3 machine, 1 thread, 2026-11-25\n"
        "```\n"
    )
    # Rendering twice gives the same page, so --check passes right after writing it.
    assert render_to(tmp_path, template, "--check")[0] == 0


def test_a_command_of_several_lines_keeps_them_and_unrecorded_fields_are_left_out(tmp_path: Path) -> None:
    write_results(
        tmp_path / "results",
        "runs",
        [{"command": "python a.py\npython b.py", "machine": "not recorded", "threads": "not recorded"}],
    )
    code, page = render_to(tmp_path, "{{commands runs.jsonl}}\n")
    assert code == 0, page
    assert page.splitlines()[1:] == ["```bash", "python a.py  # machine not recorded", "python b.py", "```"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{{chart sweep}}", "unknown directive 'chart'"),
        ('{{table nowhere columns="a={a}"}}', "no results file"),
        ("{{table sweep}}", "table: missing columns"),
        ('{{table sweep columns="a={a}" colour=red}}', "unknown argument 'colour=red'"),
        ('{{table sweep where="method=tome" columns="a={a}"}}', "no result row matches where='method=tome'"),
        ('{{table sweep columns="{method}"}}', "write it as Header={field}"),
        ('{{table sweep columns="top-1={top1:d}"}}', "cannot format '{top1:d}'"),
        ('{{table sweep columns="run={command}"}}', "a cell may not hold a line break"),
        (
            '{{pivot sweep rows="m={method}" cols=budget cell="{top1}"}}',
            "two rows for 'merge' at budget=r0.9",
        ),
        ('{{commands sweep where="method"}}', "each condition is key=value"),
    ],
)
def test_bad_templates_are_refused_in_one_line_naming_the_line(
    tmp_path: Path, line: str, message: str
) -> None:
    write_results(
        tmp_path / "results",
        "sweep",
        [
            {**STAMP, "command": "a\nb", "method": "merge", "budget": "r0.9", "top1": 88.2},
            {**STAMP, "command": "a\nb", "method": "merge", "budget": "r0.9", "top1": 88.3},
        ],
    )
    code, stderr = render_to(tmp_path, f"# Page\n{line}\n")
    assert code == 2
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert stderr.startswith("render_benchmarks: template.md:2: ") and message in stderr


def test_a_results_line_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "bad.jsonl").write_text('{"a": 1}\n[1, 2]\n')
    code, stderr = render_to(tmp_path, "{{commands bad}}\n")
    assert code == 2 and "bad.jsonl:2: a results line must be a JSON object" in stderr
