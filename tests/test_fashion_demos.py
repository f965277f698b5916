"""The Perceiver, SReT and DRRT demos: the shipped Fashion-MNIST models when their weights
and the images are installed, else one line saying why and the digits path. Both paths
are reached by monkeypatching (random weights shipped to a temporary folder, fake
garments), so no data set or trained weights are needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leanformer import create_model
from leanformer.cli import main
from leanformer.commands import demo_drrt, demo_perceiver, demo_sret
from leanformer.data import build_dataset, fashion_mnist
from leanformer.models import pretrained
from test_fashion_mnist import write_fashion
from test_pretrained import ship

DEMOS = {"perceiver": demo_perceiver, "sret": demo_sret, "drrt": demo_drrt}
HINT = "apt-get install dataset-fashion-mnist"


@pytest.fixture
def no_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pretrained, "WEIGHTS_DIR", tmp_path / "no-weights")


@pytest.fixture
def garments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Fake Fashion-MNIST where the demos look for it."""
    folder = tmp_path / "fashion-mnist"
    write_fashion(folder, n_train=12, n_test=6, gz=False)
    monkeypatch.setattr(fashion_mnist, "default_roots", lambda: [folder])
    return folder


@pytest.fixture
def no_garments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fashion_mnist, "default_roots", lambda: [])


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Random weights shipped for every model of the three demos' Fashion-MNIST paths."""
    folder = tmp_path / "weights"
    for module in DEMOS.values():
        for name in module.DATA.models:
            torch.manual_seed(len(name))
            ship(folder, name, create_model(name))
    monkeypatch.setattr(pretrained, "WEIGHTS_DIR", folder)
    return folder


def record_digits_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace each demo's digits path (which trains) by a recorder."""
    ran: list[str] = []
    for demo, module in DEMOS.items():
        monkeypatch.setattr(module, "run_digits", lambda args, demo=demo: ran.append(demo) or [])
    return ran


@pytest.mark.parametrize("demo", list(DEMOS))
def test_without_weights_or_images_one_line_then_digits(
    demo: str, no_weights, no_garments, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran = record_digits_runs(monkeypatch)
    assert main(["demo", demo]) == 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert ran == [demo]
    assert line.startswith(f"leanformer demo {demo}: this install ships no weights for ")
    assert all(name in line for name in DEMOS[demo].DATA.models)
    assert HINT in line and line.endswith(f"running the {DEMOS[demo].DATA.digits} demo")


@pytest.mark.parametrize("demo", list(DEMOS))
def test_images_without_weights_say_so_without_the_install_hint(
    demo: str, no_weights, garments, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran = record_digits_runs(monkeypatch)
    assert main(["demo", demo]) == 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert ran == [demo] and "ships no weights" in line and HINT not in line


@pytest.mark.parametrize("demo", list(DEMOS))
def test_weights_without_images_give_the_install_hint(
    demo: str, shipped, no_garments, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran = record_digits_runs(monkeypatch)
    assert main(["demo", demo]) == 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert ran == [demo] and "ships no weights" not in line
    assert (
        line.startswith(f"leanformer demo {demo}: Fashion-MNIST is not installed (to get it: ")
        and HINT in line
    )


@pytest.mark.parametrize("demo", list(DEMOS))
def test_asking_for_fashion_without_weights_is_refused_in_one_line(
    demo: str, no_weights, garments, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", demo, "--data", DEMOS[demo].DATA.fashion]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "ships no weights for" in line and f"--data {DEMOS[demo].DATA.digits}" in line


@pytest.mark.parametrize("demo", list(DEMOS))
def test_digits_training_options_are_refused_on_the_fashion_path(
    demo: str, shipped, garments, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["demo", demo, "--epochs", "3", "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--epochs set(s) the" in line and "trains nothing" in line
    assert not out.exists()  # refused before anything was written


def reference_top1(model: torch.nn.Module, dataset) -> float:
    """Top-1 % by a plain loop over the examples, one at a time."""
    model.eval()
    right = 0
    with torch.no_grad():
        for i in range(len(dataset)):
            inputs, target = dataset[i]
            inputs = inputs if isinstance(inputs, tuple) else (inputs,)
            right += int(model(*(x[None] for x in inputs)).argmax(1).item() == int(target))
    return 100.0 * right / len(dataset)


def json_rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_perceiver_demo_runs_the_shipped_model(
    shipped, garments, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "perceiver", "--out", str(tmp_path / "out"), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == ""  # nothing to explain: the Fashion-MNIST path
    rows = json_rows(captured.out)
    by_k = {r["k"]: r["top1_query_masking"] for r in rows if r["table"] == "accuracy_by_k"}
    assert sorted(by_k) == [1, 2, 4, 8, 16, 32, 64]
    assert {r["threshold"] for r in rows if r["table"] == "dqs"} == {0.6, 0.7, 0.8, 0.9, 0.95, 0.99}
    model = create_model("perceiver_fashion", pretrained=True)
    assert by_k[64] == pytest.approx(reference_top1(model, build_dataset("fashion_mnist", split="test")))
    assert (tmp_path / "out" / "results.jsonl").is_file()


def test_sret_demo_runs_the_shipped_models(
    shipped, garments, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from leanformer.bench import report

    # The table's speed columns are measured by bench_model; no test measures speed.
    monkeypatch.setattr(
        report,
        "trained_model_row",
        lambda model, top1, device="cpu": {
            "top1": top1,
            "params_m": 0.0,
            "gflops": 0.0,
            "img_per_s": 0.0,
            "threads": 1,
        },
    )
    assert main(["demo", "sret", "--out", str(tmp_path / "out"), "--json"]) == 0
    rows = json_rows(capsys.readouterr().out)
    assert [r["model"] for r in rows] == ["sret_fashion", "sret_fashion_unsliced", "deit_fashion"]
    test = build_dataset("fashion_mnist", split="test")
    for row in rows:
        assert row["dataset"] == "fashion_mnist" and row["weights"] == "shipped"
        expected = reference_top1(create_model(row["model"], pretrained=True), test)
        assert row["top1"] == pytest.approx(expected), row["model"]


def test_drrt_demo_runs_the_shipped_models(
    shipped, garments, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["demo", "drrt", "--out", str(out), "--limit-test", "5", "--json"]) == 0
    rows = json_rows(capsys.readouterr().out)
    assert [(r["model"], r["recurrence"]) for r in rows] == [("drrt_fashion", "yes"), ("drt_fashion", "no")]
    test = torch.utils.data.Subset(build_dataset("fashion_pairs", split="test"), range(5))
    for row in rows:
        model = create_model(row["model"], pretrained=True)
        assert row["params"] == sum(p.numel() for p in model.parameters())
        assert row["top1"] == pytest.approx(reference_top1(model, test)), row["model"]
    assert "train s" not in (out / "table.md").read_text()  # nothing was trained
