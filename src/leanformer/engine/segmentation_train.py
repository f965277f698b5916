"""What training a semantic segmenter changes in the engine's loop: its loss (per-pixel
cross-entropy of logits ``[B, K, H, W]`` against labels ``[B, H, W]``, which the
classification loss already is), and its scores (mean IoU and pixel accuracy on
the evaluation split); the recipe options that do not apply to label maps are refused as
a detector's are (:func:`leanformer.engine.detection_train.refuse_label_recipe_options`).

Everything else (optimizer, schedule, EMA, checkpoints, exact resume, DDP) is the
classification loop's, in :mod:`leanformer.engine.train`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leanformer.engine.evaluate import call_model, evaluate, to_device
from leanformer.engine.segmentation_eval import SegmentationScores
from leanformer.progress import progress_bar


def check_label_map_logits(logits: Tensor, target: Tensor, num_classes: int) -> None:
    """A segmenter gives ``[B, K, H, W]`` logits for ``[B, H, W]`` labels, ``K`` at least the
    data's classes; anything else is refused before a run starts."""
    if logits.dim() != target.dim() + 1 or logits.shape[2:] != target.shape[1:]:
        raise ValueError(
            f"the model gives {tuple(logits.shape)} for label maps of {tuple(target.shape)}: "
            "a segmenter (e.g. segvit_fashion) gives [batch, classes, height, width] logits"
        )
    if logits.shape[1] < num_classes:
        raise ValueError(
            f"the model gives {logits.shape[1]} class scores per pixel, but the data has "
            f"{num_classes} classes (is num_classes set in the model options?)"
        )


@torch.inference_mode()
def segmentation_scores(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    num_classes: int,
    device: torch.device | str = "cpu",
    forward_kwargs: dict[str, Any] | None = None,
    progress: bool = False,
    desc: str = "eval",
) -> dict[str, float]:
    """``miou`` and ``pixel_accuracy`` (percent), ``loss`` (mean per-pixel cross-entropy)
    and ``n`` (images) of ``model`` over ``loader``."""
    was_training = model.training
    model.eval()
    scores = SegmentationScores(num_classes)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    pixels = count = 0
    try:
        for inputs, target in progress_bar(loader, desc=desc, show=progress, leave=False):
            inputs, target = to_device(inputs, device), target.to(device)
            logits = call_model(model, inputs, **(forward_kwargs or {}))
            check_label_map_logits(logits, target, num_classes)
            scores.update(logits[:, :num_classes], target)
            loss_sum += F.cross_entropy(logits.float(), target, reduction="sum").double()
            pixels += target.numel()
            count += target.shape[0]
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluation data is empty")
    return {
        "miou": scores.mean_iou(),
        "pixel_accuracy": scores.pixel_accuracy(),
        "loss": loss_sum.item() / pixels,
        "n": count,
    }


def label_scores(
    model: nn.Module, loader: Iterable[Any], *, info: Any, device: torch.device | str
) -> dict[str, float]:
    """What the data's labels score (``info``: the data set's): ``top1`` of a classifier, or
    ``miou`` and ``pixel_accuracy`` of a semantic segmenter, with ``loss`` and ``n``."""
    if info.task == "semantic":
        return segmentation_scores(model, loader, num_classes=info.num_classes, device=device)
    return evaluate(model, loader, device=device)
