"""Accuracy vs GFLOPs vs throughput for every token-reduction method on one model.

A sweep takes one base model — a trained leanformer checkpoint, a registry model
trained here first, or a timm ViT/DeiT — and evaluates every requested method at every
requested budget on the same data, optionally after a short fine-tune of each variant.
Each point records top-1, GFLOPs per image (multiply-adds, as the papers count) and
measured images/s. Results go to ``results.jsonl``, ``table.md`` and ``tradeoff.png``
(one line per method, the paper's figure 3 style).

Every variant is a deep copy of the base model with reducers inserted by
:func:`leanformer.apply_token_pooling` (the host adapter every DeiT and timm ViT goes
through), so nothing is retrained unless ``finetune_epochs > 0``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from leanformer.apps.gflops_budget import gflops_label, is_gflops_budget
from leanformer.apps.plots import plot_tradeoff
from leanformer.apps.sweep_config import (
    BASELINE,
    SWEEP_TASKS,
    SweepConfig,
    budget_label,
    budgets_of,
    method_options,
    methods_of,
    score_key,
    sweep_points,
    validate,
)
from leanformer.apps.table import Column
from leanformer.apps.table import markdown_table as render_table
from leanformer.bench.compiled import compile_for_inference
from leanformer.bench.flops import count_gflops
from leanformer.bench.reliability import marked, remeasure_note
from leanformer.bench.throughput import measure_throughput
from leanformer.config import RunConfig, from_dict
from leanformer.data.loaders import eval_loader, train_loader
from leanformer.engine.builders import build_model, build_split
from leanformer.engine.checkpoint import load_model, resolve_checkpoint
from leanformer.engine.folder_lock import locked_folder
from leanformer.engine.run_folder import clear_run
from leanformer.engine.segmentation_train import label_scores
from leanformer.engine.train import fit
from leanformer.models.pretrained import file_sha256
from leanformer.models.registry import model_info
from leanformer.patch.api import adapt, apply_token_pooling, is_patched, remove_token_pooling
from leanformer.patch.timm import create_timm_model
from leanformer.pooling.budgets import KeepSchedule, check_gflops_budget
from leanformer.pooling.gflops import solve_gflops
from leanformer.pooling.registry import NothingPlaced
from leanformer.progress import progress_bar

# --- base model -------------------------------------------------------------------------


def load_base_model(
    cfg: SweepConfig, *, out_dir: Path | None = None, progress: bool = True, resume: bool = False
) -> nn.Module:
    """The model every variant is copied from (trained, loaded or built). ``resume``
    continues (or reloads) the base model's training run in ``out_dir/base``."""
    if cfg.checkpoint:
        return load_model(cfg.checkpoint, device=cfg.device)
    if cfg.timm_model:
        return create_timm_model(cfg.timm_model, **cfg.timm_options).to(cfg.device)
    assert cfg.model is not None
    run_cfg = base_run_config(cfg)
    if cfg.train:
        base_dir = None if out_dir is None else out_dir / "base"
        result = fit(run_cfg, out_dir=base_dir, progress=progress, resume=resume and base_dir is not None)
        return result.model
    return untrained_base_model(cfg, pretrained=cfg.pretrained).to(cfg.device)


def base_run_config(cfg: SweepConfig) -> RunConfig:
    """The training run of ``model:``: its ``train:`` sections on the sweep's data."""
    train = dict(cfg.train)
    for key in ("model", "data"):
        if key in train:
            raise ValueError(f"train: must not set {key!r}; the sweep's {key}: is used")
    run = from_dict(RunConfig, {"model": cfg.model, "seed": cfg.seed, "device": cfg.device, **train})
    return replace(run, data=cfg.data)


# --- variants ----------------------------------------------------------------------------


