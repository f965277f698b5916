"""Keep schedules: presets from the paper's appendix G, one parser for every spelling, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from leanformer.cli import build_parser
from leanformer.config import load_config, to_dict
from leanformer.pooling.budgets import (
    PRESETS,
    KeepSchedule,
    budget_to_count,
    effective_counts,
    list_presets,
    parse_keep,
)


def test_presets_are_the_papers_tables() -> None:
    names = {f"deit_s_level{i}" for i in range(8)} | {f"deit_e252_level{i}" for i in range(2, 8)}
    assert names <= set(list_presets())
    # Spot checks against appendix G (tables 3 and 5).
    assert PRESETS["deit_s_level3"] == (196, 194, 187, 163, 118, 85, 58, 47, 20, 12, 2, 0)
    assert PRESETS["deit_s_level7"] == (162, 129, 66, 33, 4, 1, 1, 0, 0, 0, 0, 0)
    assert PRESETS["deit_e252_level2"] == (196, 196, 193, 179, 154, 123, 88, 79, 39, 22, 5, 0)
    assert PRESETS["deit_e252_level7"] == (188, 122, 58, 28, 12, 2, 0, 2, 0, 0, 0, 0)
    for name, schedule in PRESETS.items():
        assert len(schedule) == 12, name
        assert all(isinstance(v, int) and 0 <= v <= 196 for v in schedule), name


def _per_block(keep: object, depth: int) -> list[int | float]:
    return parse_keep(keep).per_block(depth=depth)


def test_forms_per_block() -> None:
    assert _per_block("deit_s_level3", 12) == list(PRESETS["deit_s_level3"])
    assert _per_block(0.5, 3) == [0.5, 0.5, 0.5]
    assert _per_block("0.25", 2) == [0.25, 0.25]
    assert _per_block("3,2,1", 3) == [3, 2, 1]
    assert _per_block([4, 0.5, 0], 3) == [4, 0.5, 0]
    assert _per_block((1.0, 2), 2) == [1.0, 2]
    assert _per_block("0.5, 3, 1.0", 3) == [0.5, 3, 1.0]
    assert _per_block("[0.5, 0.5]", 2) == [0.5, 0.5]
    # ToMe's form: at most half of what a block receives, so 10 -> 7 -> 4 -> 2 for r=3.
    assert parse_keep({"r": 3}).per_block(depth=3, num_tokens=10) == [7, 4, 2]
    assert parse_keep("r3") == parse_keep({"r": 3})


def test_a_count_is_not_a_ratio() -> None:
    # 1 keeps one token, 1.0 keeps every token: the schedule tells them apart although 1 == 1.0.
    one, everything = parse_keep([1, 1]), parse_keep([1.0, 1.0])
    assert one != everything and one.blocks == (1, 1) and everything.blocks == (1.0, 1.0)
    assert [type(b) for b in parse_keep("1,1.0").blocks or ()] == [int, float]
    assert effective_counts(one.per_block(depth=2), 9) == [1, 1]
    assert effective_counts(everything.per_block(depth=2), 9) == [9, 9]
    assert parse_keep("1.0") == KeepSchedule(ratio=1.0)
    with pytest.raises(ValueError, match=r"an int is a token count.*1\.0 keeps every token"):
        parse_keep(1)
    with pytest.raises(ValueError, match="an int is a token count"):
        parse_keep("1")


@pytest.mark.parametrize(
    "keep", ["deit_s_level3", 0.7, "0.7", [12, 8, 4], "12,8,4", "0.5,0.5", [0.5, 3, 1.0], "r16", {"r": 16}]
)
def test_spellings_round_trip(keep: object) -> None:
    schedule = parse_keep(keep)
    assert parse_keep(str(schedule)) == schedule  # the command-line spelling
    assert parse_keep(schedule.to_value()) == schedule  # the YAML/JSON value
    assert parse_keep(schedule) is schedule  # handed down as is, never parsed again


@pytest.mark.parametrize(
    ("cli", "yaml_value", "python"),
    [
        ("0.7", "0.7", 0.7),
        ("12,8,4", "[12, 8, 4]", [12, 8, 4]),
        ("0.5,0.5", "[0.5, 0.5]", [0.5, 0.5]),
        ("1.0,2", "[1.0, 2]", (1.0, 2)),
        ("r16", "{r: 16}", {"r": 16}),
        ("deit_s_level3", "deit_s_level3", "deit_s_level3"),
    ],
)
def test_cli_yaml_and_python_give_the_same_schedule(
    cli: str, yaml_value: str, python: object, tmp_path: Path
) -> None:
    from_cli = build_parser().parse_args(["eval", "--checkpoint", "x", "--keep", cli]).keep
    path = tmp_path / "run.yaml"
    path.write_text(f"model: deit_digits\nmodel_options:\n  keep: {yaml_value}\n")
    from_yaml = load_config(path).model_options["keep"]
    from_override = load_config(None, {"model_options.keep": cli}).model_options["keep"]
    from_python = parse_keep(python)
    assert isinstance(from_cli, KeepSchedule)
    assert from_cli == from_yaml == from_override == from_python
    # A saved config holds the plain value, which reads back to the same schedule.
    assert parse_keep(to_dict(load_config(path))["model_options"]["keep"]) == from_python


def test_counts_are_maxima() -> None:
    # K_l is a maximum: a schedule going up again has no effect (DeiT-e252 level 7).
    assert effective_counts([5, 3, 4, 0, 2], 6) == [5, 3, 3, 0, 0]
    assert effective_counts([10], 6) == [6]
    assert effective_counts([0.5, 0.5, 1.0], 9) == [5, 3, 3]  # round half up
    assert budget_to_count(0.01, 10) == 0


@pytest.mark.parametrize(
    ("keep", "match"),
    [
        ([1, 2], "2 entries but the model has 3 blocks"),
        ([1, -1, 2], r"keep\[1\] \(block 1\).*>= 0"),
        ([1, 2, 1.5], r"keep\[2\].*ratio \(float\) must be in \(0, 1\]"),
        ([1, 2, 0.0], r"keep\[2\].*ratio"),
        ([1, True, 2], r"keep\[1\].*int token count or a float ratio"),
        ([1, "a", 2], r"keep\[1\]"),
        ([], "one entry per block"),
        (2.0, r"ratio \(float\) must be in \(0, 1\]"),
        (float("nan"), "ratio"),
        (5, "an int is a token count"),
        ("deit_s_levl3", "did you mean deit_s_level3"),
        ("nonsense", "unknown keep preset"),
        ("3,,1", "empty entry at position 2"),
        ("3,1,", "empty entry at position 3"),
        ("3,a,1", r"entry 2 \('a'\) is neither"),
        ("[1, 2", "not a valid YAML list"),
        (None, "needs keep="),
        ({"a": 1}, "keep must be"),
        ({"r": 1.5}, r"token count \(int\) >= 0"),
        ("deit_s_level1", r"12 entries but the model has 3 blocks \(keep=deit_s_level1\)"),
    ],
)
def test_bad_budgets_raise(keep: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_keep(keep).per_block(depth=3)


def test_bad_budget_is_a_usage_error_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["eval", "--checkpoint", "x", "--keep", "0.5,1.5"])
    assert exit_info.value.code == 2
    assert "keep[1] (block 1): a keep ratio (float) must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_a_schedule_holds_exactly_one_form() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        KeepSchedule(ratio=0.5, remove=2)
    with pytest.raises(ValueError, match="exactly one"):
        KeepSchedule()
