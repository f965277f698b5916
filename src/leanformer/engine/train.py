"""Training: timm's recipe pieces (optimizer and schedule factories, RandAugment, random
erasing, Mixup/CutMix, EMA), label smoothing, gradient clipping, bf16 autocast, seeded; DDP
under torchrun (one or several nodes).

A run folder holds ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one line per
epoch) and ``last.safetensors`` (+ ``last.json``), committed after every epoch as
:mod:`leanformer.engine.run_folder` describes. ``fit(..., resume=True)`` continues from it
and gives the same metrics as an uninterrupted run: data order is a function of
(seed, epoch), the RNG states and the EMA are saved with the weights, the augmentations and
Mixup draw from torch's generator (:mod:`leanformer.data.host_random`), and the learning
rate is a function of the update count. A folder that holds a run is
only continued (``resume=True``) or replaced (``overwrite=True``), never written over.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from timm.loss import SoftTargetCrossEntropy
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import default_collate

from leanformer.config import (
    RunConfig,
    TrainConfig,
    check_seed,
    flag_names,
    plain_options,
    to_dict,
)
from leanformer.data.fashion_detect import collate_detection
from leanformer.data.loaders import eval_loader, train_loader
from leanformer.data.recipe_augment import with_recipe_augmentation
from leanformer.device import check_device
from leanformer.engine.builders import build_model, build_split, check_model_fits
from leanformer.engine.checkpoint import (
    CHECKPOINT_NAME,
    atomic_write_bytes,
    load_checkpoint,
    load_model,
    save_checkpoint,
)
from leanformer.engine.detection_train import (
    detection_loss,
    detection_scores,
    refuse_label_recipe_options,
    targets_to,
)
from leanformer.engine.distill import soft_cross_entropy
from leanformer.engine.distributed import DistInfo, barrier, cleanup_distributed, setup_distributed
from leanformer.engine.evaluate import call_model, to_device
from leanformer.engine.folder_lock import is_main_process, locked_folder
from leanformer.engine.query_masking import QUERY_DISTRIBUTIONS, sample_num_queries
from leanformer.engine.recipe import (
    StepSchedule,
    autocast_for,
    build_ema,
    build_mixup,
    build_optimizer,
    check_recipe,
)
from leanformer.engine.resume_rule import check_resume
from leanformer.engine.run_folder import (
    CONFIG_NAME,
    check_new_run_folder,
    clear_run,
    discard_uncommitted_run,
    read_metrics,
    recover,
    remove_stale_temporaries,
    write_metrics,
)
from leanformer.engine.segmentation_train import (
    check_label_map_logits,
    label_scores,
)
from leanformer.errors import NonFiniteLossError
from leanformer.models.pretrained import shipped_models
from leanformer.models.query_budget import query_budget
from leanformer.models.registry import model_info
from leanformer.models.state_loading import load_state_lenient
from leanformer.progress import progress_bar


@dataclass
class FitResult:
    model: nn.Module
    metrics: dict[str, float]
    history: list[dict[str, Any]] = field(default_factory=list)
    model_options: dict[str, Any] = field(default_factory=dict)
    out_dir: Path | None = None


_LARGEST_RATE = torch.finfo(torch.float32).max


def _validate(cfg: RunConfig) -> None:
    o, t, d = cfg.optim, cfg.train, cfg.data
    check_seed(cfg.seed)
    check_device(cfg.device, source="device")  # a config file's (the flag is checked on its own)
    if o.epochs < 1:
        raise ValueError(f"optim.epochs must be >= 1, got {o.epochs}")
    if o.lr <= 0:
        raise ValueError(f"optim.lr must be > 0, got {o.lr}")
    # The optimizer's step scales float32 tensors by the rate: a larger one fails mid-epoch.
    for key, rate in (("lr", o.lr), ("min_lr", o.min_lr)):
        if not rate <= _LARGEST_RATE:
            raise ValueError(f"optim.{key} must be a finite number up to {_LARGEST_RATE:.3g}, got {rate}")
    # A negative floor or decay would silently turn descent into ascent for some steps.
    if o.min_lr < 0:
        raise ValueError(f"optim.min_lr must be >= 0, got {o.min_lr}")
    # The schedule decays from lr to min_lr: a floor above the peak would be silently capped.
    if o.min_lr > o.lr:
        raise ValueError(f"optim.min_lr ({o.min_lr}) must not exceed the peak optim.lr ({o.lr})")
    # `not x >= 0` also refuses NaN, which a config file's `.nan` gives (a flag refuses it).
    if not (o.weight_decay >= 0 and math.isfinite(o.weight_decay)):
        raise ValueError(f"optim.weight_decay must be a finite number >= 0, got {o.weight_decay}")
    if not (o.warmup_epochs >= 0 and math.isfinite(o.warmup_epochs)):
        raise ValueError(f"optim.warmup_epochs must be a finite number >= 0, got {o.warmup_epochs}")
    if d.eval_batch_size < 1:
        raise ValueError(f"data.eval_batch_size must be >= 1, got {d.eval_batch_size}")
    if not 0.0 <= t.label_smoothing < 1.0:
        raise ValueError(f"train.label_smoothing must be in [0, 1), got {t.label_smoothing}")
    if t.grad_clip is not None and not (t.grad_clip > 0 and math.isfinite(t.grad_clip)):
        raise ValueError(f"train.grad_clip must be a finite number > 0 or none, got {t.grad_clip}")
    if t.query_distribution not in QUERY_DISTRIBUTIONS:  # before --overwrite clears anything
        raise ValueError(
            f"unknown train.query_distribution {t.query_distribution!r}; "
            f"choose one of {', '.join(QUERY_DISTRIBUTIONS)}"
        )
    if not (math.isfinite(t.distill_tau) and t.distill_tau > 0):
        raise ValueError(f"train.distill_tau must be a finite number > 0, got {t.distill_tau}")
    if not 0.0 <= t.distill_weight <= 1.0:
        raise ValueError(f"train.distill_weight must be in [0, 1], got {t.distill_weight}")
    if d.batch_size < 1:
        raise ValueError(f"data.batch_size must be >= 1, got {d.batch_size}")
    check_dependent_options(cfg)
    check_recipe(o, cfg.aug, t)


# train.* options that only modify another one (key -> the option it needs).
_DEPENDENT = {"distill_weight": "teacher", "distill_tau": "teacher", "query_distribution": "query_masking"}


def _ignored_options(train: TrainConfig) -> list[tuple[str, str, str, bool]]:
    """The dependent options whose option is off: ``(key, needed, flag, set)`` with ``set``
    true when the value differs from the default."""
    defaults = TrainConfig()
    return [
        (key, needed, flag_names()[f"train.{needed}"], getattr(train, key) != getattr(defaults, key))
        for key, needed in _DEPENDENT.items()
        if getattr(train, needed) in (None, False)
    ]


def check_dependent_options(cfg: RunConfig, given: Collection[str] = ()) -> None:
    """Refuse a ``train.*`` option that would be accepted and ignored because the option it
    modifies is off: a value other than the default, or one ``given`` explicitly (dotted
    keys such as ``"train.distill_tau"``; a typed default is as ignored as any other value)."""
    for key, needed, flag, is_set in _ignored_options(cfg.train):
        if is_set or f"train.{key}" in given:
            raise ValueError(
                f"train.{key} has no effect without {flag} (train.{needed}); give {flag} or leave it out"
            )


def drop_ineffective_options(cfg: RunConfig, given: Collection[str] = ()) -> tuple[RunConfig, list[str]]:
    """``cfg`` with each ``train.*`` option that :func:`check_dependent_options` would
    refuse reset to its default, unless it was ``given`` now; and what was reset.

    For a run saved before such values were refused: its ``config.yaml`` can hold one
    (it had no effect in that run), and resuming the run should not fail on it.
    """
    t, defaults = cfg.train, TrainConfig()
    dropped = [
        (key, flag) for key, _, flag, is_set in _ignored_options(t) if is_set and f"train.{key}" not in given
    ]
    messages = [
        f"train.{key}={getattr(t, key)!r} had no effect without {flag}; using the default "
        f"{getattr(defaults, key)!r}"
        for key, flag in dropped
    ]
    reset = {key: getattr(defaults, key) for key, _ in dropped}
    return replace(cfg, train=replace(t, **reset)), messages


def _trained_model(source: str, role: str, info: Any, device: torch.device) -> nn.Module:
    """The trained model ``source`` names: a checkpoint file, a run folder, or a registered
    model with shipped weights (random weights would be worth nothing as a ``role``)."""
    model: nn.Module | None = None
    if Path(source).exists():  # a checkpoint file or a run folder
        model = load_model(source, device=device)
    elif "/" in source or Path(source).suffix:  # registered names have neither
        raise ValueError(f"{role} {source}: no such checkpoint file or run folder")
    else:
        model_info(source)  # an unknown name is refused as such, not as a misfit
        if source not in shipped_models():
            raise ValueError(
                f"{role} {source}: a model given by name needs shipped weights "
                f"({', '.join(shipped_models()) or 'none ship'}); give a trained checkpoint or run folder"
            )
    try:
        # Its inputs (one image or a pair), channels and classes: otherwise the first
        # batch fails with an error about the student's inputs or a bare TypeError.
        if model is None:
            model, _ = build_model(source, {}, info, pretrained=True)
        check_model_fits(model, info)
    except ValueError as err:
        raise ValueError(f"{role} {source} does not fit the data: {err}") from None
    return model.to(device)


def _build_teacher(cfg: RunConfig, info: Any, device: torch.device) -> nn.Module | None:
    if cfg.train.teacher is None:
        return None
    return _trained_model(cfg.train.teacher, "teacher", info, device).eval().requires_grad_(False)


def _initialise_from(model: nn.Module, cfg: RunConfig, info: Any, device: torch.device) -> None:
    """Load ``train.init_from``'s weights into ``model`` (fine-tuning): the same architecture,
    every tensor of the same shape, or a ValueError naming what differs (the run stops there,
    so tensors loaded before the refusal do not matter)."""
    source = cfg.train.init_from
    if source is None:
        return
    weights = _trained_model(source, "init_from", info, device).state_dict()
    misfit = f"init_from {source}: its weights do not fit {cfg.model} with these options"
    missing, unexpected = load_state_lenient(model, weights, mismatch=misfit)
    if missing or unexpected:
        words = [
            f"{label}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
            for label, keys in (("missing", missing), ("unexpected", unexpected))
            if keys
        ]
        raise ValueError(f"{misfit} ({'; '.join(words)})")


class _LossFn:
    """Cross-entropy with label smoothing (soft-target cross-entropy on Mixup/CutMix's mixed
    targets, which carry the smoothing), plus soft-label distillation when a teacher is set."""

    def __init__(self, cfg: RunConfig, teacher: nn.Module | None) -> None:
        self.smoothing = cfg.train.label_smoothing
        self.teacher = teacher
        self.weight = cfg.train.distill_weight
        self.tau = cfg.train.distill_tau
        self.teacher_logits: Tensor | None = None  # the last batch's, to blame a NaN loss rightly

    def __call__(self, logits: Tensor, target: Tensor, inputs: Any) -> Tensor:
        if target.is_floating_point():  # Mixup/CutMix: a distribution per example
            loss = SoftTargetCrossEntropy()(logits.float(), target)
        else:
            loss = F.cross_entropy(logits, target, label_smoothing=self.smoothing)
        if self.teacher is None:
            return loss
        with torch.no_grad():
            teacher_logits = call_model(self.teacher, inputs)
        self.teacher_logits = teacher_logits
        soft = soft_cross_entropy(logits, teacher_logits, temperature=self.tau)
        return (1.0 - self.weight) * loss + self.weight * soft

    def teacher_diverged(self) -> bool:
        """Whether the teacher's last output held NaN or inf (checked only once a loss is
        non-finite: no host sync per step)."""
        return self.teacher_logits is not None and not bool(self.teacher_logits.isfinite().all())


def _query_sampler(cfg: RunConfig, model: nn.Module, seed: int):
    """Query Masking: one K per batch, the same on every process (same generator seed)."""
    if not cfg.train.query_masking:
        return None, None
    num_queries = query_budget(model, needed_by="train.query_masking")
    generator = torch.Generator().manual_seed(seed + 7919)

    def sample() -> dict[str, Any]:
        k = sample_num_queries(num_queries, generator=generator, distribution=cfg.train.query_distribution)
        return {"num_queries": k}

    return sample, generator


def _write_config(out_dir: Path, cfg: RunConfig, model_options: dict[str, Any]) -> None:
    resolved = to_dict(cfg)
    resolved["model_options"] = plain_options(model_options)
    atomic_write_bytes(out_dir / CONFIG_NAME, yaml.safe_dump(resolved, sort_keys=False).encode())


def _check_forward(
    model: nn.Module,
    loss_fn: _LossFn,
    dataset: Any,
    device: torch.device,
    *,
    num_classes: int,
    task: str,
    batch_sizes: tuple[int, int],
) -> None:
    """One forward pass and loss on one training example, before anything is written: a
    model that does not fit the data (an image size the patch size does not divide, fewer
    outputs than the data has classes) or a teacher that does not fit the student fails
    here, not after the run folder exists, and so does a batch the machine's memory cannot
    hold. The RNG is restored, so training is unchanged."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        inputs, target = default_collate([dataset[0]])
        inputs, target = to_device(inputs, device), target.to(device)
        was_training = model.training
        model.eval()
        try:
            logits = call_model(model, inputs)
        finally:
            model.train(was_training)
        # A batch without the highest labels would pass cross-entropy and fail mid-epoch.
        if task == "semantic":
            check_label_map_logits(logits, target, num_classes)
        elif logits.shape[-1] < num_classes:
            raise ValueError(
                f"the model gives {logits.shape[-1]} class scores, but the data has {num_classes} "
                "classes (is num_classes set in the model options?)"
            )
        loss_fn(logits, target, inputs)
    leaves = torch.utils._pytree.tree_leaves(inputs)
    _check_batch_memory(
        model,
        lambda: loss_fn(call_model(model, inputs), target, inputs),
        input_bytes=sum(x.numel() * x.element_size() for x in leaves if isinstance(x, Tensor)),
        batch_sizes=batch_sizes,
        device=device,
    )


