"""Trade-off harness, its CLI/demo configuration and the cluster-map trace."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import timm
import torch
import yaml

from leanformer.apps import cluster_maps
from leanformer.apps.cluster_maps import patch_assignment, trace_token_sources
from leanformer.apps.sweep_config import (
    budget_label,
    keep_value,
    load_sweep_config,
    method_options,
    sweep_config_from_dict,
    sweep_points,
)
from leanformer.apps.tradeoff import add_relative, markdown_table, run_sweep, summarise_seeds, with_method
from leanformer.commands import demo_tokenpool, tradeoff, visualize_clusters
from leanformer.engine.builders import build_split
from leanformer.engine.evaluate import evaluate
from leanformer.models.registry import create_model
from leanformer.pooling.budgets import budget_to_count
from sweep_models import untrained_deit_test

REPO = Path(__file__).resolve().parents[1]
DATA = {"name": "digits", "img_size": 16, "limit_test": 48, "eval_batch_size": 48, "batch_size": 16}


def test_config_validation() -> None:
    ok = {"model": "deit_test", "methods": ["wkmedoids"], "budgets": [0.5]}
    assert sweep_config_from_dict(ok).methods == ["wkmedoids"]
    with pytest.raises(ValueError, match="exactly one of checkpoint"):
        sweep_config_from_dict({**ok, "timm_model": "vit_tiny_patch16_224"})
    with pytest.raises(
        ValueError, match="methods: unknown pooling method 'wkmedoid'; did you mean wkmedoids"
    ):
        sweep_config_from_dict({**ok, "methods": ["wkmedoid"]})
    with pytest.raises(ValueError, match="budgets: is empty"):
        sweep_config_from_dict({**ok, "budgets": []})
    for empty in ([], ","):  # (a blank "methods:" is YAML null: every method)
        with pytest.raises(ValueError, match="methods: is empty; name the methods"):
            sweep_config_from_dict({**ok, "methods": empty})
    assert sweep_config_from_dict({**ok, "methods": ["none"]}).methods == ["none"]  # the baseline alone
    # One label per point: a repeated budget, or two that print alike, would be measured
    # twice and shown as seeds of one point.
    for twins in ([0.5, 0.5], [{"gflops": 0.5}, {"gflops": 0.5, "tilt": 0}], [0.1234561, 0.1234562]):
        with pytest.raises(ValueError, match=r"budgets: .* are both the point .*; give each budget once"):
            sweep_config_from_dict({**ok, "budgets": twins})
    # The command line's spelling of a GFLOPs budget reads the same in a sweep file.
    assert sweep_config_from_dict({**ok, "budgets": ["g0.5", "g0.36t-1.2"]}).budgets == [
        keep_value("g0.5"),
        keep_value("g0.36t-1.2"),
    ]
    assert budget_label(keep_value("g0.36t-1.2")) == "g0.36t-1.2"
    with pytest.raises(ValueError, match=r"budgets: GFLOPs budget 'g0\.5x': expected g<fraction>"):
        sweep_config_from_dict({**ok, "budgets": ["g0.5x"]})
    for half_written in ("g", "gabc", "gnan"):
        with pytest.raises(ValueError, match=r"unknown keep preset .*a GFLOPs budget is written g<fraction>"):
            keep_value(half_written)
    with pytest.raises(ValueError, match="unknown config key 'budget'"):
        sweep_config_from_dict({**ok, "budget": [0.5]})
    with pytest.raises(ValueError, match="pool_options max_iter are not options"):
        sweep_config_from_dict({**ok, "pool_options": {"max_iter": 3}})
    cfg = sweep_config_from_dict({**ok, "methods": ["kmeans", "merge"], "pool_options": {"max_iters": 3}})
    assert method_options(cfg, "kmeans") == {"max_iters": 3} and method_options(cfg, "merge") == {}
    with pytest.raises(ValueError, match="train: only applies to model"):
        sweep_config_from_dict({"checkpoint": "x.safetensors", "budgets": [0.5], "train": {"seed": 1}})
    with pytest.raises(ValueError, match="timm_options: only applies to timm_model"):
        sweep_config_from_dict({**ok, "timm_options": {"drop_rate": 0.5}})


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", "", "a\\b"])
def test_sweep_name_is_a_plain_folder_name(name: str) -> None:
    """``name:`` becomes runs/<name>: ``../x`` used to write the results outside runs/."""
    ok = {"model": "deit_test", "methods": ["wkmedoids"], "budgets": [0.5]}
    with pytest.raises(ValueError, match="must be a plain folder name"):
        sweep_config_from_dict({**ok, "name": name})
    assert sweep_config_from_dict({**ok, "name": "my_sweep.v2"}).name == "my_sweep.v2"


def test_points_and_labels() -> None:
    cfg = sweep_config_from_dict(
        {
            "model": "deit_test",
            "methods": "merge,none,powerbert",
            "budgets": ["a_preset", 0.5, [4, 2, 1]],
        }
    )
    points = sweep_points(cfg)
    assert points[0] == ("none", None, None) and len(points) == 1 + 2 * 3
    assert [budget_label(k) for _, k, _ in points[1:4]] == ["a_preset", "r0.5", "4-2-1"]
    # Random methods run once per seed; deterministic ones once.
    seeded = sweep_points(
        sweep_config_from_dict(
            {"model": "deit_test", "methods": "merge,random", "budgets": [0.5], "seeds": 3}
        )
    )
    assert seeded == [("none", None, None), ("merge", 0.5, None)] + [("random", 0.5, s) for s in range(3)]


@pytest.mark.parametrize(
    ("keep", "label"),
    [
        ("deit_s_level3", "deit_s_level3"),
        ("r16", "r16"),  # a string names the point as written in the sweep file
        (0.97, "r0.97"),
        (1.0, "r1"),
        ([64, 56, 48], "64-56-48"),
        ([0.5, 1.0], "0.5-1"),
        ({"r": 7}, "7/block"),
        (5, "5"),  # not a budget: named as given in its own error message
    ],
)
def test_budget_labels_name_the_points_as_before(keep: object, label: str) -> None:
    """results.jsonl, table.md and combined sweeps are keyed by these names."""
    assert budget_label(keep) == label


def test_seed_summary_averages_random_methods_and_keeps_the_spread() -> None:
    rows = [
        {"method": "none", "keep": "all", "top1": 90.0, "gflops": 1.0},
        *(
            {"method": "random", "keep": "r0.5", "top1": t, "gflops": 0.5, "seed": s}
            for s, t in enumerate((70.0, 72.0, 74.0))
        ),
    ]
    summary = summarise_seeds(rows)
    assert [r["method"] for r in summary] == ["none", "random"]
    assert summary[1]["top1"] == 72.0 and summary[1]["top1_std"] == 2.0 and summary[1]["seeds"] == 3
    assert "72.00 ± 2.00 (3 seeds)" in markdown_table(summary)


def test_with_method_copies_and_full_budget_is_identity() -> None:
    base = untrained_deit_test()
    x = torch.randn(3, 1, 16, 16)
    with torch.no_grad():
        ref = base(x)
        full = with_method(base, "wkmedoids", [16, 16, 16], carry=True, options={})
        pooled = with_method(base, "wkmedoids", [8, 4, 2], carry=True, options={"max_iters": 3})
        torch.testing.assert_close(full(x), ref, atol=1e-5, rtol=1e-5)
        assert pooled.forward_features(x).shape[1] == 1 + 2
        assert base.forward_features(x).shape[1] == 1 + 16  # the base is untouched
    assert not hasattr(base, "token_pooling")


def test_with_method_on_timm_model_leaves_base_unpatched() -> None:
    base = timm.create_model(
        "deit_tiny_patch16_224", pretrained=False, depth=2, img_size=32, patch_size=8
    ).eval()
    variant = with_method(base, "merge", 0.5, carry=True, options={})
    with torch.no_grad():
        assert variant.forward_features(torch.randn(1, 3, 32, 32)).shape[1] == 1 + 4
    assert not hasattr(base, "token_pooling") and hasattr(variant, "token_pooling")


def test_relative_columns_and_table() -> None:
    rows = [
        {"method": "none", "keep": "all", "top1": 90.0, "gflops": 2.0, "img_per_s": 100.0},
        {
            "method": "merge",
            "keep": "r0.5",
            "top1": 85.0,
            "gflops": 1.0,
            "img_per_s": 180.0,
            "finetuned": True,
        },
    ]
    add_relative(rows)
    assert rows[1]["d_top1"] == -5.0 and rows[1]["flops_ratio"] == 2.0 and rows[1]["speedup"] == 1.8
    table = markdown_table(rows).splitlines()
    assert len(table) == 4 and table[3].startswith(
        "| merge (ft) | r0.5 | 85.00 | -5.00 | 1.000 | 2.00 | 180 | 1.80 |"
    )


def test_run_sweep_writes_results_consistent_with_evaluate(tmp_path: Path) -> None:
    cfg = sweep_config_from_dict(
        {
            "model": "deit_test",
            "data": DATA,
            "methods": ["wkmedoids", "powerbert"],
            "budgets": [0.5, [12, 6, 3]],
            "throughput_runs": 1,
            "throughput_warmup": 0,
            "throughput_batch_size": 4,
        }
    )
    base = untrained_deit_test()
    result = run_sweep(cfg, out_dir=tmp_path, progress=False, base=base)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["method"], r["keep"]) for r in rows] == [
        ("none", "all"),
        ("wkmedoids", "r0.5"),
        ("wkmedoids", "12-6-3"),
        ("powerbert", "r0.5"),
        ("powerbert", "12-6-3"),
    ]
    assert (tmp_path / "tradeoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "table.md").read_text().count("\n| ") == 1 + len(rows)  # header + rows
    loader = torch.utils.data.DataLoader(build_split(cfg.data, "test"), batch_size=48)
    direct = evaluate(with_method(base, "powerbert", [12, 6, 3], carry=True, options={}), loader)
    assert result.rows[4]["top1"] == pytest.approx(direct["top1"])
    assert result.rows[0]["d_top1"] == 0.0 and result.rows[0]["speedup"] == 1.0
    # fewer tokens -> fewer GFLOPs, and the token count at the end follows the budget
    assert result.rows[2]["gflops"] < result.rows[0]["gflops"] and result.rows[2]["tokens_out"] == 1 + 3


def test_finetune_changes_weights(tmp_path: Path) -> None:
    cfg = sweep_config_from_dict(
        {
            "model": "deit_test",
            "data": {**DATA, "limit_train": 32},
            "methods": ["merge"],
            "budgets": [0.5],
            "finetune_epochs": 1,
            "finetune_lr": 1e-2,
            "throughput": False,
        }
    )
    base = untrained_deit_test()
    before = base.head.weight.clone()
    result = run_sweep(cfg, out_dir=None, progress=False, base=base)
    assert result.rows[1]["finetuned"] and not result.rows[0]["finetuned"]
    torch.testing.assert_close(base.head.weight, before)  # variants are copies


def test_demo_preset_file_matches_demo() -> None:
    preset = yaml.safe_load((REPO / "configs" / "tradeoff_digits.yaml").read_text())
    assert preset == demo_tokenpool.DIGITS_SWEEP
    sweep_config_from_dict(preset)  # valid
    # The Fashion-MNIST demo is the tradeoff_fashion preset on a 2,000-image subset.
    fashion = yaml.safe_load((REPO / "configs" / "tradeoff_fashion.yaml").read_text())
    demo = demo_tokenpool.FASHION_SWEEP
    # The demo's budgets go down to 0.35x of the GFLOPs, which tome (at most half a block's
    # tokens per block, 6 blocks) cannot reach: its rows there are the tome_r ones.
    assert demo["model"] == fashion["model"]
    assert demo["methods"] == [m for m in fashion["methods"] if m != "tome"]
    assert demo["tome_r"] == fashion["tome_r"] and demo["data"]["limit_test"] == 2000
    # ... at GFLOPs budgets, so its columns and its ranking compare methods at equal cost
    assert demo["budgets"] == [{"gflops": g} for g in (0.9, 0.7, 0.5, 0.35)]
    sweep_config_from_dict(demo)  # valid


def _row(method: str, keep_value: object, top1: float) -> dict[str, object]:
    return {"method": method, "keep_value": keep_value, "top1": top1}


def test_demo_ranks_methods_only_at_equal_gflops() -> None:
    rows = [
        _row("none", None, 90.0),
        _row("merge", {"gflops": 0.5, "tilt": 0.0}, 87.0),
        _row("merge", {"gflops": 0.35, "tilt": 0.0}, 85.0),
        _row("kmeans", {"gflops": 0.5, "tilt": 0.0}, 86.0),
        _row("kmeans", {"gflops": 0.35, "tilt": 0.0}, 84.5),
        _row("tome", {"r": 31}, 99.0),  # ToMe's own form is not at a GFLOPs budget
    ]
    line = demo_tokenpool._ranking_line(rows)
    assert line == (
        "mean top-1 at equal GFLOPs (0.5x, 0.35x of the unpooled model's): merge 86.00, kmeans 85.25"
    )
    # keep ratios cost each method differently: no ranking, and the line says why
    ratio_rows = [_row("merge", 0.8, 87.0), _row("kmeans", 0.8, 88.0)]
    assert "compare the methods along the GFLOPs axis" in demo_tokenpool._ranking_line(ratio_rows)


def test_tradeoff_unknown_preset() -> None:
    with pytest.raises(ValueError, match="unknown sweep preset 'nope'"):
        tradeoff.find_preset("nope")


def _finite_difference_members(
    reducer: torch.nn.Module, x: torch.Tensor, received: torch.Tensor
) -> torch.Tensor:
    """Slow reference: patch n belongs to token k iff nudging n moves k."""
    B, N, _ = x.shape
    out = reducer(x, None, received)[0]
    members = torch.zeros(B, out.shape[1], N, dtype=torch.bool)
    for n in range(N):
        x2 = x.clone()
        x2[:, n, 0] += 1e-3
        members[:, :, n] = (reducer(x2, None, received)[0] - out).abs().sum(-1) > 0
    return members


@pytest.mark.parametrize("method", ["wkmedoids", "kmeans", "powerbert", "merge"])
def test_trace_matches_finite_differences(method: str) -> None:
    from leanformer.pooling.registry import build_reducers

    torch.manual_seed(0)
    model = with_method(untrained_deit_test(), method, [9, 4, 2], carry=False, options={})
    x = torch.randn(2, 1, 16, 16)
    trace = trace_token_sources(model, x)
    assert all(type(r).__name__ != "_SourceProbe" for r in model.token_pooling.reducers.values())
    # The first pooling layer sees the patch tokens directly: compare with the reference.
    reducer = build_reducers(method=method, keep=[9], depth=1, num_tokens=16, dim=32, grid_size=(4, 4))[0]
    tokens, received = torch.randn(2, 16, 32, dtype=torch.float64), torch.rand(2, 16, dtype=torch.float64)
    probe_trace: list = [None]
    probe = cluster_maps._SourceProbe(reducer, probe_trace, 0)
    probe(tokens, None, received)
    torch.testing.assert_close(probe_trace[0] > 0, _finite_difference_members(reducer, tokens, received))
    # Through the model: every token after the last block stands for >= 1 patch.
    assign = patch_assignment(trace, 2, 16, 2)
    for b in range(2):
        kept = assign[b][assign[b] >= 0]
        assert sorted(kept.unique().tolist()) == [0, 1]
        if method in ("wkmedoids", "kmeans", "merge"):
            assert (assign[b] >= 0).all()  # clustering and merging never drop a patch


def test_trace_on_timm_model_restores_reducers() -> None:
    base = timm.create_model("deit_tiny_patch16_224", pretrained=False, depth=3, img_size=32, patch_size=8)
    model = with_method(base.eval(), "kmedoids", [16, 8, 4], carry=True, options={})
    before = dict(model.token_pooling.reducers.items())
    assert sorted(before) == ["1", "2"]  # block 0 keeps every token: no reducer
    trace = trace_token_sources(model, torch.randn(2, 3, 32, 32))
    assert trace[0] is None and trace[1].shape == (2, 8, 16) and trace[2].shape == (2, 4, 16)
    assert dict(model.token_pooling.reducers.items()) == before
    # each patch sits in exactly one final token (clustering composes memberships)
    assert ((trace[2] > 0).sum(1) == 1).all()


@pytest.mark.parametrize("keep", [0.6, 0.75])  # the full entry step, and one that fades in
def test_trace_composes_both_steps_of_entrymerges_first_block(keep: float) -> None:
    """The trace (Jacobians) and the reducer's own record (merge plans composed) agree on
    where every patch went through the entry step and the first block's merge."""
    torch.manual_seed(0)
    base = create_model("deit_test", img_size=32).eval()
    model = with_method(base, "entrymerge", keep, carry=True, options={})
    x = torch.randn(2, 3, 32, 32)
    reducer = model.token_pooling.reducer(0)
    reducer.record = True
    with torch.no_grad():
        model(x)
    recorded = reducer.last_assign.clone()
    reducer.record = False
    trace = trace_token_sources(model, x)
    entry = model.token_pooling.entry_count(64)
    assert entry < 64  # the entry step ran
    assert torch.equal(patch_assignment(trace, 0, 64, 2), recorded)
    assert int(recorded.max()) + 1 == budget_to_count(keep, entry) < entry


