"""Keep schedules: presets from the paper's appendix G, ratios, validation errors."""

from __future__ import annotations

import pytest

from leanformer.layers.budgets import PRESETS, budget_to_count, effective_counts, list_presets, resolve_keep


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


def test_resolve_forms() -> None:
    assert resolve_keep("deit_s_level3", depth=12) == list(PRESETS["deit_s_level3"])
    assert resolve_keep(0.5, depth=3) == [0.5, 0.5, 0.5]
    assert resolve_keep("0.25", depth=2) == [0.25, 0.25]
    assert resolve_keep("3,2,1", depth=3) == [3, 2, 1]
    assert resolve_keep([4, 0.5, 0], depth=3) == [4, 0.5, 0]
    assert resolve_keep((1.0, 2), depth=2) == [1.0, 2]
    assert resolve_keep("0.5, 3, 1.0", depth=3) == [0.5, 3, 1.0]


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
        ([1, 2, 1.5], r"keep\[2\].*ratio must be in \(0, 1\]"),
        ([1, 2, 0.0], r"keep\[2\].*ratio"),
        ([1, True, 2], r"keep\[1\].*int or a float"),
        ([1, "a", 2], r"keep\[1\]"),
        (2.0, r"ratio must be in \(0, 1\]"),
        (float("nan"), "ratio"),
        (5, "ambiguous"),
        ("deit_s_levl3", "did you mean deit_s_level3"),
        ("nonsense", "unknown keep preset"),
        ("3,,1", "empty entry at position 2"),
        ("3,1,", "empty entry at position 3"),
        ("3,a,1", r"entry 2 \('a'\) is neither"),
        (None, "needs keep="),
        ({"a": 1}, "keep must be"),
    ],
)
def test_bad_budgets_raise(keep: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_keep(keep, depth=3)


def test_preset_length_must_match_depth() -> None:
    with pytest.raises(ValueError, match="12 entries but the model has 6 blocks"):
        resolve_keep("deit_s_level1", depth=6)