def _check_batch_memory(
    model: nn.Module,
    run_example: Callable[[], Any],
    *,
    input_bytes: int,
    batch_sizes: tuple[int, int],
    device: torch.device,
) -> None:
    """Refuse a training or evaluation batch too large for the machine, measured on one
    example (``run_example``: its forward pass and loss): a training example keeps its
    activations for the backward pass, an evaluation example only the largest of them."""
    from leanformer.memory_budget import check_batch_fits

    was_training = model.training
    model.eval()  # a training-mode pass would move batch-norm statistics
    try:
        with torch.random.fork_rng(devices=[]):
            for what, batch, keeps_activations in (
                ("data.batch_size", batch_sizes[0], True),
                ("data.eval_batch_size", batch_sizes[1], False),
            ):
                with torch.set_grad_enabled(keeps_activations):
                    check_batch_fits(
                        run_example, input_bytes=input_bytes, batch_size=batch, what=what, device=device
                    )
    finally:
        model.train(was_training)


def _stop_message(
    loss: Tensor, epoch: int, step: int, out: Path | None, *, discarded: bool, teacher: str | None = None
) -> str:
    """Why training stopped, naming the checkpoint to go back to only if there is one, and
    the ``teacher`` when its output was what became non-finite."""
    message = f"loss became {loss.item()} at epoch {epoch + 1}, step {step + 1}; training stopped"
    if teacher is not None:
        message = (
            f"the teacher {teacher} gave NaN or inf scores at epoch {epoch + 1}, step {step + 1} "
            "(the student's loss followed); training stopped"
        )
    if out is not None and (out / CHECKPOINT_NAME).is_file():
        return f"{message}; the last good checkpoint is {out / CHECKPOINT_NAME}"
    if out is not None:
        message += "; no checkpoint was written"
    if discarded:
        message += f", and {out} keeps nothing of this run"
    # Diverging in the first epoch is nearly always a learning rate far too high.
    return message + (" (is the learning rate too high?)" if epoch == 0 and teacher is None else "")


