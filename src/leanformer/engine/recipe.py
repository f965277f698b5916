"""The training recipe's pieces, from timm: optimizer and schedule factories, Mixup/CutMix
with soft targets, an EMA of the weights, and the precision a step runs in.

Nothing here is written anew: each function turns our config into the arguments of
timm's own factory and checks them first, so a bad value is refused with the config key
that holds it rather than failing inside timm mid-run.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from timm.data import Mixup
from timm.optim import (
    create_optimizer_v2,
    get_optimizer_class,
    list_optimizers,
    param_groups_layer_decay,
    param_groups_weight_decay,
)
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch import Tensor, nn

from leanformer.config import AugConfig, OptimConfig, TrainConfig
from leanformer.data.host_random import seeded_by_torch

SCHEDULES = ("cosine", "step", "constant")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
MIXUP_MODES = ("batch", "pair", "elem")
# Parameters that take no weight decay besides biases and norms (1-D tensors, which
# timm's grouping leaves out itself): the learned tokens and position tables.
NO_WEIGHT_DECAY = ("*pos_embed", "*cls_token", "*dist_token", "*reg_token")


def _finite(value: float, key: str, *, low: float, high: float = math.inf, low_open: bool = False) -> None:
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"> {low}" if low_open else f">= {low}"
        limit = "" if high == math.inf else f" and <= {high}"
        raise ValueError(f"{key} must be a finite number {bound}{limit}, got {value}")


def check_recipe(optim: OptimConfig, aug: AugConfig, train: TrainConfig) -> None:
    """Refuse recipe values timm would reject mid-run or silently misuse."""
    if optim.opt not in list_optimizers():
        raise ValueError(f"optim.opt: timm has no optimizer {optim.opt!r} (see timm.optim.list_optimizers())")
    if optim.sched not in SCHEDULES:
        raise ValueError(f"optim.sched must be one of {', '.join(SCHEDULES)}, got {optim.sched!r}")
    _finite(optim.warmup_lr, "optim.warmup_lr", low=0)
    _finite(optim.decay_epochs, "optim.decay_epochs", low=0, low_open=True)
    _finite(optim.decay_rate, "optim.decay_rate", low=0, high=1, low_open=True)
    if optim.layer_decay is not None:
        _finite(optim.layer_decay, "optim.layer_decay", low=0, high=1, low_open=True)
    for key in ("mixup", "cutmix"):
        _finite(getattr(aug, key), f"aug.{key}", low=0)
    for key in ("mixup_prob", "switch_prob"):
        _finite(getattr(aug, key), f"aug.{key}", low=0, high=1)
    if aug.mixup_mode not in MIXUP_MODES:
        raise ValueError(f"aug.mixup_mode must be one of {', '.join(MIXUP_MODES)}, got {aug.mixup_mode!r}")
    _finite(train.ema_decay, "train.ema_decay", low=0, high=1, low_open=True)
    if train.ema_decay == 1:
        raise ValueError(
            "train.ema_decay must be below 1 (at 1 the EMA never moves from the initial weights)"
        )
    if train.precision not in PRECISIONS:
        raise ValueError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {train.precision!r}")


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """timm's ``create_optimizer_v2``: no weight decay on 1-D parameters and :data:`NO_WEIGHT_DECAY`
    (plus the model's own ``no_weight_decay()``); layer-wise decay where asked for."""
    kwargs: dict[str, Any] = {}
    if "betas" in inspect.signature(get_optimizer_class(optim.opt, bind_defaults=False)).parameters:
        kwargs["betas"] = (optim.beta1, optim.beta2)
    skip = set(NO_WEIGHT_DECAY) | set(getattr(model, "no_weight_decay", set)())
    layer_decay = optim.layer_decay
    if layer_decay is not None and not hasattr(model, "group_matcher"):
        raise ValueError(
            f"optim.layer_decay needs a model that names its layers (timm's group_matcher); "
            f"{type(model).__name__} does not"
        )

    # Our own grouping, handed to timm's factory, so both forms skip the same parameters and
    # the model is never given a no_weight_decay() of ours.
    def group_fn(m: nn.Module) -> Any:
        if layer_decay is None:
            return param_groups_weight_decay(m, optim.weight_decay, no_weight_decay_list=skip)
        return param_groups_layer_decay(
            m, weight_decay=optim.weight_decay, layer_decay=layer_decay, no_weight_decay_list=skip
        )

    return create_optimizer_v2(
        model,
        opt=optim.opt,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        param_group_fn=group_fn,
        **kwargs,
    )


class StepSchedule:
    """timm's scheduler stepped per update. Its rate is a function of the update count
    alone, so a resumed run sets it with :meth:`at` (and an extended run, with more
    epochs, follows the new length) instead of loading a saved state."""

    def __init__(self, optimizer: torch.optim.Optimizer, optim: OptimConfig, steps_per_epoch: int) -> None:
        self.optimizer = optimizer
        self.scheduler, _ = create_scheduler_v2(
            optimizer,
            sched=optim.sched,
            num_epochs=optim.epochs,
            decay_epochs=optim.decay_epochs,
            decay_rate=optim.decay_rate,
            min_lr=min(optim.min_lr, optim.lr),
            warmup_lr=min(optim.warmup_lr, optim.lr),
            warmup_epochs=optim.warmup_epochs,  # type: ignore[arg-type]  # fractions are fine per update
            step_on_epochs=False,
            updates_per_epoch=steps_per_epoch,
        )
        self.updates = 0
        self.at(0)

    def at(self, updates: int) -> None:
        """Set the rate for the update after ``updates`` finished ones."""
        self.updates = updates
        if self.scheduler is not None:
            self.scheduler.step_update(num_updates=updates)

    def step(self) -> None:
        self.at(self.updates + 1)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates}


def build_mixup(aug: AugConfig, *, label_smoothing: float, num_classes: int) -> Callable[..., Any] | None:
    """timm's Mixup/CutMix (soft targets, label smoothing folded in), its draws seeded by
    torch's generator; None when both alphas are 0."""
    if not (aug.mixup > 0 or aug.cutmix > 0):
        return None
    mixup = Mixup(
        mixup_alpha=aug.mixup,
        cutmix_alpha=aug.cutmix,
        prob=aug.mixup_prob,
        switch_prob=aug.switch_prob,
        mode=aug.mixup_mode,
        label_smoothing=label_smoothing,
        num_classes=num_classes,
    )

    def mix(inputs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        if not isinstance(inputs, Tensor):
            raise ValueError("aug.mixup / aug.cutmix mix single images, not pairs of inputs")
        if inputs.shape[0] % 2:
            raise ValueError(f"Mixup/CutMix need an even batch per process, got {inputs.shape[0]}")
        with seeded_by_torch():
            return mixup(inputs, target)

    return mix


def build_ema(model: nn.Module, train: TrainConfig) -> ModelEmaV3 | None:
    return ModelEmaV3(model, decay=train.ema_decay) if train.ema else None


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The context a training forward runs in: bf16 autocast, or nothing for fp32."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
