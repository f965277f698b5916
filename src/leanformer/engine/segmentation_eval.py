"""Semantic segmentation scores: a confusion matrix accumulated over batches, and mean IoU.

``update(logits [B, K, H, W] or labels [B, H, W], target [B, H, W])`` adds one batch;
``mean_iou`` averages the per-class IoU ``TP / (TP + FP + FN)`` over the classes that
occur in the target or the prediction (a class absent from both has no IoU and is left
out, as in the usual mIoU); ``pixel_accuracy`` is the share of pixels labelled right.
Pixels whose target is ``ignore_index`` count nowhere. Counting is one ``bincount`` per
batch, on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor


class SegmentationScores:
    """Confusion counts of ``num_classes`` classes (rows: target, columns: prediction)."""

    def __init__(self, num_classes: int, *, ignore_index: int | None = None) -> None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be an int >= 1, got {num_classes!r}")
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)

    def update(self, prediction: Tensor, target: Tensor) -> None:
        """Add a batch: ``prediction`` as logits ``[B, K, H, W]`` or labels ``[B, H, W]``."""
        if prediction.dim() == target.dim() + 1:
            if prediction.shape[1] != self.num_classes:
                raise ValueError(
                    f"logits have {prediction.shape[1]} classes; these scores count {self.num_classes}"
                )
            prediction = prediction.argmax(dim=1)
        if prediction.shape != target.shape:
            raise ValueError(
                f"prediction {tuple(prediction.shape)} and target {tuple(target.shape)} differ in shape"
            )
        keep = torch.ones_like(target, dtype=torch.bool)
        if self.ignore_index is not None:
            keep = target != self.ignore_index
        k = self.num_classes
        target, prediction = target[keep].long(), prediction[keep].long()
        # One read back per batch: a label out of range would be counted as another pair.
        if bool(((target < 0) | (target >= k) | (prediction < 0) | (prediction >= k)).any()):
            raise ValueError(f"labels must lie in 0..{k - 1} (or be ignore_index in the target)")
        counts = torch.bincount(target * k + prediction, minlength=k * k)
        self.confusion = self.confusion.to(counts.device) + counts.view(k, k)

    def per_class_iou(self) -> Tensor:
        """IoU of each class (``[K]`` float), NaN for a class absent from target and prediction."""
        c = self.confusion.double()
        tp = c.diagonal()
        union = c.sum(0) + c.sum(1) - tp
        return torch.where(union > 0, tp / union.clamp(min=1), torch.full_like(tp, float("nan")))

    def mean_iou(self) -> float:
        """Mean IoU over the classes that occur (in %), NaN when no pixel was counted."""
        iou = self.per_class_iou()
        present = ~iou.isnan()
        return float(100 * iou[present].mean()) if present.any() else float("nan")

    def pixel_accuracy(self) -> float:
        """Share of counted pixels labelled right (in %), NaN when none was counted."""
        total = int(self.confusion.sum())
        return 100 * int(self.confusion.diagonal().sum()) / total if total else float("nan")