def fit(
    cfg: RunConfig,
    *,
    out_dir: str | Path | None = None,
    progress: bool = True,
    resume: bool = False,
    overwrite: bool = False,
    stop_after_epochs: int | None = None,
) -> FitResult:
    """Train ``cfg.model`` on ``cfg.data``; evaluate on the test split after every epoch.

    ``out_dir`` must not hold a run already unless ``resume`` (continue it) or
    ``overwrite`` (replace it) is set. Nothing is written there before the config, the data
    and the model have been checked (one forward pass). ``stop_after_epochs`` ends this
    call early (as an interruption would), leaving a checkpoint that ``resume=True``
    continues from.
    """
    _validate(cfg)
    out = Path(out_dir) if out_dir is not None else None
    # Only the process that writes the folder holds it (rank 0 of a torchrun launch).
    holds = out is not None and is_main_process()
    with locked_folder(out) if holds and out is not None else contextlib.nullcontext():
        return _fit(
            cfg,
            out=out,
            progress=progress,
            resume=resume,
            overwrite=overwrite,
            stop_after_epochs=stop_after_epochs,
        )


def _fit(
    cfg: RunConfig,
    *,
    out: Path | None,
    progress: bool,
    resume: bool,
    overwrite: bool,
    stop_after_epochs: int | None,
) -> FitResult:
    if resume and overwrite:
        raise ValueError("resume continues the run in the folder and overwrite replaces it: give one")
    if resume and out is None:
        raise ValueError("resume needs the run folder (--out) of the run to continue")
    if out is not None and not resume:
        check_new_run_folder(out, overwrite=overwrite)
    # Nothing to resume is fine (the run stopped before its first checkpoint), but
    # metrics of finished epochs without their checkpoint would be lost by a restart.
    if resume and out is not None and not (out / CHECKPOINT_NAME).exists() and read_metrics(out):
        raise ValueError(
            f"resume: {out} has epochs in metrics.jsonl but no {CHECKPOINT_NAME} to continue "
            "from; restore the checkpoint, or move the folder away to start over"
        )
    dist_info: DistInfo = setup_distributed(cfg.device)
    device = dist_info.device
    try:
        train_set = build_split(cfg.data, "train")
        info = train_set.info  # type: ignore[attr-defined]
        task: str = info.task
        detection = task == "detection"
        if task not in ("classification", "detection", "semantic"):
            raise ValueError(
                f"train: {cfg.data.name} is a {task} data set; `leanformer train` trains "
                "classifiers, detectors and semantic segmenters"
            )
        if detection:
            refuse_label_recipe_options(cfg, data_kind="detection", targets="boxes")
        if task == "semantic":
            refuse_label_recipe_options(cfg, data_kind="semantic segmentation", targets="label map")
        train_set = with_recipe_augmentation(train_set, cfg.aug)
        test_set = _eval_split(cfg)
        torch.manual_seed(cfg.seed)  # identical initial weights on every process
        model, model_options = build_model(cfg.model, cfg.model_options, info)
        model.to(device)
        _initialise_from(model, cfg, info, device)
        loader = train_loader(
            train_set,
            batch_size=cfg.data.batch_size,
            seed=cfg.seed,
            rank=dist_info.rank,
            world_size=dist_info.world_size,
            num_workers=cfg.data.num_workers,
            collate_fn=collate_detection if detection else None,
        )
        test_loader = eval_loader(
            test_set, batch_size=cfg.data.eval_batch_size, num_workers=cfg.data.num_workers
        )
        steps_per_epoch = len(loader)
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = StepSchedule(optimizer, cfg.optim, steps_per_epoch)
        mix = build_mixup(cfg.aug, label_smoothing=cfg.train.label_smoothing, num_classes=info.num_classes)
        ema = build_ema(model, cfg.train)
        loss_fn = _LossFn(cfg, _build_teacher(cfg, info, device))
        sample_kwargs, query_gen = _query_sampler(cfg, model, cfg.seed)
        if detection:
            _check_detector(
                model, train_set, device, batch_sizes=(cfg.data.batch_size, cfg.data.eval_batch_size)
            )
        else:
            _check_forward(
                model,
                loss_fn,
                train_set,
                device,
                num_classes=info.num_classes,
                task=task,
                batch_sizes=(cfg.data.batch_size, cfg.data.eval_batch_size),
            )
        # Dropout / drop-path randomness differs per process, as in any DDP run.
        torch.manual_seed(cfg.seed * 1000 + 1 + dist_info.rank)

        start_epoch, history = 0, cast(list[dict[str, Any]], [])
        if resume and out is not None and (out / CHECKPOINT_NAME).exists():
            ckpt = load_checkpoint(out / CHECKPOINT_NAME)
            check_resume(
                ckpt.meta.get("config", {}),
                cfg,
                saved_model_options=ckpt.meta.get("model_options", {}),
                model_options=model_options,
                without_effect=[f"train.{key}" for key, *_ in _ignored_options(cfg.train)],
            )
            # One random state per process of the run; every rank checks, so all stop.
            saved_states = ckpt.extra["torch_rng"]
            if dist_info.world_size > len(saved_states):
                raise ValueError(
                    f"resume: the run in {out} was trained by {len(saved_states)} process(es), which "
                    f"hold its random states: resume it with at most that many, not {dist_info.world_size}"
                )
            if "updates" not in (ckpt.scheduler_state or {}):
                raise ValueError(
                    f"resume: the run in {out} was saved by an older leanformer whose learning-rate "
                    "schedule differs from timm's; train it again (--overwrite) to continue with this version"
                )
            if ema is not None and "ema" not in ckpt.extra:
                raise ValueError(
                    f"resume: the run in {out} kept no EMA of its weights; resume it without --ema"
                )
            model.load_state_dict(ckpt.model_state)
            optimizer.load_state_dict(ckpt.optimizer_state)  # type: ignore[arg-type]
            start_epoch = int(ckpt.meta["epoch"])
            # The rate is a function of the update count (and of the epochs, which may grow).
            scheduler.at(start_epoch * steps_per_epoch)
            if ema is not None:
                ema.module.load_state_dict(ckpt.extra["ema"])
            torch.set_rng_state(saved_states[dist_info.rank])
            if query_gen is not None:
                query_gen.set_state(ckpt.extra["query_rng"])
            history = recover(out) if dist_info.is_main else list(ckpt.meta.get("history", []))
        elif out is not None and dist_info.is_main:
            out.mkdir(parents=True, exist_ok=True)
            clear_run(out)  # what a resume found nothing to continue from, or --overwrite

        def uncommitted() -> bool:
            # No epoch saved by this call, nor by the run it resumes (whose history may be
            # empty: a checkpoint of an older version without metrics.jsonl).
            return start_epoch == 0 and not history

        try:
            end_epoch = cfg.optim.epochs
            if stop_after_epochs is not None:
                end_epoch = min(end_epoch, start_epoch + stop_after_epochs)
            if out is not None and dist_info.is_main and end_epoch > start_epoch:
                # Not for a finished run resumed (nothing trains): its config describes it.
                _write_config(out, cfg, model_options)
            train_model: nn.Module = model
            if dist_info.enabled:
                train_model = DistributedDataParallel(
                    model, device_ids=[device.index] if device.type == "cuda" else None
                )

            show = progress and dist_info.is_main
            metrics: dict[str, float] = history[-1] if history else {}
            epochs = progress_bar(range(start_epoch, end_epoch), desc="epochs", show=show)
            for epoch in epochs:
                loader.batch_sampler.set_epoch(epoch)  # type: ignore[union-attr]
                train_model.train()
                started = time.perf_counter()
                loss_sum = torch.zeros((), dtype=torch.float64, device=device)
                batches = progress_bar(loader, desc=f"epoch {epoch + 1}", show=show, leave=False)
                for step, (inputs, target) in enumerate(batches):
                    inputs = to_device(inputs, device)
                    if detection:
                        with autocast_for(device, cfg.train.precision):
                            loss = detection_loss(train_model, inputs, targets_to(target, device))
                    else:
                        target = target.to(device)
                        kwargs = sample_kwargs() if sample_kwargs is not None else {}
                        if mix is not None:
                            inputs, target = mix(inputs, target)
                        with autocast_for(device, cfg.train.precision):
                            logits = call_model(train_model, inputs, **kwargs)
                            loss = loss_fn(logits, target, inputs)
                    # One host sync per step: a diverged run must stop before it overwrites anything.
                    if not torch.isfinite(loss).item():
                        discard = out is not None and dist_info.is_main and uncommitted()
                        teacher = cfg.train.teacher if loss_fn.teacher_diverged() else None
                        message = _stop_message(loss, epoch, step, out, discarded=discard, teacher=teacher)
                        raise NonFiniteLossError(message)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    if cfg.train.grad_clip is not None:
                        nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
                    optimizer.step()
                    scheduler.step()
                    if ema is not None:
                        ema.update(model, step=scheduler.updates)
                    loss_sum += loss.detach().double()
                if dist_info.enabled:
                    # Each process saw half of every global batch: report the global mean.
                    dist.all_reduce(loss_sum)
                    loss_sum /= dist_info.world_size
                train_loss = loss_sum.item() / max(1, steps_per_epoch)
                if dist_info.is_main:
                    seconds = time.perf_counter() - started
                    metrics = {"epoch": epoch + 1, "train_loss": train_loss}
                    metrics |= _scores(model, test_set, test_loader, cfg, device, info)
                    metrics |= {"lr": float(scheduler.get_last_lr()[0]), "epoch_seconds": seconds}
                    if ema is not None:
                        ema_scores = _scores(ema.module, test_set, test_loader, cfg, device, info)
                        metrics.update({f"{key}_ema": value for key, value in ema_scores.items()})
                    history.append(metrics)
                    headline = HEADLINE_SCORE[task]
                    epochs.set_postfix({headline: f"{metrics[headline]:.1f}", "loss": f"{train_loss:.3f}"})
                rng_states = _gather_rng(dist_info)
                if out is not None and dist_info.is_main:
                    # The checkpoint's rename commits the epoch; the views follow it.
                    if cfg.train.checkpoint:
                        extra: dict[str, Any] = {"torch_rng": rng_states}
                        if query_gen is not None:
                            extra["query_rng"] = query_gen.get_state()
                        if ema is not None:
                            extra["ema"] = ema.module.state_dict()
                        save_checkpoint(
                            out / CHECKPOINT_NAME,
                            model=model,
                            optimizer=optimizer,
                            scheduler=scheduler,
                            meta={
                                "model_name": cfg.model,
                                "model_options": plain_options(model_options),
                                "epoch": epoch + 1,
                                "config": to_dict(cfg),
                                "metrics": metrics,
                                "history": history,
                            },
                            extra=extra,
                        )
                    write_metrics(out, history)
                    remove_stale_temporaries(out)
                barrier(dist_info)
        except Exception:
            # Nothing committed yet (a diverged loss, a failure in the first epoch): leave
            # no half-run behind, so the same command, mended, needs no --overwrite.
            if out is not None and dist_info.is_main and uncommitted():
                discard_uncommitted_run(out)
            raise
        return FitResult(
            model=model, metrics=metrics, history=history, model_options=model_options, out_dir=out
        )
    finally:
        cleanup_distributed(dist_info)


