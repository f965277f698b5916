"""Sweep budgets given as a GFLOPs fraction: spellings, the shaped schedule, the solver
against a brute-force scan, and a sweep whose points land on their target."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from leanformer.apps.gflops_budget import gflops_label
from leanformer.apps.sweep_config import budget_label, keep_value, sweep_config_from_dict
from leanformer.apps.tradeoff import iter_rows, run_sweep, with_method
from leanformer.bench.flops import count_gflops
from leanformer.engine.builders import build_split
from leanformer.pooling.budgets import check_gflops_budget, parse_gflops_text
from leanformer.pooling.gflops import shaped_ratios, solve_keep_ratios
from sweep_models import untrained_deit_test

DATA = {"name": "digits", "img_size": 16, "limit_test": 48, "eval_batch_size": 48, "batch_size": 16}


def test_spellings_and_labels() -> None:
    assert keep_value("g0.5") == {"gflops": 0.5, "tilt": 0.0}
    assert keep_value("g0.36t-1.2") == {"gflops": 0.36, "tilt": -1.2}
    assert keep_value("0.5") == 0.5  # a keep ratio stays a keep ratio
    assert parse_gflops_text("deit_s_level3") is None
    assert gflops_label({"gflops": 0.5}) == "g0.5" == budget_label({"gflops": 0.5, "tilt": 0})
    assert budget_label({"gflops": 0.36, "tilt": -1.2}) == "g0.36t-1.2"
    assert keep_value("g1e-1t5e-1") == {"gflops": 0.1, "tilt": 0.5}
    assert keep_value("g0.36b1") == {"gflops": 0.36, "tilt": 0.0, "bend": 1.0}
    assert keep_value("g0.36t-1.2b-0.5") == {"gflops": 0.36, "tilt": -1.2, "bend": -0.5}
    assert keep_value("g0.36b0") == keep_value("g0.36")  # a zero bend is no bend
    assert budget_label({"gflops": 0.36, "bend": 1}) == "g0.36b1.0"
    assert budget_label({"gflops": 0.36, "tilt": -1.2, "bend": 0.5}) == "g0.36t-1.2b0.5"
    # Labels read back as the same budget, so two budgets never share a point's name.
    close = [
        {"gflops": 0.3333333},
        {"gflops": 0.333333},
        {"gflops": 0.5, "tilt": -1.2000001},
        {"gflops": 0.5, "bend": -1.2},
        {"gflops": 0.5, "tilt": -1.2, "bend": 1e-9},
    ]
    labels = [budget_label(b) for b in close] + [budget_label({"gflops": 0.5, "tilt": -1.2})]
    assert len(set(labels)) == len(labels)
    assert all(keep_value(label) == check_gflops_budget(b) for label, b in zip(labels, close, strict=False))


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ({"gflops": 0}, r"in \(0, 1\]"),
        ({"gflops": 1.5}, r"in \(0, 1\]"),
        ({"gflops": "half"}, "finite number"),
        ({"gflops": 0.5, "tilt": math.nan}, "finite number"),
        ({"gflops": 0.5, "tlt": 1}, "not tlt"),
        ({"gflops": 0.5, "tilt": 60}, r"tilt must lie in \[-10.0, 10.0\]"),
        ({"gflops": 0.5, "bend": -11}, r"bend must lie in \[-10.0, 10.0\]"),
        ({"gflops": 0.5, "bend": "up"}, "bend must be a finite number"),
        ({"gflops": 0.5, "bent": 1}, "takes gflops:, tilt: and bend:, not bent"),
    ],
)
def test_bad_budgets_are_named(budget: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_gflops_budget(budget)
    with pytest.raises(ValueError, match=message):
        sweep_config_from_dict({"model": "deit_test", "methods": ["merge"], "budgets": [budget]})


def test_bad_command_line_spellings() -> None:
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        keep_value("g2")
    for text in ("g0.5.1", "g0.5t", "G0.5", "g0.5b", "g0.5b1t1"):
        with pytest.raises(ValueError, match="expected g<fraction>"):
            keep_value(text)


def test_shaped_ratios() -> None:
    assert shaped_ratios(0.7, 0.0, 4) == [0.7] * 4
    front = shaped_ratios(0.6, -0.5, 5)
    assert front == sorted(front)  # tilt < 0: fewer tokens kept early, more late
    assert math.prod(front) == pytest.approx(0.6**5)  # the geometric mean stays rho
    assert shaped_ratios(0.9, -3.0, 3)[-1] == 1.0  # capped: a block cannot add tokens
    assert shaped_ratios(0.4, 2.0, 1) == [0.4]
    # The formula, written out for six blocks: u = -1, -0.6, -0.2, 0.2, 0.6, 1.
    u = [-1.0, -0.6, -0.2, 0.2, 0.6, 1.0]
    expected = [0.5 ** (1 - 0.4 * x + 0.8 * (x * x - 1 / 3)) for x in u]
    assert shaped_ratios(0.5, -0.4, 6, bend=0.8) == pytest.approx(expected, rel=1e-12)
    middle = shaped_ratios(0.5, 0.0, 6, bend=1.0)  # bend > 0: more kept in the middle
    assert middle == pytest.approx(middle[::-1]) and middle[0] < middle[1] < middle[2]
    ends = shaped_ratios(0.5, 0.0, 6, bend=-1.0)  # bend < 0: more kept at both ends
    assert ends[0] > ends[1] > ends[2]


def test_solver_finds_the_largest_ratio_under_the_target() -> None:
    """Against a scan of every ratio on a fine grid, for a step-shaped cost like a model's."""

    def cost(ratios: list[float]) -> float:
        return sum(math.floor(r * 50 + 0.5) for r in ratios) / 150

    for target, tilt, bend in [(0.5, 0.0, 0.0), (0.33, -0.8, 0.0), (0.8, 0.7, 0.0), (0.4, -0.3, 1.5)]:
        budget = {"gflops": target, "tilt": tilt, "bend": bend}
        ratios = solve_keep_ratios(budget, depth=3, cost=cost, name="m")
        assert ratios == pytest.approx(shaped_ratios(ratios[1] ** (1 / (1 - bend / 3)), tilt, 3, bend))
        assert cost(ratios) <= target
        grid = [i / 20000 for i in range(1, 20001)]
        best = max(c for c in (cost(shaped_ratios(r, tilt, 3, bend)) for r in grid) if c <= target)
        assert cost(ratios) == best
    assert solve_keep_ratios({"gflops": 1.0}, depth=3, cost=cost, name="m") == [1.0] * 3
    with pytest.raises(
        ValueError, match=r"m: out of reach, the cheapest schedule of this tilt and bend still costs 0\.2"
    ):
        solve_keep_ratios({"gflops": 0.001}, depth=3, cost=lambda r: 0.2 + sum(r), name="m")