def with_method(
    base: nn.Module, method: str, keep: Any, *, carry: bool, options: dict[str, Any]
) -> nn.Module:
    """A deep copy of ``base`` with ``method`` at budget ``keep`` in every block.

    Any pooling the base already has is removed first, so ``BASELINE`` is the plain model.
    A segmenter's reducers unpool: its head reads every patch position.
    """
    model = copy.deepcopy(base)
    if is_patched(model):
        remove_token_pooling(model)
    if method == BASELINE:
        return model
    check_poolable(type(model))
    unpool = getattr(model, "task", None) == "semantic"
    return apply_token_pooling(model, keep=keep, method=method, carry=carry, unpool=unpool, **options)


def check_sweep_task(cfg: SweepConfig, info: Any) -> None:
    """Refuse data a sweep cannot score (neither classes nor label maps), and a ``task:``
    that is not what the data set is for."""
    hint = " (fashion_detect gives label maps with the data option target: semantic)"
    found = next((name for name, data_task in SWEEP_TASKS.items() if data_task == info.task), None)
    if found is None:
        raise ValueError(
            f"a sweep measures classifiers and semantic segmenters; {cfg.data.name} is a "
            f"{info.task} data set" + (hint if info.task == "detection" else "")
        )
    if cfg.task is not None and cfg.task != found:
        raise ValueError(
            f"task: {cfg.task}, but {cfg.data.name} as configured is a {found} data set"
            + (hint if cfg.task == "segmentation" else "")
        )


def check_timm_fits_data(model: nn.Module, info: Any) -> None:
    """A timm ViT built with ``timm_options`` must take the data's channels, classes and size."""
    if not isinstance(model, VisionTransformer):
        return  # leanformer models take these from the data when they are built
    embed = model.patch_embed
    found = {
        "in_chans": embed.proj.in_channels,
        "num_classes": model.num_classes,
        "img_size": embed.img_size[0] if embed.strict_img_size and embed.img_size else None,
    }
    wanted = {"in_chans": info.in_chans, "num_classes": info.num_classes, "img_size": info.img_size}
    wrong = [
        f"{k}={found[k]} (data: {v})"
        for k, v in wanted.items()
        if None not in (v, found[k]) and found[k] != v
    ]
    if wrong:
        raise ValueError(
            f"the timm model does not fit the data: {', '.join(wrong)}; set them in timm_options"
        )


def check_poolable(cls: type[nn.Module]) -> None:
    """Token pooling needs a host whose blocks run on patch tokens: a DeiT or a timm ViT
    (any host :func:`leanformer.apply_token_pooling` takes).

    A Perceiver's blocks, say, run on its latent queries, which have no token grid and
    must not be pooled as if they did.
    """
    if not issubclass(cls, VisionTransformer) and not cls.__module__.startswith("transformers."):
        raise ValueError(
            f"token pooling applies to DeiT models, timm ViTs and Hugging Face ViTs, not to {cls.__name__}"
            + (
                " (`leanformer perceiver-eval` sweeps its number of queries)"
                if "Perceiver" in cls.__name__
                else ""
            )
        )


