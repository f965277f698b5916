"""``leanformer.bench.results``: the rows every benchmark script writes, and their stamp."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from leanformer.bench.results import results_path, run_stamp, write_jsonl


def test_the_stamp_names_the_command_as_run_from_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/somewhere/benchmarks/bench_drrt.py", "--threads", "1"])
    stamp = run_stamp(threads=1)
    assert stamp["command"] == "python benchmarks/bench_drrt.py --threads 1"
    assert stamp["threads"] == 1 and stamp["torch"] == torch.__version__
    assert set(stamp) == {"machine", "command", "date", "threads", "torch"}
    assert run_stamp()["threads"] == torch.get_num_threads()


def test_rows_append_as_json_lines_under_the_results_folder(tmp_path: Path) -> None:
    assert results_path("drrt") == Path("benchmarks/results/drrt.jsonl")
    out = tmp_path / "new" / "x.jsonl"
    write_jsonl([{"a": 1}], out)
    write_jsonl([{"a": 2}, {"b": [1, 2]}], out, append=True)
    assert [json.loads(line) for line in out.read_text().splitlines()] == [{"a": 1}, {"a": 2}, {"b": [1, 2]}]
    write_jsonl([{"a": 3}], out)  # without append, the file is replaced
    assert out.read_text() == '{"a": 3}\n'
