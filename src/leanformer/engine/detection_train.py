"""What training a detector changes in the engine's loop: its batches (images and a list of
target dicts, whose object counts differ), its loss (the host's own Hungarian-matched loss,
from ``model(images, targets).loss``), its scores (COCO box AP on the evaluation split) and
the recipe options that do not apply to boxes.

Everything else (optimizer, schedule, EMA, checkpoints, exact resume, DDP) is the
classification loop's, in :mod:`leanformer.engine.train`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from leanformer.config import RunConfig

# Scores a detector's epoch records (COCO box AP, AP50 and AP75, in percent).
DETECTION_SCORES = ("ap", "ap50", "ap75")


def refuse_label_recipe_options(cfg: RunConfig, *, data_kind: str, targets: str) -> None:
    """Refuse, in one line, the recipe options that only make sense for class labels or
    would move pixels without moving the ``targets`` (a detector's boxes, a segmenter's
    label map): Mixup, CutMix, RandAugment, random erasing, a teacher, query masking.
    (``train.label_smoothing`` has no effect on a detector: its loss has its own class term.)"""
    refused = [
        (cfg.aug.mixup > 0, "aug.mixup"),
        (cfg.aug.cutmix > 0, "aug.cutmix"),
        (cfg.aug.randaugment is not None, "aug.randaugment"),
        (cfg.aug.reprob > 0, "aug.reprob"),
        (cfg.train.teacher is not None, "train.teacher"),
        (cfg.train.query_masking, "train.query_masking"),
    ]
    given = [name for is_set, name in refused if is_set]
    if given:
        raise ValueError(
            f"train: {cfg.data.name} is a {data_kind} data set, for which {', '.join(given)} "
            f"do not apply (they mix labels or move pixels without their {targets}); leave them unset"
        )


def targets_to(targets: list[dict[str, Any]], device: torch.device) -> list[dict[str, Any]]:
    """Every tensor of every target dict on ``device`` (ids and other values as they are)."""
    return [{k: v.to(device) if isinstance(v, Tensor) else v for k, v in t.items()} for t in targets]


def detection_loss(model: nn.Module, images: Tensor, targets: list[dict[str, Any]]) -> Tensor:
    """The detector's own training loss on a batch (``model(images, targets).loss``)."""
    output = model(images, targets)
    loss = getattr(output, "loss", None)
    if not isinstance(loss, Tensor):
        name = getattr(model, "leanformer_name", type(model).__name__)
        raise ValueError(
            f"{name} gives no loss for images and targets; "
            "train a detector (e.g. detr_fashion) on detection data"
        )
    return loss


def detection_scores(
    model: nn.Module, dataset: Dataset, *, batch_size: int, device: torch.device
) -> dict[str, float]:
    """COCO box AP, AP50 and AP75 (percent) of ``model`` on ``dataset`` (pycocotools leaves
    them undefined only without any ground truth, read here as 0)."""
    from leanformer.engine.detection_eval import evaluate_detector

    scores = evaluate_detector(model, dataset, batch_size=batch_size, device=device)
    return {key: 100.0 * float(scores[key] or 0.0) for key in DETECTION_SCORES}