def finetune(model: nn.Module, loader: Any, *, epochs: int, lr: float, device: str) -> nn.Module:
    """A short AdamW fine-tune (cross-entropy, per pixel for a segmenter; cosine decay) of
    one variant, in place."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.05)
    steps = max(1, epochs * len(loader))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    for _ in range(epochs):
        for images, target in loader:
            loss = F.cross_entropy(model(images.to(device)), target.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
    return model.eval()


# --- measuring ---------------------------------------------------------------------------


def timing_batch(loader: Any, batch_size: int, device: str) -> Tensor:
    """A real input batch of exactly ``batch_size`` images (repeated if the data is small)."""
    images = next(iter(loader))[0]
    if images.shape[0] < batch_size:
        images = images.repeat(-(-batch_size // images.shape[0]), *([1] * (images.ndim - 1)))
    return images[:batch_size].to(device)


def tokens_out(model: nn.Module, x: Tensor) -> int:
    """Tokens (prefix included) the last block leaves for one input (before unpooling,
    which gives a segmenter's head every position back)."""
    with torch.inference_mode():
        count = int(model.forward_features(x[:1]).shape[1])
    left = getattr(getattr(model, "token_pooling", None), "tokens_left", None)
    return left if isinstance(left, int) else count


def measure_point(
    model: nn.Module, *, loader: Any, batch: Tensor, cfg: SweepConfig, info: Any
) -> dict[str, Any]:
    """GFLOPs, tokens out, the score (top-1, or a segmenter's mIoU and pixel accuracy) and,
    with ``throughput``, img/s of one variant."""
    model.eval()
    row: dict[str, Any] = {}
    # FLOPs and token counts from the eager model; accuracy and speed from what runs.
    row["gflops"] = count_gflops(model, (batch[:4],))
    row["tokens_out"] = tokens_out(model, batch)
    runner = model
    if cfg.compile:
        # One point at a time: the previous points' compiled graphs are dropped first, so a
        # long sweep holds one point's and every point compiles from the same state.
        torch._dynamo.reset()
        runner, row["compile_s"] = compile_for_inference(model, (batch,))
    row |= label_scores(runner, loader, info=info, device=cfg.device)
    if cfg.throughput:
        # Timed right after its evaluation: the load before includes this process's own.
        speed = measure_throughput(
            runner, (batch,), warmup=cfg.throughput_warmup, runs=cfg.throughput_runs, computing_before=True
        )
        for key in (
            "img_per_s",
            "ms_per_batch",
            "spread_pct",
            "load_before",
            "load_after",
            "busy",
            "unreliable",
        ):
            row[key] = speed[key]
    return row


# What a sweep writes in its folder (``base/`` is the run of the base model).
SWEEP_FILES = ("results.jsonl", "table.md", "sweep.json", "tradeoff.png", "base")


def _check_sweep_folder(out: Path, *, overwrite: bool) -> None:
    held = [name for name in SWEEP_FILES if (out / name).exists()]
    if held and not overwrite:
        raise ValueError(
            f"{out} already holds a sweep ({', '.join(held)}); replace it with --overwrite "
            "or choose another --out"
        )


def point_key(method: str, keep: Any, seed: int | None) -> tuple[str, str, int | None]:
    """What names a point in ``results.jsonl``: its method, budget label and seed."""
    return method, budget_label(keep) if keep is not None else "all", seed


def _config_json(cfg: SweepConfig) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(cfg), default=str))


BASE_DIGEST = "checkpoint_sha256"


def sweep_record(cfg: SweepConfig) -> dict[str, Any]:
    """What ``sweep.json`` holds: the config and, for a ``checkpoint:`` base, its file's
    digest, so that ``--resume`` refuses a checkpoint replaced in between (its points
    would be measured on another model than the rows already written)."""
    record = _config_json(cfg)
    if cfg.checkpoint:
        record[BASE_DIGEST] = file_sha256(resolve_checkpoint(cfg.checkpoint))
    return record


