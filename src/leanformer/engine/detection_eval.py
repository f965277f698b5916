"""COCO box AP of a detector's predictions, computed by ``pycocotools`` (the field's reference code).

Predictions are one dict per image: ``image_id``, ``boxes [K, 4]`` (x0, y0, x1, y1 in
pixels), ``scores [K]`` and ``labels [K]`` (0-based classes, as the ground truth's
``category_id - 1``). The ground truth is a COCO dataset dict such as
:func:`leanformer.data.fashion_detect.coco_ground_truth` writes. Metrics are fractions
in [0, 1]; an area range with no ground-truth object has no AP (``None``), as COCO's
summary prints -1 for it.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

METRICS = ("ap", "ap50", "ap75", "ap_small", "ap_medium", "ap_large")
HOW_TO_GET = "COCO evaluation needs pycocotools: pip install pycocotools (or leanformer[detection])"


def coco_results(predictions: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Predictions as COCO's result list: ``{"image_id", "category_id", "bbox": [x, y, w, h], "score"}``."""
    results = []
    for prediction in predictions:
        boxes = torch.as_tensor(prediction["boxes"], dtype=torch.float64).reshape(-1, 4)
        scores = torch.as_tensor(prediction["scores"], dtype=torch.float64).flatten()
        labels = torch.as_tensor(prediction["labels"]).flatten()
        if not len(boxes) == len(scores) == len(labels):
            raise ValueError(
                f"image {prediction['image_id']}: {len(boxes)} boxes, {len(scores)} scores and "
                f"{len(labels)} labels (need one of each per detection)"
            )
        if not torch.isfinite(boxes).all() or not torch.isfinite(scores).all():
            raise ValueError(f"image {prediction['image_id']}: boxes and scores must be finite")
        image_id = int(prediction["image_id"])
        for (x0, y0, x1, y1), score, label in zip(boxes.tolist(), scores.tolist(), labels.tolist()):
            results.append(
                {
                    "image_id": image_id,
                    "category_id": int(label) + 1,
                    "bbox": [x0, y0, x1 - x0, y1 - y0],
                    "score": score,
                }
            )
    return results


def coco_box_ap(
    ground_truth: dict[str, Any], predictions: Sequence[dict[str, Any]]
) -> dict[str, float | None]:
    """``{"ap", "ap50", "ap75", "ap_small", "ap_medium", "ap_large"}`` of ``predictions`` against
    ``ground_truth`` (COCO's defaults: IoU 0.50:0.95, up to 100 detections per image)."""
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError:
        raise ValueError(HOW_TO_GET) from None
    known = {image["id"] for image in ground_truth["images"]}
    unknown = sorted({int(p["image_id"]) for p in predictions} - known)
    if unknown:
        raise ValueError(f"predictions for images not in the ground truth: {unknown[:5]}")
    results = coco_results(predictions)
    if not results:  # COCO.loadRes refuses an empty list; nothing detected scores 0
        return {name: 0.0 for name in METRICS}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
        gt = COCO()
        gt.dataset = ground_truth
        gt.createIndex()
        evaluation = COCOeval(gt, gt.loadRes(results), iouType="bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    stats = evaluation.stats[: len(METRICS)]
    return {name: (None if value < 0 else float(value)) for name, value in zip(METRICS, stats)}


@torch.inference_mode()
def evaluate_detection(
    model: nn.Module,
    loader: Iterable[tuple[Tensor, list[dict[str, Any]]]],
    ground_truth: dict[str, Any],
    *,
    device: torch.device | str = "cpu",
) -> dict[str, float | None]:
    """COCO box AP of ``model.predict(images) -> [{"boxes", "scores", "labels"}]`` over
    ``loader`` (batches of images and target dicts carrying ``image_id``), plus ``n`` images."""
    predict = getattr(model, "predict", None)
    if not callable(predict):
        name = getattr(model, "leanformer_name", type(model).__name__)
        raise ValueError(f"{name} is not a detector (it has no predict(images) giving boxes)")
    was_training = model.training
    model.eval()
    predictions: list[dict[str, Any]] = []
    try:
        for images, targets in loader:
            outputs = predict(images.to(device))
            for output, target in zip(outputs, targets, strict=True):
                predictions.append(
                    {**{k: v.cpu() for k, v in output.items()}, "image_id": target["image_id"]}
                )
    finally:
        model.train(was_training)
    if not predictions:
        raise ValueError("evaluation data is empty")
    return {**coco_box_ap(ground_truth, predictions), "n": float(len(predictions))}


def evaluate_detector(
    model: nn.Module, dataset: Dataset, *, batch_size: int, device: torch.device | str = "cpu"
) -> dict[str, float | None]:
    """:func:`evaluate_detection` of ``model`` on a ``fashion_detect`` split (or the first items of
    one, as a ``LimitedDataset`` holds them), against that split's COCO ground truth."""
    from leanformer.data.fashion_detect import FashionDetect, coco_ground_truth, collate_detection

    source = getattr(dataset, "dataset", dataset)  # a LimitedDataset's source
    if not isinstance(source, FashionDetect) or source.target != "detection":
        raise ValueError("detection evaluation needs fashion_detect with target=detection")
    count = len(dataset)  # type: ignore[arg-type]
    ground_truth = coco_ground_truth(source, limit=count)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_detection)
    return evaluate_detection(model, loader, ground_truth, device=device)
