"""``keep="0.5x"``: a fraction of the unpooled model's GFLOPs, accepted wherever a budget is,
solved by one solver per method and model, and refused (in one line naming the nearest
costs) when a method cannot land within 2% of it.

The measured ratio is counted on other images than the solver's (it counts one seeded
random image): what a user measures, not what the solver saw.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from leanformer.bench.flops import count_gflops
from leanformer.models.registry import create_model
from leanformer.patch.api import apply_token_pooling, remove_token_pooling
from leanformer.patch.timm import create_timm_model
from leanformer.pooling.budgets import KeepSchedule, parse_keep
from leanformer.pooling.gflops import solve_gflops
from leanformer.pooling.registry import list_methods

# `none` reduces nothing whatever the budget. `conv` reaches 0.5x with two layers (its
# placements are tested below). The clusterings are slow to count (every candidate runs
# their iterations): marked slow.
CLUSTERING = ("kmeans", "kmedoids", "wkmeans", "wkmedoids")
METHODS = [
    pytest.param(m, marks=pytest.mark.slow) if m in CLUSTERING else m for m in list_methods() if m != "none"
]


def _ratio(model: nn.Module, images: torch.Tensor) -> float:
    unpooled = remove_token_pooling(copy.deepcopy(model))
    return count_gflops(model, (images,)) / count_gflops(unpooled, (images,))


def test_spellings() -> None:
    half = parse_keep("0.5x")
    assert half == KeepSchedule(gflops=0.5)
    assert parse_keep("g0.5") == parse_keep({"gflops": 0.5}) == parse_keep(" 0.5X ") == half
    assert str(half) == "0.5x" and parse_keep(half.to_value()) == half and half.label() == "g0.5"
    shaped = parse_keep("g0.36t-1.2b1")
    assert (shaped.gflops, shaped.tilt, shaped.bend) == (0.36, -1.2, 1.0)
    assert parse_keep(str(shaped)) == shaped == parse_keep(shaped.to_value())
    for bad, message in (("1.5x", r"in \(0, 1\]"), ("0x", r"in \(0, 1\]"), ("ax", "unknown keep preset")):
        with pytest.raises(ValueError, match=message):
            parse_keep(bad)
    with pytest.raises(ValueError, match="solved for a method on a model"):
        half.per_block(depth=6, num_tokens=196)


@pytest.mark.parametrize("method", METHODS)
def test_half_the_gflops_on_the_shipped_deit_fashion(method: str) -> None:
    model = create_model("deit_fashion", pretrained=True, pool=method, keep="0.5x", carry=True).eval()
    assert model.token_pooling.keep == parse_keep("0.5x")
    assert model.token_pooling.schedule.gflops is None  # solved into per-block budgets
    torch.manual_seed(1)
    assert abs(_ratio(model, torch.randn(3, 1, 28, 28)) - 0.5) <= 0.02 * 0.5


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in list_methods() if m != "none"])
def test_half_the_gflops_on_a_timm_deit_small(method: str) -> None:
    torch.manual_seed(0)
    model = apply_token_pooling(create_timm_model("deit_small_patch16_224"), method=method, keep="0.5x")
    torch.manual_seed(1)
    assert abs(_ratio(model.eval(), torch.randn(1, 3, 224, 224)) - 0.5) <= 0.02 * 0.5


def test_the_run_time_setter_solves_and_a_refused_budget_changes_nothing() -> None:
    model = create_model("deit_fashion", pretrained=True, pool="tome", keep={"r": 7}, carry=True).eval()
    model.token_pooling.keep = "0.5x"
    assert model.token_pooling.r == 31  # the smallest r at 0.5x (docs: Coming from ToMe)
    torch.manual_seed(1)
    assert abs(_ratio(model, torch.randn(2, 1, 28, 28)) - 0.5) <= 0.01
    with pytest.raises(ValueError, match="out of reach"):
        model.token_pooling.keep = "0.1x"  # ToMe halves at most: 6 blocks cannot reach 0.1x
    assert model.token_pooling.keep == parse_keep("0.5x") and model.token_pooling.r == 31


def test_conv_is_refused_where_it_would_silently_do_nothing_or_miss_the_target() -> None:
    with pytest.raises(ValueError, match=r"conv cannot keep keep=0\.6 .* nearest budgets it reaches"):
        create_model("deit_fashion", pool="conv", keep=0.6)
    # Each layer keeps a quarter of the tokens: between two placements it names both.
    with pytest.raises(
        ValueError,
        match=r"^conv cannot spend 0\.6x .* the nearest budgets it reaches are 0\.5\d+x and 0\.6\d+x$",
    ):
        create_model("deit_fashion", pool="conv", keep="0.6x")


def test_conv_spends_a_gflops_budget_by_placing_its_layers() -> None:
    """One layer after a middle block, where a keep ratio's shape could only place a layer
    after every block or none; two layers where one alone steps over the target."""
    model = create_model("deit_fashion", pool="conv", keep="0.82x").eval()
    assert model.token_pooling.method == "conv"
    placed = [i for i in range(6) if model.token_pooling.reducer(i) is not None]
    assert len(placed) == 1 and 0 < placed[0] < 5
    torch.manual_seed(1)
    assert abs(_ratio(model, torch.randn(3, 1, 28, 28)) - 0.82) <= 0.02 * 0.82
    with pytest.raises(
        ValueError, match=r"conv at 0\.1x: out of reach, its cheapest placement costs 0\.1\d\dx"
    ):
        create_model("deit_fashion", pool="conv", keep="0.1x")
    model = create_model("deit_fashion", pool="conv", keep="0.8x").eval()
    assert [i for i in range(6) if model.token_pooling.reducer(i) is not None] == [4, 5]
    assert abs(_ratio(model, torch.randn(3, 1, 28, 28)) - 0.8) <= 0.02 * 0.8


def test_the_solver_refuses_a_target_between_two_steps_and_names_them() -> None:
    """Against a model whose cost steps: 1.0, 0.75, 0.5, 0.25 as the ratio falls."""

    def cost(candidate: KeepSchedule) -> float:
        assert candidate.blocks is not None
        return max(0.25, min(1.0, round(sum(candidate.blocks) / len(candidate.blocks) * 4) / 4))

    solved = solve_gflops(parse_keep("0.5x"), method="m", depth=3, num_tokens=16, cost=cost)
    assert solved.cost == 0.5 and solved.cost_above == 0.75
    with pytest.raises(
        ValueError, match=r"m cannot spend 0.6x .* nearest budgets it reaches are 0.5x and 0.75x"
    ):
        solve_gflops(parse_keep("0.6x"), method="m", depth=3, num_tokens=16, cost=cost)
    loose = solve_gflops(parse_keep("0.6x"), method="m", depth=3, num_tokens=16, cost=cost, tolerance=None)
    assert loose.cost == 0.5  # the sweep's rule: the cheapest point at most at the target


def test_bench_prints_the_solved_schedule_and_the_measured_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    from leanformer.cli import main

    bench = [
        "bench",
        "--model",
        "deit_fashion",
        "--pretrained",
        "--runs",
        "1",
        "--warmup",
        "0",
        "--no-memory",
    ]
    assert main([*bench, "--pool", "tome", "--keep", "0.5x"]) == 0
    out = capsys.readouterr().out
    assert "keep 0.5x solved as r" in out and "(patch tokens after each block: " in out
    ratio = float(out.split("the unpooled model's GFLOPs")[0].rsplit(": ", 1)[1].rstrip("x "))
    assert abs(ratio - 0.5) <= 0.01
    assert main([*bench, "--pool", "merge", "--keep", "0.5x", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert row["keep"] == "0.5x" and abs(row["gflops_ratio"] - 0.5) <= 0.01
    assert len(row["keep_schedule"].split(" (")[0].split(",")) == 6  # a ratio per block
    # The counts are the layers' own: conv's 2x2 windows round the 7x7 grid up to 4x4.
    assert main([*bench, "--pool", "conv", "--keep", "0.5x"]) == 0
    assert "(patch tokens after each block: 196,196,49,16,16,16)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pool", "conv", "--keep", "0.6"], "conv cannot keep keep=0.6 of the tokens"),
        (["--pool", "tome", "--keep", "0.4"], "tome removes at most half of a block's tokens"),
        (["--pool", "merge", "--keep", "2x"], r"in (0, 1]"),
    ],
)
def test_budgets_out_of_reach_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from leanformer.cli import main

    with pytest.raises(SystemExit) as exc_info:
        raise SystemExit(main(["bench", "--model", "deit_digits", "--runs", "1", "--warmup", "0", *argv]))
    assert exc_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_eval_and_tradeoff_take_a_gflops_fraction(capsys: pytest.CaptureFixture[str]) -> None:
    from leanformer.cli import main

    data = ["--data.name", "digits", "--data.limit_test", "16"]
    assert main(["eval", "--model", "deit_digits", "--pool", "merge", "--keep", "0.5x", *data, "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert row["n"] == 16
    from leanformer.apps.sweep_config import keep_value

    assert keep_value("0.5x") == keep_value("g0.5") == {"gflops": 0.5, "tilt": 0.0}