def measured_rows(out: Path, cfg: SweepConfig) -> list[dict[str, Any]]:
    """The rows an interrupted sweep in ``out`` measured, for ``--resume``.

    ``out/sweep.json`` must hold ``cfg`` exactly: points measured under another
    configuration would not belong in one table. A last line cut short by the
    interruption is dropped (that point runs again)."""
    stored_path = out / "sweep.json"
    if not stored_path.is_file():
        raise ValueError(f"{out} holds no sweep to resume (no sweep.json); run it without --resume")
    stored, current = json.loads(stored_path.read_text()), sweep_record(cfg)
    if BASE_DIGEST not in stored:  # written before the digest was recorded
        current.pop(BASE_DIGEST, None)
    changed = sorted(k for k in stored.keys() | current.keys() if stored.get(k) != current.get(k))
    if changed == [BASE_DIGEST]:
        raise ValueError(
            f"{out} holds a sweep measured on another version of the checkpoint {cfg.checkpoint} "
            "(its file changed since): restore that file to resume, or replace the sweep with --overwrite"
        )
    if changed:
        raise ValueError(
            f"{out} holds a sweep with other settings ({', '.join(changed)}); resume it with the "
            "same sweep file and flags, or replace it with --overwrite"
        )
    path = out / "results.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.is_file() else []
    points = {point_key(*p) for p in sweep_points(cfg)}
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number < len(lines) or line.endswith("\n"):
                raise ValueError(f"{path}, line {number}: not a result row; the file is damaged") from None
            path.write_text("".join(lines[:-1]))  # the write the interruption cut short
            continue
        if number == len(lines) and not line.endswith("\n"):
            path.write_text("".join(lines) + "\n")  # whole but unterminated: appends start a line
        # A row of another sweep (a file copied or joined in by hand) would stand in the
        # table for a point this sweep never measured.
        key = (row.get("method"), row.get("keep"), row.get("seed")) if isinstance(row, dict) else None
        if key not in points or row.get("sweep") != cfg.name:
            raise ValueError(
                f"{path}, line {number}: not a point of sweep {cfg.name!r}; resume it with its own "
                "results.jsonl, or replace it with --overwrite"
            )
        rows.append(row)
    now = torch.get_num_threads()
    threads = sorted({int(row["threads"]) for row in rows if "threads" in row} - {now})
    if threads and cfg.throughput:
        # img/s and speedups compare only at one thread count.
        raise ValueError(
            f"{path} was measured with {', '.join(map(str, threads))} thread(s), this run has {now}: "
            f"resume it with --threads {threads[0]}, or replace it with --overwrite"
        )
    return rows


def _clear_sweep_folder(out: Path) -> None:
    for name in SWEEP_FILES[:-1]:
        (out / name).unlink(missing_ok=True)
    if (out / "base").is_dir():
        clear_run(out / "base")


def untrained_base_model(cfg: SweepConfig, *, pretrained: bool = False) -> nn.Module:
    """``model:`` as built for the sweep's data, before training: the shape of the base
    (with ``pretrained``, the shipped weights: the base itself)."""
    assert cfg.model is not None
    info = build_split(cfg.data, "test").info  # type: ignore[attr-defined]
    torch.manual_seed(cfg.seed)  # the untrained weights a sweep without train: evaluates
    # The architecture train: builds (its model_options), so the points are checked on it.
    options = dict(base_run_config(cfg).model_options) if cfg.train else {}
    return build_model(cfg.model, options, info, pretrained=pretrained)[0]


def check_points(cfg: SweepConfig, base: nn.Module) -> None:
    """Build every ``(method, budget)`` variant of ``base`` once: a budget the model cannot
    take raises here (naming the point), before any work. GFLOPs budgets are solved (and
    checked) later, on the base model the sweep measures."""
    for method, keep, _ in sweep_points(cfg):
        if is_gflops_budget(keep):
            continue
        try:
            with_method(base, method, keep, carry=cfg.carry, options=method_options(cfg, method))
        except ValueError as err:
            raise ValueError(f"{method} at budget {budget_label(keep)}: {err}") from None


def solve_method_budget(
    base: nn.Module,
    method: str,
    keep: Mapping[str, Any],
    example: Tensor,
    *,
    carry: bool,
    options: dict[str, Any],
    name: str,
) -> Any:
    """The per-block budgets with which ``method`` on ``base`` meets the GFLOPs budget
    ``keep`` (e.g. ``{"gflops": 0.5}``), GFLOPs counted on ``example`` as
    :func:`measure_point` counts them; ``name`` prefixes any error. The library's solver
    (:func:`leanformer.pooling.gflops.solve_gflops`), taking the cheapest point at most
    at the target whatever its distance (the row records the GFLOPs reached): per-block
    keep ratios, or ToMe's ``"r<r>"`` for ``tome``."""
    plain = with_method(base, BASELINE, None, carry=False, options={})
    full = count_gflops(plain, (example,))

    def cost(candidate: KeepSchedule) -> float:
        try:
            variant = with_method(base, method, candidate, carry=carry, options=options)
        except NothingPlaced:  # no reducer at all: the unpooled model
            return 1.0
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        return count_gflops(variant, (example,)) / full

    budget = check_gflops_budget(keep)
    schedule = KeepSchedule(gflops=budget["gflops"], tilt=budget["tilt"], bend=budget.get("bend", 0.0))
    depth, tokens = len(adapt(plain).blocks), adapt(plain).num_tokens
    solved = solve_gflops(schedule, method=method, depth=depth, num_tokens=tokens, cost=cost, tolerance=None)
    return solved.schedule.to_value()


