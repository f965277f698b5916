"""detr_fashion: a Conditional DETR from scratch, with and without ENACT in its encoder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import leanformer
from leanformer.engine.detection_eval import coco_box_ap
from leanformer.models.detr_fashion import detections, host_targets
from leanformer.patch.transformers.detr import is_patched

TARGETS = [
    {
        "boxes": torch.tensor([[8.0, 8.0, 30.0, 40.0], [32.0, 20.0, 60.0, 44.0]]),
        "labels": torch.tensor([1, 7]),
    },
    {"boxes": torch.tensor([[4.0, 10.0, 24.0, 30.0]]), "labels": torch.tensor([9])},
]


def encoder_tokens(model: torch.nn.Module, images: torch.Tensor) -> int:
    seen: dict = {}
    encoder = model.detector.model.encoder
    handle = encoder.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    try:
        with torch.no_grad():
            model.eval()(images)
    finally:
        handle.remove()
    return seen["inputs_embeds"].shape[1]


@pytest.mark.parametrize("name", ["detr_fashion", "detr_fashion_enact"])
def test_full_size_weights_fit_10_mb_and_the_encoder_sees_256_tokens(name: str) -> None:
    model = leanformer.create_model(name)
    size = sum(t.numel() * 4 for t in model.state_dict().values() if t.is_floating_point())
    assert size <= 10_000_000
    assert encoder_tokens(model, torch.randn(1, 1, 128, 128)) == 256  # 128 px / stride 8 = 16x16
    assert is_patched(model.detector) == (name == "detr_fashion_enact")
    # Trained from scratch: the backbone's batch norms learn (DETR's are frozen for pretrained weights).
    norms = [m for m in model.detector.model.backbone.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(m.weight.requires_grad for m in norms)


@pytest.mark.parametrize("enact", [False, True])
def test_a_training_step_gives_finite_gradients_to_every_parameter(enact: bool) -> None:
    torch.manual_seed(0)
    model = leanformer.create_model("detr_fashion_test", enact=enact).train()
    assert is_patched(model.detector) == enact
    output = model(torch.randn(2, 1, 64, 64), TARGETS)
    assert output.loss.ndim == 0 and torch.isfinite(output.loss)
    output.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    if enact:  # ENACT's own entropy projection learns through the clustering
        assert any("entropy_proj" in n for n, p in model.named_parameters() if p.grad is not None)


def test_targets_become_the_hosts_fractional_centre_boxes() -> None:
    converted = host_targets(TARGETS, (64, 128))  # height 64, width 128
    expected = torch.tensor(
        [[19.0 / 128, 24.0 / 64, 22.0 / 128, 32.0 / 64], [46.0 / 128, 32.0 / 64, 28.0 / 128, 24.0 / 64]]
    )
    torch.testing.assert_close(converted[0]["boxes"], expected)
    assert converted[1]["class_labels"].tolist() == [9]
    with pytest.raises(ValueError, match="boxes \\[K, 4\\] and labels \\[K\\]"):
        host_targets([{"boxes": torch.zeros(2, 4), "labels": torch.zeros(3)}], (64, 64))


def test_detections_keep_the_best_query_class_pairs_in_pixels() -> None:
    logits = torch.full((1, 3, 2), -10.0)
    logits[0, 2, 1], logits[0, 0, 0] = 3.0, 1.0
    pred_boxes = torch.tensor([[[0.5, 0.5, 0.2, 0.4], [0.1, 0.1, 0.1, 0.1], [0.25, 0.75, 0.5, 0.5]]])
    (best,) = detections(logits, pred_boxes, (100, 200), max_detections=2)
    torch.testing.assert_close(best["scores"], torch.sigmoid(torch.tensor([3.0, 1.0])))
    assert best["labels"].tolist() == [1, 0]
    torch.testing.assert_close(
        best["boxes"], torch.tensor([[0.0, 50.0, 100.0, 100.0], [80.0, 30.0, 120.0, 70.0]])
    )


def test_predictions_feed_the_coco_evaluation() -> None:
    pytest.importorskip("pycocotools")
    torch.manual_seed(0)
    model = leanformer.create_model("detr_fashion_test").eval()
    predictions = model.predict(torch.randn(2, 1, 64, 64))
    assert [p["boxes"].shape for p in predictions] == [(50, 4), (50, 4)]  # 5 queries x 10 classes
    truth = {
        "images": [{"id": 0}, {"id": 1}],
        "annotations": [
            {
                "id": 1,
                "image_id": 0,
                "category_id": 2,
                "bbox": [8.0, 8.0, 22.0, 32.0],
                "area": 704.0,
                "iscrowd": 0,
            }
        ],
        "categories": [{"id": c + 1} for c in range(10)],
    }
    metrics = coco_box_ap(truth, [{**p, "image_id": i} for i, p in enumerate(predictions)])
    assert set(metrics) == {"ap", "ap50", "ap75", "ap_small", "ap_medium", "ap_large"}
    assert metrics["ap"] is not None and 0.0 <= metrics["ap"] <= 1.0


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match=r"d_model .* must be divisible by num_heads"):
        leanformer.create_model("detr_fashion_test", d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="img_size must be >= 16"):
        leanformer.create_model("detr_fashion_test", img_size=8)


def test_eval_scores_a_detector_on_fashion_detect(tmp_path: Path, capsys) -> None:
    pytest.importorskip("pycocotools")
    from leanformer.cli import main
    from test_fashion_detect import write_fake_fashion

    write_fake_fashion(tmp_path)
    data = ["--data", "fashion_detect", "--data-root", str(tmp_path), "--data.options.num_canvases", "3"]
    code = main(["eval", "--model", "detr_fashion_test", *data, "--data.img_size", "64", "--json"])
    assert code in (0, None)
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["model"] == "detr_fashion_test" and row["n"] == 3
    assert all(isinstance(row[k], float) and math.isfinite(row[k]) for k in ("ap", "ap50", "ap75"))
    limited = [
        "eval",
        "--model",
        "detr_fashion_test",
        *data,
        "--data.img_size",
        "64",
        "--data.limit_test",
        "2",
    ]
    assert main([*limited, "--json"]) in (0, None)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n"] == 2
    assert main([*limited, "--compile"]) == 2
    assert "a detector is evaluated eagerly" in capsys.readouterr().err
    assert main(["eval", "--model", "deit_tiny", *data]) == 2
    assert "deit_tiny is a classification model, but the dataset's targets are for detection" in (
        capsys.readouterr().err
    )
    assert main(["eval", "--model", "detr_fashion_test", "--data", "digits"]) == 2
    assert "detr_fashion_test is a detection model, but the dataset's targets are for classification" in (
        capsys.readouterr().err
    )


def _detection_data(tmp_path: Path) -> list[str]:
    from test_fashion_detect import write_fake_fashion

    write_fake_fashion(tmp_path)
    options = ["--data.options.num_canvases", "6", "--data.img_size", "64", "--train.eval_split", "test"]
    return ["--data", "fashion_detect", "--data-root", str(tmp_path), *options, "--batch-size", "3"]


@pytest.mark.parametrize("enact", [True, False])
def test_train_fits_a_detector_and_eval_reads_its_checkpoint(tmp_path: Path, capsys, enact: bool) -> None:
    """The host's own matched loss, COCO AP on the evaluation split after every epoch, and
    a checkpoint `eval` scores the same: with ENACT in the encoder and without."""
    pytest.importorskip("pycocotools")
    from leanformer.cli import main

    out = tmp_path / "run"
    argv = ["train", "--model", "detr_fashion_test", "--opt", f"enact={enact}", *_detection_data(tmp_path)]
    assert main([*argv, "--epochs", "2", "--out", str(out), "--json"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["train_loss"]) and 0 <= row["ap50"] <= 100 for row in rows)
    assert "top1" not in rows[-1]
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out), *_detection_data(tmp_path)[:4], "--json"]) == 0
    scores = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 100 * scores["ap50"] == pytest.approx(rows[-1]["ap50"])


def test_a_detector_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("pycocotools")
    from leanformer.config import load_config
    from leanformer.engine.train import fit
    from test_fashion_detect import write_fake_fashion

    write_fake_fashion(tmp_path)
    overrides = {
        "model": "detr_fashion_test",
        "data.name": "fashion_detect",
        "data.root": str(tmp_path),
        "data.img_size": "64",
        "data.batch_size": "3",
        "data.options": "{num_canvases: 6}",
        "optim.epochs": "2",
        "train.eval_split": "test",
    }
    whole = fit(load_config(None, overrides), out_dir=tmp_path / "whole", progress=False).history
    cfg = load_config(None, overrides)
    fit(cfg, out_dir=tmp_path / "parts", progress=False, stop_after_epochs=1)
    parts = fit(cfg, out_dir=tmp_path / "parts", progress=False, resume=True).history
    assert [{k: v for k, v in row.items() if k != "epoch_seconds"} for row in parts] == [
        {k: v for k, v in row.items() if k != "epoch_seconds"} for row in whole
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--model", "deit_tiny"],
            "deit_tiny is a classification model, but the dataset's targets are for detection",
        ),
        (["--model", "detr_fashion_test", "--aug.mixup", "0.8"], "for which aug.mixup do not apply"),
        (["--model", "detr_fashion_test", "--data.eval_batch_size", "1000000000"], "would need about"),
        (
            ["--model", "detr_fashion_test", "--aug.randaugment", "rand-m9"],
            "for which aug.randaugment do not",
        ),
    ],
)
def test_train_refuses_what_a_detector_cannot_use_before_writing(
    tmp_path: Path, capsys, extra: list[str], message: str
) -> None:
    from leanformer.cli import main

    out = tmp_path / "run"
    assert main(["train", *extra, *_detection_data(tmp_path), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_visualize_enact_draws_a_detectors_boxes_and_regions(tmp_path: Path, capsys) -> None:
    """The regions drawn are those the detector's first ENACT layer used on that canvas."""
    from leanformer.cli import main
    from leanformer.data.fashion_detect import build_fashion_detect
    from leanformer.patch.transformers.detr import enact_layers
    from test_fashion_detect import write_fake_fashion

    write_fake_fashion(tmp_path)
    out = tmp_path / "maps.png"
    argv = ["visualize", "enact", "--detector", "detr_fashion_test", "--data-root", str(tmp_path)]
    assert main([*argv, "--canvas", "1", "--out", str(out), "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out.stat().st_size > 0 and row["out"] == str(out)
    torch.manual_seed(0)
    model = leanformer.create_model("detr_fashion_test").eval()
    image, truth = build_fashion_detect(split="test", root=str(tmp_path), num_canvases=2, img_size=64)[1]
    model.predict(image[None])
    first = enact_layers(model.detector)[0]
    assert row["regions"] == int(first.last_cluster_counts[0]) and row["objects"] == len(truth["labels"])
    for extra, message in (
        (["--detector", "detr_fashion"], "has no ENACT encoder layer"),
        (["--detector", "detr_fashion_test", "--image", "china"], "--image draws a photo"),
        (["--pretrained"], "--pretrained goes with --detector"),
        (["--detector", "detr_fashion_test", "--canvas", "-1"], "--canvas must be >= 0"),
    ):
        assert main(["visualize", "enact", *extra, "--data-root", str(tmp_path), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("enact", [False, True])
def test_the_explicit_attention_matrix_changes_memory_not_results(enact: bool) -> None:
    """``attention_matrix="explicit"`` (ENACT's memory baseline) holds every attention's
    probabilities as tensors, the host's and ENACT's alike, and predicts the same."""
    from leanformer.layers.enact_attention import DenseSelfAttention

    images = torch.randn(2, 1, 64, 64, generator=torch.Generator().manual_seed(3))
    outputs = {}
    for matrix in ("fused", "explicit"):
        torch.manual_seed(0)
        model = leanformer.create_model("detr_fashion_test", enact=enact, attention_matrix=matrix).eval()
        assert model.detector.config._attn_implementation == ("eager" if matrix == "explicit" else "sdpa")
        ours = [m for m in model.modules() if isinstance(m, DenseSelfAttention)]
        assert len(ours) == (1 if enact else 0) and all(m.matrix == matrix for m in ours)
        with torch.no_grad():
            outputs[matrix] = model.detector(pixel_values=images).logits
    torch.testing.assert_close(outputs["explicit"], outputs["fused"], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="attention_matrix must be one of fused, explicit"):
        leanformer.create_model("detr_fashion_test", attention_matrix="eager")
