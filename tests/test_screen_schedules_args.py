"""``benchmarks/screen_schedules.py`` checks every point of its grid before loading anything."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "screen_schedules", REPO / "benchmarks" / "screen_schedules.py"
)
assert _spec is not None and _spec.loader is not None
screen_schedules = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(screen_schedules)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--targets", "abc"], "--targets takes comma-separated numbers, got 'abc'"),
        (["--bends=0,x"], "--bends takes comma-separated numbers"),
        (["--targets", "0.5,1.5"], "gflops is a fraction of the unpooled model's GFLOPs, in (0, 1], got 1.5"),
        (["--tilts=20"], "tilt must lie in [-10.0, 10.0], got 20.0"),
        (["--methods", "merge,kmeens"], "unknown pooling method 'kmeens'; did you mean kmeans"),
        (["--methods", "none"], "none keeps every token"),
        (["--threads", "0"], "--threads must be at least 1"),
        (["--out", "no_such_folder/x.jsonl"], "the folder no_such_folder does not exist"),
    ],
)
def test_bad_arguments_stop_before_the_model_loads(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_loading(*_: object, **__: object) -> None:
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(screen_schedules, "create_model", no_loading)
    monkeypatch.setattr(sys, "argv", ["screen_schedules.py", *args])
    with pytest.raises(SystemExit) as stop:
        screen_schedules.main()
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_the_grid_is_every_target_method_and_shape() -> None:
    parser = screen_schedules.argparse.ArgumentParser()
    args = screen_schedules.argparse.Namespace(targets="0.5,0.36", tilts="-1,0", bends="0,1", methods="merge")
    targets, methods, shapes = screen_schedules.check_grid(parser, args)
    assert targets == [0.5, 0.36] and methods == ["merge"]
    assert shapes == [(-1.0, 0.0), (-1.0, 1.0), (0.0, 0.0), (0.0, 1.0)]