def solve_gflops_budgets(
    cfg: SweepConfig,
    base: nn.Module,
    example: Tensor,
    *,
    points: list[tuple[str, Any]] | None = None,
    progress: bool = False,
) -> dict[tuple[str, str], list[float]]:
    """The per-block keep ratios of every ``(method, GFLOPs budget label)`` point (of
    ``points``, ``(method, keep)`` pairs, when given: those still to measure), solved on
    ``base`` with GFLOPs counted on ``example`` as :func:`measure_point` counts them."""
    if points is None:
        points = [(m, keep) for m in methods_of(cfg) if m != BASELINE for keep in budgets_of(cfg)]
    pairs = list(dict.fromkeys((m, gflops_label(k)) for m, k in points if is_gflops_budget(k)))
    budgets = {gflops_label(k): k for k in budgets_of(cfg) if is_gflops_budget(k)}
    return {
        (method, label): solve_method_budget(
            base,
            method,
            budgets[label],
            example,
            carry=cfg.carry,
            options=method_options(cfg, method),
            name=f"{method} at budget {label}",
        )
        for method, label in progress_bar(pairs, desc="solving GFLOPs budgets", show=progress)
    }


@dataclass
class SweepResult:
    rows: list[dict[str, Any]]
    out_dir: Path | None
    base: nn.Module


def run_sweep(
    cfg: SweepConfig,
    *,
    out_dir: str | Path | None = None,
    progress: bool = True,
    base: nn.Module | None = None,
    overwrite: bool = False,
    resume: bool = False,
) -> SweepResult:
    """Evaluate every ``(method, budget)`` point; write results.jsonl, table.md, tradeoff.png.

    ``base`` skips loading/training the base model (tests, or a model already in memory).
    ``out_dir`` must not hold a sweep's results already unless ``overwrite`` (replace
    them) or ``resume`` (keep the points measured there and run the rest) is set. Every
    point is seeded on its own, so a resumed sweep measures what an uninterrupted one
    would.
    """
    if resume and (overwrite or out_dir is None):
        raise ValueError("resume continues the sweep in its output folder: give the folder, not overwrite")
    validate(cfg)
    out = Path(out_dir) if out_dir is not None else None
    with locked_folder(out) if out is not None else contextlib.nullcontext():
        return _run_sweep(cfg, out=out, progress=progress, base=base, overwrite=overwrite, resume=resume)


