"""The classification output layer every model family builds and rebuilds (``reset_classifier``)."""

from __future__ import annotations

from torch import nn


def classifier(in_features: int, num_classes: int) -> nn.Module:
    """``Linear(in_features, num_classes)``, or ``Identity`` for ``num_classes = 0`` (features only).

    A negative or non-integer class count raises instead of silently dropping the head.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
        raise ValueError(f"num_classes must be an int >= 0 (0: features only), got {num_classes!r}")
    return nn.Linear(in_features, num_classes) if num_classes > 0 else nn.Identity()