def test_sweep_points_land_on_their_gflops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = sweep_config_from_dict(
        {
            "model": "deit_test",
            "data": DATA,
            "methods": ["merge", "kmeans"],
            "budgets": [{"gflops": 0.6}, {"gflops": 0.6, "tilt": -1.0}, {"gflops": 0.6, "bend": 1.5}],
            "throughput": False,
        }
    )
    base = untrained_deit_test()
    result = run_sweep(cfg, out_dir=tmp_path, progress=False, base=base)
    rows = list(iter_rows(tmp_path / "results.jsonl"))
    assert [(r["method"], r["keep"]) for r in rows] == [
        ("none", "all"),
        ("merge", "g0.6"),
        ("merge", "g0.6t-1.0"),
        ("merge", "g0.6b1.5"),
        ("kmeans", "g0.6"),
        ("kmeans", "g0.6t-1.0"),
        ("kmeans", "g0.6b1.5"),
    ]
    full = rows[0]["gflops"]
    for row in rows[1:]:
        # Not above the target, and near it (this model has 16 tokens: one is a big step).
        assert 0.45 * full <= row["gflops"] <= 0.6 * full
        schedule = row["keep_schedule"]
        variant = with_method(base, row["method"], schedule, carry=True, options={})
        example = next(iter(torch.utils.data.DataLoader(build_split(cfg.data, "test"), batch_size=4)))[0]
        assert count_gflops(variant, (example,)) == pytest.approx(row["gflops"])
    tilted = rows[2]["keep_schedule"]
    assert tilted == sorted(tilted) and tilted[0] < tilted[-1]
    bent = rows[3]["keep_schedule"]
    assert bent[0] < max(bent) and bent[-1] < max(bent)  # more kept in the middle
    assert result.rows[1]["keep_schedule"] == rows[1]["keep_schedule"]
    # A resumed sweep solves only the points it still measures: here none.
    from leanformer.apps import tradeoff

    def unexpected(*args: object, **kwargs: object) -> list[float]:
        raise AssertionError("a measured point was solved again")

    monkeypatch.setattr(tradeoff, "solve_gflops", unexpected)
    again = run_sweep(cfg, out_dir=tmp_path, progress=False, base=base, resume=True)
    assert [r["top1"] for r in again.rows] == [r["top1"] for r in rows]