def _run_sweep(
    cfg: SweepConfig,
    *,
    out: Path | None,
    progress: bool,
    base: nn.Module | None,
    overwrite: bool,
    resume: bool,
) -> SweepResult:
    if base is None and cfg.model is not None:
        check_poolable(model_info(cfg.model).cls)  # before training it
    done: list[dict[str, Any]] = []
    if out is not None and resume:
        done = measured_rows(out, cfg)
    elif out is not None:
        _check_sweep_folder(out, overwrite=overwrite)
    trains_base = base is None and cfg.model is not None and bool(cfg.train)
    if base is None and not trains_base:
        base = load_base_model(cfg, progress=progress)
    # Every point is built, and every GFLOPs budget solved, before anything is cleared,
    # written or trained: a budget that does not fit the model, or a target out of reach,
    # fails now, with the folder's earlier results intact. A base still to be trained is
    # stood in for by its untrained copy.
    probe = (base if base is not None else untrained_base_model(cfg)).to(cfg.device).eval()
    check_points(cfg, probe)
    test_set = build_split(cfg.data, "test")
    info = test_set.info  # type: ignore[attr-defined]
    check_sweep_task(cfg, info)
    check_timm_fits_data(probe, info)
    test_loader = eval_loader(test_set, batch_size=cfg.data.eval_batch_size)
    batch = timing_batch(test_loader, cfg.throughput_batch_size, cfg.device)
    keys = [point_key(*p) for p in sweep_points(cfg)]
    measured = {(r["method"], r["keep"], r["seed"]): r for r in done}
    todo = [(p, key) for p, key in zip(sweep_points(cfg), keys) if key not in measured]
    # GFLOPs budgets are solved for the points still to measure (none left: none solved).
    pending = [(method, keep) for (method, keep, _), _ in todo if method != BASELINE]
    schedules = solve_gflops_budgets(cfg, probe, batch[:4], points=pending, progress=progress)
    # Built now: data too small for a fine-tuning batch fails before --overwrite clears.
    tune_loader = (
        train_loader(build_split(cfg.data, "train"), batch_size=cfg.data.batch_size, seed=cfg.seed)
        if cfg.finetune_epochs
        else None
    )
    if out is not None and not resume:
        _clear_sweep_folder(out)
        out.mkdir(parents=True, exist_ok=True)
        # Written first, so that an interrupted sweep can be resumed (and checked) later.
        (out / "sweep.json").write_text(json.dumps(sweep_record(cfg), indent=2) + "\n")
    if base is None:
        base = load_base_model(cfg, out_dir=out, progress=progress, resume=resume)
    base = base.to(cfg.device).eval()
    if trains_base:
        # Solved again on the trained weights: a clustering's cost can depend on them.
        schedules = solve_gflops_budgets(cfg, base, batch[:4], points=pending, progress=progress)
    jsonl = (out / "results.jsonl").open("a" if resume else "w") if out is not None else None
    try:
        bar = progress_bar(todo, desc=f"sweep {cfg.name}", show=progress)
        for (method, keep, seed), key in bar:
            bar.set_postfix_str(f"{method} {key[1] if keep is not None else ''}".strip())
            torch.manual_seed(cfg.seed)
            options = method_options(cfg, method) | ({} if seed is None else {"seed": seed})
            schedule = schedules.get((method, key[1])) if is_gflops_budget(keep) else None
            model = with_method(
                base, method, keep if schedule is None else schedule, carry=cfg.carry, options=options
            )
            tuned = False
            if tune_loader is not None and method != BASELINE:
                finetune(
                    model, tune_loader, epochs=cfg.finetune_epochs, lr=cfg.finetune_lr, device=cfg.device
                )
                tuned = True
            row: dict[str, Any] = {
                "sweep": cfg.name,
                "method": method,
                "keep": key[1],
                "keep_value": keep,
                "carry": cfg.carry if method != BASELINE else False,
                "finetuned": tuned,
                "seed": seed,
                **({} if schedule is None else {"keep_schedule": schedule}),
                **measure_point(model, loader=test_loader, batch=batch, cfg=cfg, info=info),
                "threads": torch.get_num_threads(),
            }
            measured[key] = row
            if jsonl is not None:
                jsonl.write(json.dumps(row) + "\n")
                jsonl.flush()
    finally:
        if jsonl is not None:
            jsonl.close()
    # In sweep order, whichever run measured each point.
    rows = [measured[key] for key in keys if key in measured]
    add_relative(rows)
    if out is not None:
        (out / "table.md").write_text(markdown_table(summarise_seeds(rows), title=cfg.name) + "\n")
        plot_tradeoff(summarise_seeds(rows), out / "tradeoff.png", title=cfg.name)
    return SweepResult(rows=rows, out_dir=out, base=base)