def test_visualize_command_writes_pngs(tmp_path: Path) -> None:
    args = argparse.Namespace(
        checkpoint=None,
        model="deit_test",
        pretrained=False,
        timm_model=None,
        method="kmedoids",
        keep=0.5,
        layer=1,
        no_carry=False,
        data="digits",
        data_root=None,
        img_size=None,
        num_examples=2,
        out=str(tmp_path),
        device="cpu",
        seed=0,
        json=True,
        quiet=True,
    )
    rows = visualize_clusters.run(args)
    assert [r["tokens"] for r in rows] == [16, 16]  # 64 patches at 32x32 -> 32 -> 16
    assert all(Path(r["png"]).read_bytes()[:4] == b"\x89PNG" for r in rows)
    with pytest.raises(ValueError, match="--layer must be in"):
        visualize_clusters.run(argparse.Namespace(**{**vars(args), "layer": 7}))
    sized = visualize_clusters.run(argparse.Namespace(**{**vars(args), "img_size": 48, "num_examples": 1}))
    assert sized[0]["tokens"] == 36  # 144 patches at 48x48 -> 72 -> 36


def test_visualize_timm_model_uses_its_input_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from leanformer.cli import main

    argv = ["visualize", "clusters", "--timm-model", "vit_tiny_patch16_224", "--method", "merge"]
    argv += ["--keep", "0.5", "--layer", "0", "--num-examples", "1", "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["tokens"] == 98  # digits resized to 224: 14 x 14 = 196 patches, halved once
    assert main(["visualize", "clusters", "--timm-model", "vit_tiny_patch16_22"]) == 2
    assert "did you mean vit_tiny_patch16_224" in capsys.readouterr().err


def test_registry_models_take_pooling() -> None:
    # the harness relies on the DeiT family building its reducers from pool/keep/carry
    model = create_model("deit_test", pool="merge", keep=0.5, carry=True)
    assert len(model.token_pooling.reducers) == 3


def test_demo_falls_back_to_digits_with_a_one_line_hint(monkeypatch, capsys) -> None:
    from leanformer.data import fashion_mnist
    from leanformer.models import pretrained

    monkeypatch.setattr(pretrained, "shipped_models", lambda: ["deit_fashion"])
    monkeypatch.setattr(fashion_mnist, "default_roots", lambda: [])
    assert demo_tokenpool.choose_data("auto") == "digits"
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "apt-get install dataset-fashion-mnist" in out[0]
    assert demo_tokenpool.choose_data("fashion_mnist") == "fashion_mnist"
    monkeypatch.setattr(fashion_mnist, "default_roots", lambda: [fashion_mnist.DEBIAN_DIR])
    monkeypatch.setattr(fashion_mnist, "is_available", lambda root=None: True)
    assert demo_tokenpool.choose_data("auto") == "fashion_mnist"


# Base-GFLOPs fractions the tradeoff_fashion budgets are chosen to land on (pruning, which
# adds no FLOPs of its own; the other methods add their planning cost on top).
FASHION_TARGETS = {0.97: 0.9, 0.9: 0.7, 0.8: 0.5, 0.68: 0.35, 0.62: 0.3, 0.5: 0.23}
FASHION_TOME_TARGETS = {7: 0.9, 19: 0.7, 31: 0.5}


def test_fashion_preset_budgets_land_on_their_gflops() -> None:
    from leanformer.bench.flops import count_gflops

    preset = yaml.safe_load((REPO / "configs" / "tradeoff_fashion.yaml").read_text())
    assert sorted(preset["budgets"]) == sorted(FASHION_TARGETS)
    assert sorted(preset["tome_r"]) == sorted(FASHION_TOME_TARGETS)
    x = torch.randn(1, 1, 28, 28)
    base = count_gflops(create_model(preset["model"]), (x,))
    for ratio, target in FASHION_TARGETS.items():
        model = create_model(preset["model"], pool="powerbert", keep=ratio, carry=True)
        assert count_gflops(model, (x,)) / base == pytest.approx(target, rel=0.05), ratio
    for r, target in FASHION_TOME_TARGETS.items():
        model = create_model(preset["model"], pool="tome", keep={"r": r}, carry=True)
        assert count_gflops(model, (x,)) / base == pytest.approx(target, rel=0.05), r


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("tradeoff_*.yaml")), ids=lambda p: p.stem)
def test_every_sweep_preset_is_valid_and_named_after_its_file(path: Path) -> None:
    assert load_sweep_config(path).name == path.stem


def test_the_trace_of_the_unpooled_model_keeps_every_patch() -> None:
    """``visualize clusters --method none`` draws the unpooled patches."""
    model = with_method(create_model("deit_test", img_size=32).eval(), "none", None, carry=True, options={})
    trace = trace_token_sources(model, torch.randn(2, 3, 32, 32))
    assert trace == [None, None, None]
    assert torch.equal(patch_assignment(trace, 2, 64, 2), torch.arange(64).expand(2, 64))
