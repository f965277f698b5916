"""Perceiver evaluation tables, attention maps and the CLI commands on a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from leanformer import create_model
from leanformer.apps.attention_maps import average_cross_attention, save_attention_grid
from leanformer.apps.perceiver_eval import (
    accuracy_by_k,
    check_ks,
    cost_by_k,
    dqs_sweep,
    dqs_timing,
    markdown_table,
    plot_perceiver,
    random_subset_accuracy,
)
from leanformer.engine.evaluate import evaluate


def _setup() -> tuple[torch.nn.Module, DataLoader]:
    torch.manual_seed(0)
    model = create_model("visual_perceiver_test").eval()
    with torch.no_grad():
        model.queries.normal_()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(10, 3, 16, 16, generator=g), torch.randint(0, 5, (10,), generator=g))
    return model, DataLoader(data, batch_size=4)


def test_accuracy_and_random_baseline() -> None:
    model, loader = _setup()
    rows = accuracy_by_k(model, loader, [8, 2, 100])  # 100 > Q is skipped, order normalised
    assert [r["k"] for r in rows] == [2, 8]
    assert rows[1]["top1"] == evaluate(model, loader)["top1"]
    base = random_subset_accuracy(model, loader, [8, 3], reps=3)
    full = base[-1]  # all 8 queries in any order: the same model, zero spread
    assert full["top1_mean"] == rows[1]["top1"] and full["top1_std"] == 0.0
    assert len(base[0]["top1_reps"]) == 3
    with pytest.raises(ValueError, match="exceeds"):
        check_ks(model, [9, 20])
    with pytest.raises(ValueError, match="reps"):
        random_subset_accuracy(model, loader, [2], reps=0)


def test_dqs_sweep_and_timing() -> None:
    model, loader = _setup()
    rows = dqs_sweep(
        model, loader, [-1.0, 1.0]
    )  # the extremes of the cosine: only the first query, all of them
    assert rows[0]["kept_mean"] == 1.0 and rows[0]["kept_max"] == 1
    assert rows[1]["kept_mean"] == 8.0 and rows[1]["top1"] == evaluate(model, loader)["top1"]
    batch = torch.randn(4, 3, 16, 16)
    timing = dqs_timing(model, batch, 0.5, warmup=0, runs=1)
    assert 1 <= timing["kept_mean"] <= 8 and timing["ms_select"] > 0
    model(batch, dqs_threshold=0.5)
    counts = model.last_kept_counts.tolist()
    assert (timing["kept_min"], timing["kept_max"]) == (min(counts), max(counts))
    fixed_work = len(counts) * timing["k_fixed"] ** 2
    assert timing["attention_work"] == pytest.approx(sum(n * n for n in counts) / fixed_work)
    # Padded work: each input pays its bucket's longest count, so never less than unpadded.
    assert timing["attention_work_padded"] >= timing["attention_work"]


def test_cost_table_and_plot(tmp_path: Path) -> None:
    model, loader = _setup()
    cost = cost_by_k(model, [1, 8], batch=torch.randn(2, 3, 16, 16), warmup=0, runs=1)
    assert cost[0]["gflops"] < cost[1]["gflops"] and cost[1]["rel_time"] == 1.0
    # Relative to all Q = 8 queries even when K = 8 is not asked for (not to the largest K).
    partial = cost_by_k(model, [1, 2], batch=torch.randn(2, 3, 16, 16), warmup=0, runs=1)
    assert [row["k"] for row in partial] == [1, 2] and partial[1]["rel_time"] != 1.0
    acc = accuracy_by_k(model, loader, [1, 8])
    text = markdown_table(acc, [("k", "K"), ("top1", "top-1 %")])
    assert text.splitlines()[0] == "| K | top-1 % |" and len(text.splitlines()) == 4
    base = random_subset_accuracy(model, loader, [1, 8], reps=2)
    dqs = dqs_sweep(model, loader, [0.5])
    path = plot_perceiver({"first K": acc}, tmp_path / "p.png", cost=cost, baseline=base, dqs=dqs)
    assert path.stat().st_size > 0


def test_attention_maps(tmp_path: Path) -> None:
    model, loader = _setup()
    maps = average_cross_attention(model, loader, num_queries=5)
    assert maps.shape == (5, 4, 4)
    torch.testing.assert_close(maps.sum(dim=(1, 2)), torch.ones(5))
    x = torch.cat([b for b, _ in loader])
    torch.testing.assert_close(maps, model.cross_attention_maps(x, num_queries=5).mean(0))
    assert save_attention_grid(maps, tmp_path / "a.png", title="t").stat().st_size > 0
    with pytest.raises(ValueError, match=r"\[K, h, w\]"):
        save_attention_grid(maps[0], tmp_path / "b.png")
    with pytest.raises(ValueError, match="cross_attention_maps"):
        average_cross_attention(create_model("deit_test"), loader)


def test_the_command_reads_ema_weights_and_a_validation_split(tmp_path: Path, capsys) -> None:
    """``--ema`` scores the EMA a run kept (the same top-1 at K=Q as `eval --ema`), and
    ``--split val`` the images ``--data.options.validation`` holds out (``--limit`` of them)."""
    import json

    from leanformer.cli import main

    run = tmp_path / "run"
    data = ["--data", "digits", "--img-size", "16"]
    train = ["train", "--model", "visual_perceiver_test", *data, "--epochs", "1", "--train.ema", "true"]
    assert main([*train, "--data.limit_train", "64", "--out", str(run), "--quiet"]) == 0
    table = ["perceiver-eval", "--ks", "8", "--reps", "0", "--time-batch", "0", "--thresholds", "0.9"]
    table += ["--json", "--overwrite", "--out", str(tmp_path / "pe")]
    capsys.readouterr()
    for ema in (False, True):
        flags = ["--ema"] if ema else []
        assert main([*table, "--checkpoint", str(run), *flags]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
        by_k = next(row for row in rows if row.get("table") == "by_k" and row["k"] == 8)
        assert main(["eval", "--checkpoint", str(run), *flags, "--json", "--quiet"]) == 0
        assert by_k["top1"] == pytest.approx(json.loads(capsys.readouterr().out.splitlines()[-1])["top1"])
    from leanformer.data.fashion_mnist import is_available

    if not is_available():
        return  # the validation split below is Fashion-MNIST's
    val = [
        "--model",
        "visual_perceiver_test",
        "--data",
        "fashion_mnist",
        "--split",
        "val",
        "--img-size",
        "16",
    ]
    assert main([*table, *val, "--data.options.validation", "500", "--limit", "20"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [row["k"] for row in rows if row.get("table") == "by_k"] == [8]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--model", "visual_perceiver_test", "--ema"],
            "--ema evaluates the EMA weights a training run kept",
        ),
        (["--pretrained"], "--pretrained loads the shipped weights of --model NAME"),
        (["--model", "visual_perceiver_test", "--optim.lr", "1"], "takes data overrides only"),
    ],
)
def test_the_command_refuses_flags_without_their_weights(argv: list[str], message: str, capsys) -> None:
    from leanformer.cli import main

    assert main(["perceiver-eval", *argv, "--data", "digits", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