def add_relative(rows: list[dict[str, Any]]) -> None:
    """Add, in place, each row's change against the baseline row (method ``none``):
    ``d_top1`` (top-1 points; ``d_miou`` for a segmenter), ``flops_ratio`` (base GFLOPs
    over the row's) and, where both rows hold img/s, ``speedup``. Without a baseline row
    nothing is added."""
    ref = next((r for r in rows if r["method"] == BASELINE), None)
    if ref is None:
        return
    score = score_key(ref)
    for r in rows:
        r[f"d_{score}"] = r[score] - ref[score]
        r["flops_ratio"] = ref["gflops"] / r["gflops"] if r["gflops"] > 0 else float("nan")
        if "img_per_s" in r and "img_per_s" in ref:
            r["speedup"] = r["img_per_s"] / ref["img_per_s"]


def summarise_seeds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per ``(method, keep, finetuned)``: the mean over seeds of every number, and
    ``top1_std`` / ``seeds`` where a random method ran more than once (first-seen order)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["keep"], r.get("finetuned")), []).append(r)
    summary = []
    for members in groups.values():
        row = dict(members[0])
        if len(members) > 1:
            for key, value in row.items():
                if isinstance(value, float) and all(isinstance(m.get(key), float) for m in members):
                    row[key] = sum(m[key] for m in members) / len(members)
            score = score_key(row)
            tops = torch.tensor([m[score] for m in members], dtype=torch.float64)
            row.update({f"{score}_std": float(tops.std()), "seeds": len(members), "seed": None})
            for flag in ("busy", "unreliable"):  # one doubtful timing makes the mean doubtful
                if flag in row:
                    row[flag] = any(m.get(flag) for m in members)
        summary.append(row)
    return summary


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _speed(r: Mapping[str, Any]) -> str:
    """``1705 ±3%`` (half the runs' range over their median), marked when unreliable
    (see :mod:`leanformer.bench.reliability`)."""
    if r.get("img_per_s") is None:
        return "–"
    spread = f" ±{r['spread_pct'] / 2:.0f}%" if r.get("spread_pct") is not None else ""
    return marked(f"{r['img_per_s']:.0f}{spread}", r)


def speed_note(rows: list[dict[str, Any]]) -> str | None:
    """The line that ends a sweep whose throughput figures are not to be trusted, or None."""
    return remeasure_note(rows, lambda r: f"{r['method']} {r['keep']}")


def _score(r: Mapping[str, Any]) -> str:
    score = score_key(r)
    seeds = f" ± {r[score + '_std']:.2f} ({r['seeds']} seeds)" if score + "_std" in r else ""
    return _fmt(r[score], ".2f") + seeds


# The score columns' titles, by score key.
SCORE_TITLES = {"top1": "top-1", "miou": "mIoU"}


def tradeoff_columns(score: str) -> tuple[Column, ...]:
    """The sweep table's columns, led by ``score`` (``top1`` or ``miou``)."""
    title = SCORE_TITLES[score]
    return (
        Column("method", lambda r: r["method"] + (" (ft)" if r.get("finetuned") else "")),
        Column("keep", lambda r: str(r["keep"])),
        Column(f"{title} (%)", _score),
        Column(f"Δ {title}", lambda r: _fmt(r.get(f"d_{score}"), "+.2f")),
        Column("GFLOPs", lambda r: _fmt(r["gflops"], ".4f" if r["gflops"] < 0.1 else ".3f")),
        Column("FLOPs ratio", lambda r: _fmt(r.get("flops_ratio"), ".2f")),
        Column("img/s", lambda r: _speed(r)),
        Column("speedup", lambda r: _fmt(r.get("speedup"), ".2f")),
        Column("tokens out", lambda r: str(r.get("tokens_out", "–"))),
    )


def markdown_table(rows: list[dict[str, Any]], *, title: str | None = None) -> str:
    """Rows grouped by method (baseline first), budgets in sweep order."""
    score = score_key(rows[0]) if rows else "top1"
    return render_table(rows, tradeoff_columns(score), title=title)


def iter_rows(path: str | Path) -> Iterator[dict[str, Any]]:
    """Read back a ``results.jsonl``."""
    with Path(path).open() as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)
