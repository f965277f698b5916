"""Top-1 evaluation."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leanformer.progress import progress_bar


def to_device(inputs: Any, device: torch.device | str) -> Any:
    if isinstance(inputs, Tensor):
        return inputs.to(device, non_blocking=True)
    if isinstance(inputs, list | tuple):
        return type(inputs)(to_device(x, device) for x in inputs)
    return inputs


def call_model(model: nn.Module, inputs: Any, **forward_kwargs: Any) -> Tensor:
    """Datasets yield a tensor, or a tuple of tensors for multi-input models."""
    if isinstance(inputs, list | tuple):
        return model(*inputs, **forward_kwargs)
    return model(inputs, **forward_kwargs)


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    forward_kwargs: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
    progress: bool = False,
    desc: str = "eval",
    after_batch: Callable[[nn.Module], None] | None = None,
    on_logits: Callable[[Tensor, Tensor], None] | None = None,
) -> dict[str, float]:
    """Returns ``{"top1": %, "loss": mean cross-entropy, "n": samples}``.

    ``after_batch(model)`` runs after every batch, e.g. to collect per-input statistics
    a model records during its forward pass (kept query counts under DQS).
    ``on_logits(logits, target)`` sees every batch's outputs, e.g. to keep which inputs
    were right (paired comparisons of two models on the same inputs).
    """
    was_training = model.training
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    try:
        for inputs, target in progress_bar(loader, desc=desc, show=progress, leave=False):
            inputs, target = to_device(inputs, device), target.to(device)
            logits = call_model(model, inputs, **(forward_kwargs or {}))
            correct += (logits.argmax(dim=-1) == target).sum()
            loss_sum += F.cross_entropy(logits.float(), target, reduction="sum").double()
            count += target.shape[0]
            if on_logits is not None:
                on_logits(logits, target)
            if after_batch is not None:
                after_batch(model)
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluation data is empty")
    return {"top1": 100.0 * correct.item() / count, "loss": loss_sum.item() / count, "n": count}