# The score an epoch's progress bar shows, by the data's task.
HEADLINE_SCORE = {"classification": "top1", "detection": "ap", "semantic": "miou"}


def _scores(
    model: nn.Module, dataset: Any, loader: Any, cfg: RunConfig, device: torch.device, info: Any
) -> dict[str, float]:
    """An epoch's scores on the evaluation split: ``top1`` and ``test_loss`` of a classifier,
    ``ap``, ``ap50`` and ``ap75`` of a detector, ``miou``, ``pixel_accuracy`` and
    ``test_loss`` of a semantic segmenter."""
    if info.task == "detection":
        return detection_scores(model, dataset, batch_size=cfg.data.eval_batch_size, device=device)
    scores = label_scores(model, loader, info=info, device=device)
    return {k: v for k, v in scores.items() if k not in ("loss", "n")} | {"test_loss": scores["loss"]}


def _check_detector(
    model: nn.Module, dataset: Any, device: torch.device, *, batch_sizes: tuple[int, int]
) -> None:
    """A detector's loss on one training example, before anything is written (a model that
    is not a detector, or targets it cannot read, fail here), and the batches measured
    against the machine's memory as a classifier's are. The RNG is restored."""
    images, targets = collate_detection([dataset[0]])
    images, targets = images.to(device), targets_to(targets, device)
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            detection_loss(model, images, targets)
    finally:
        model.train(was_training)
    _check_batch_memory(
        model,
        lambda: detection_loss(model, images, targets),
        input_bytes=images.numel() * images.element_size(),
        batch_sizes=batch_sizes,
        device=device,
    )


def _eval_split(cfg: RunConfig) -> Any:
    """The split evaluated after every epoch (``train.eval_split``), read without augmentation."""
    split = cfg.train.eval_split
    if split == "train":
        raise ValueError("train.eval_split: evaluate on a held-out split (test, or val), not on train")
    try:
        return build_split(cfg.data, split, evaluation=True)
    except ValueError as err:
        raise ValueError(f"train.eval_split {split!r}: {err}") from None


def _gather_rng(info: DistInfo) -> list[Tensor]:
    """Every process's CPU RNG state (rank order), so a resumed DDP run continues exactly."""
    state = torch.get_rng_state()
    if not info.enabled:
        return [state]
    states = [torch.empty_like(state) for _ in range(info.world_size)]
    dist.all_gather(states, state)
    return states
