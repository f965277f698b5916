"""Training and scoring a semantic segmenter: ``leanformer train`` on label maps, the epoch's
mIoU against a per-image reference, ``leanformer eval`` and a trade-off sweep with
``task: segmentation`` (every reducer unpools), and the options that cannot apply refused.

Fake garments (tests/test_fashion_detect.py), 64-pixel canvases, ``segvit_test``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from leanformer.apps.sweep_config import sweep_config_from_dict
from leanformer.apps.tradeoff import markdown_table, run_sweep
from leanformer.config import RunConfig, load_config
from leanformer.engine.builders import build_split
from leanformer.engine.checkpoint import load_model
from leanformer.engine.segmentation_eval import SegmentationScores
from leanformer.engine.train import fit
from test_fashion_detect import write_fake_fashion

DATA = {
    "name": "fashion_detect",
    "img_size": 64,
    "batch_size": 4,
    "eval_batch_size": 3,
    "options": {"target": "semantic", "num_canvases": 7},
}


def _config(root: Path, **overrides: Any) -> RunConfig:
    base = {
        "model": "segvit_test",
        "data.name": "fashion_detect",
        "data.root": str(root),
        "data.img_size": 64,
        "data.batch_size": 4,
        "data.eval_batch_size": 3,
        "data.options.target": "semantic",
        "data.options.num_canvases": 7,
        "optim.epochs": 1,
        "optim.lr": 0.003,
    }
    return load_config(None, {**base, **overrides})


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, float]]:
    root = tmp_path_factory.mktemp("data")
    write_fake_fashion(root)
    out = tmp_path_factory.mktemp("run") / "run"
    result = fit(_config(root, **{"optim.epochs": 2}), out_dir=out, progress=False)
    return root, out, result.metrics


def test_an_epoch_scores_miou_as_a_per_image_count_does(trained: tuple[Path, Path, dict[str, float]]) -> None:
    root, out, metrics = trained
    assert {"miou", "pixel_accuracy", "test_loss", "train_loss"} <= set(metrics)
    model = load_model(out / "last.safetensors").eval()
    test = build_split(_config(root).data, "test", evaluation=True)
    scores, loss, pixels = SegmentationScores(11), 0.0, 0
    with torch.no_grad():
        for i in range(len(test)):  # one image at a time: another path than the batched one
            image, target = test[i]
            logits = model(image[None])
            assert logits.shape == (1, 11, 64, 64)
            scores.update(logits, target[None])
            loss += float(F.cross_entropy(logits, target[None], reduction="sum"))
            pixels += target.numel()
    assert metrics["miou"] == pytest.approx(scores.mean_iou(), abs=1e-6)
    assert metrics["pixel_accuracy"] == pytest.approx(scores.pixel_accuracy(), abs=1e-6)
    assert metrics["test_loss"] == pytest.approx(loss / pixels, rel=1e-4)


def test_eval_prints_the_miou_of_the_run(
    trained: tuple[Path, Path, dict[str, float]], capsys: pytest.CaptureFixture[str]
) -> None:
    from leanformer.cli import main

    root, out, metrics = trained
    assert main(["eval", "--checkpoint", str(out), "--json", "--data-root", str(root)]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["miou"] == pytest.approx(metrics["miou"], abs=1e-6) and row["n"] == 7
    assert main(["eval", "--checkpoint", str(out), "--data-root", str(root), "--quiet"]) == 0
    assert f"mIoU {metrics['miou']:.2f}%" in capsys.readouterr().out
    # Pooled, the segmenter unpools and still scores every pixel.
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(out),
                "--json",
                "--data-root",
                str(root),
                "--pool",
                "powerbert",
                "--keep",
                "0.5",
            ]
        )
        == 0
    )
    (pooled,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert 0 <= pooled["miou"] <= 100 and pooled["pool"] == "powerbert"


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("aug.mixup", 0.8),
        ("aug.randaugment", "rand-m9-mstd0.5"),
        ("aug.reprob", 0.25),
        ("train.query_masking", True),
    ],
)
def test_options_that_move_pixels_or_mix_labels_are_refused(tmp_path: Path, option: str, value: Any) -> None:
    write_fake_fashion(tmp_path)
    with pytest.raises(ValueError, match=f"semantic segmentation data set, for which {option}"):
        fit(_config(tmp_path, **{option: value}), out_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_classifier_on_label_maps_is_refused_before_a_run(tmp_path: Path) -> None:
    write_fake_fashion(tmp_path)
    with pytest.raises(
        ValueError, match="deit_test is a classification model, but the dataset's targets are for semantic"
    ):
        fit(_config(tmp_path, model="deit_test"), out_dir=tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="gives 5 class scores per pixel, but the data has 11"):
        fit(_config(tmp_path, **{"model_options.num_classes": 5}), out_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def _sweep(out: Path, root: Path, **extra: Any) -> dict[str, Any]:
    return {
        "name": "seg",
        "checkpoint": str(out / "last.safetensors"),
        "data": {**DATA, "root": str(root)},
        "methods": ["none", "powerbert", "merge"],
        "budgets": [0.5],
        "throughput": False,
        **extra,
    }


def test_a_segmentation_sweep_scores_every_reducer_by_miou(
    trained: tuple[Path, Path, dict[str, float]], tmp_path: Path
) -> None:
    root, out, metrics = trained
    cfg = sweep_config_from_dict(_sweep(out, root, task="segmentation"))
    rows = run_sweep(cfg, out_dir=tmp_path / "sweep", progress=False).rows
    by_method = {r["method"]: r for r in rows}
    assert by_method["none"]["miou"] == pytest.approx(metrics["miou"], abs=1e-6)
    # Tokens the last block left (the head still sees all 64 patches, unpooled).
    assert by_method["none"]["tokens_out"] == 65 and by_method["merge"]["tokens_out"] < 65
    for method in ("powerbert", "merge"):
        row = by_method[method]
        assert row["gflops"] < by_method["none"]["gflops"] and "top1" not in row
        assert row["d_miou"] == pytest.approx(row["miou"] - by_method["none"]["miou"])
    table = markdown_table(rows)
    assert "mIoU (%)" in table and "Δ mIoU" in table and "top-1" not in table
    assert (tmp_path / "sweep" / "tradeoff.png").is_file()


def test_a_sweep_task_that_is_not_the_data_s_is_refused(
    trained: tuple[Path, Path, dict[str, float]], tmp_path: Path
) -> None:
    root, out, _ = trained
    with pytest.raises(
        ValueError, match="task: classification, but fashion_detect as configured is a segmentation"
    ):
        run_sweep(sweep_config_from_dict(_sweep(out, root, task="classification")), progress=False)
    with pytest.raises(ValueError, match="task: must be one of classification, segmentation"):
        sweep_config_from_dict(_sweep(out, root, task="semantic"))
    detection = {**DATA, "root": str(root), "options": {"num_canvases": 7}}
    with pytest.raises(ValueError, match=r"is a detection data set.*target: semantic"):
        run_sweep(sweep_config_from_dict({**_sweep(out, root), "data": detection}), progress=False)
