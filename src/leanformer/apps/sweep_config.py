"""The configuration of a trade-off sweep: its fields (the keys of a sweep YAML file, some
with a command-line flag), their checks, and the list of points a sweep measures.

Kept apart from :mod:`leanformer.apps.tradeoff`, which runs a sweep, so that the command
line can declare its flags from these fields without loading the sweep's machinery.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leanformer.apps.gflops_budget import gflops_label, is_gflops_budget
from leanformer.config import DataConfig, check_seed, comma_list, flag, from_dict, read_yaml_mapping
from leanformer.device import check_device
from leanformer.models.pretrained import model_card
from leanformer.pooling.budgets import check_gflops_budget, parse_gflops_text, parse_keep
from leanformer.pooling.registry import METHODS, list_methods, pooling_method


def keep_value(text: str) -> Any:
    """``--budget``: checked by :func:`parse_keep` (or read as a GFLOPs budget, ``g0.5``),
    kept as the plain value a sweep file would hold, because it names the point in
    ``results.jsonl`` and ``sweep.json``."""
    gflops = parse_gflops_text(text)
    if gflops is not None:
        return gflops
    try:
        return parse_keep(text).to_value()
    except ValueError as err:
        if text.strip()[:1] in ("g", "G"):  # "g", "gabc": a GFLOPs budget half written
            raise ValueError(f"{err}; a GFLOPs budget is written g<fraction>, e.g. g0.5") from None
        raise


BASELINE = "none"
# ToMe (the method `tome`) in its own budget form, a constant r tokens removed per block
# (tome_r: {"r": r}), drawn as its own line so it can be read against every method at the
# same GFLOPs.
TOME = "tome"


@dataclass(frozen=True)
class SweepConfig:
    """One trade-off sweep (YAML keys are these field names)."""

    name: str = "tradeoff"
    # Exactly one base model source:
    checkpoint: str | None = None  # a leanformer checkpoint (.safetensors)
    model: str | None = None  # a registry model: trained first with `train`, else its shipped weights
    pretrained: bool = False  # model: load the weights shipped with leanformer (no training)
    timm_model: str | None = None  # a timm ViT/DeiT name
    timm_options: dict[str, Any] = field(default_factory=dict)  # kwargs for timm.create_model
    train: dict[str, Any] = field(default_factory=dict)  # RunConfig sections (optim, train, ...) for `model`
    data: DataConfig = field(default_factory=DataConfig)
    # list of method names (default: every method)
    methods: Any = flag(None, "--methods", "comma-separated methods (overrides the config)", comma_list)
    # list of keep values: preset names, ratios, per-block lists, or GFLOPs budgets
    # ({gflops: 0.5, tilt: 0, bend: 0}: see leanformer.apps.gflops_budget)
    budgets: Any = flag(
        None,
        "--budget",
        "a keep value (a ratio such as 0.7, counts 12,8,4, ratios 0.5,0.5, r16 or a preset) or a "
        "GFLOPs fraction (g0.5; g0.36t-1.2 tilts the schedule, g0.36b1 bends it); repeat for several "
        "(overrides the config)",
        keep_value,
        repeat=True,
        metavar="KEEP",
    )
    carry: bool = True
    pool_options: dict[str, Any] = field(default_factory=dict)  # e.g. {max_iters: 5}
    tome_r: Any = None  # list of r: method `tome` in ToMe's form (r tokens removed per block)
    seeds: int = 1  # runs of each random method (random, importance) at each budget, seeds 0..n-1
    finetune_epochs: int = flag(0, "--finetune-epochs", "fine-tune every variant this many epochs")
    finetune_lr: float = 1e-4
    throughput: bool = flag(True, "--no-throughput", "skip the img/s measurement", negate=True)
    throughput_batch_size: int = 32
    throughput_warmup: int = 2
    throughput_runs: int = 5
    compile: bool = flag(
        False,
        "--compile",
        "evaluate and time every variant compiled with torch.compile(fullgraph=True) (config: compile: true)",
    )
    # What the model does, and so what each point scores: top-1 of a classifier, mIoU of a
    # semantic segmenter (whose reducers unpool). None: what the data set is for.
    task: str | None = flag(
        None, "--task", "classification or segmentation (default: what the data set is for)", str
    )
    seed: int = 0
    device: str = "cpu"


# A sweep's task -> the data task it measures.
SWEEP_TASKS = {"classification": "classification", "segmentation": "semantic"}


def score_key(row: Mapping[str, Any]) -> str:
    """The score a sweep row leads with: ``miou`` for a segmentation sweep's, ``top1`` otherwise."""
    return "miou" if "miou" in row else "top1"


def load_sweep_config(path: str | Path, overrides: dict[str, Any] | None = None) -> SweepConfig:
    data = read_yaml_mapping(path, "sweep config")
    return sweep_config_from_dict({**data, **(overrides or {})})


def sweep_config_from_dict(data: dict[str, Any]) -> SweepConfig:
    budgets = data.get("budgets")
    if isinstance(budgets, list | str):
        # The command line's g0.5 spelling, written in a sweep file, means the same budget.
        data = {
            **data,
            "budgets": [
                _gflops_text_as_budget(b) for b in (budgets if isinstance(budgets, list) else [budgets])
            ],
        }
    cfg = from_dict(SweepConfig, data)
    validate(cfg)
    return cfg


def validate(cfg: SweepConfig) -> None:
    """Raise ``ValueError`` for anything the sweep would trip over half-way."""

    # The name is the default output folder, runs/<name>: a path there would write elsewhere.
    if not cfg.name or cfg.name == "." or any(bad in cfg.name for bad in ("/", "\\", "..")):
        raise ValueError(
            f"name: {cfg.name!r} must be a plain folder name (the default output is runs/<name>); "
            "it may not contain path separators or '..' (use --out for another folder)"
        )
    if cfg.task is not None and cfg.task not in SWEEP_TASKS:
        raise ValueError(f"task: must be one of {', '.join(SWEEP_TASKS)}, got {cfg.task!r}")
    sources = [s for s in (cfg.checkpoint, cfg.model, cfg.timm_model) if s]
    if len(sources) != 1:
        raise ValueError("a sweep needs exactly one of checkpoint:, model: or timm_model:")
    if cfg.train and not cfg.model:
        raise ValueError("train: only applies to model: (a checkpoint or timm model is used as it is)")
    if cfg.pretrained and (not cfg.model or cfg.train):
        raise ValueError("pretrained: true applies to model: without train: (the shipped weights are used)")
    if cfg.timm_options and not cfg.timm_model:
        raise ValueError("timm_options: only applies to timm_model: (a checkpoint or model: ignores it)")

    if not _listed_methods(cfg):
        raise ValueError(
            "methods: is empty; name the methods to compare (or none, for the unpooled model alone)"
        )
    for m in methods_of(cfg):
        try:
            pooling_method(m)
        except ValueError as err:
            raise ValueError(f"methods: {err}") from None

    accepted = {o for m in methods_of(cfg) for o in METHODS[m].options}
    stray = sorted(set(cfg.pool_options) - accepted)
    if stray:
        raise ValueError(f"pool_options {', '.join(stray)} are not options of any requested method")
    seeded = [m for m in methods_of(cfg) if m in SEEDED_METHODS]
    if "seed" in cfg.pool_options and seeded:
        # Their points draw from seeds 0 .. seeds - 1 in turn: a fixed one would be replaced.
        raise ValueError(
            f"pool_options: seed would be replaced for {', '.join(seeded)}, whose points take the "
            "seeds 0 .. seeds - 1 (seeds:); sweep them without it"
        )
    for r in tome_rs(cfg):
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"tome_r: must hold integers >= 1 (tokens removed per block), got {r!r}")
    by_label: dict[str, Any] = {}
    for keep in budgets_of(cfg):
        if is_gflops_budget(keep):
            check_gflops_budget(keep)
        label = budget_label(keep)
        if label in by_label:
            # A point is keyed by its label (results, tables, --resume): two budgets with
            # one label would be measured twice and shown as seeds, or overwrite each other.
            raise ValueError(
                f"budgets: {by_label[label]!r} and {keep!r} are both the point {label}; give each budget once"
            )
        by_label[label] = keep
    if not budgets_of(cfg) and any(m != BASELINE for m in methods_of(cfg)):
        raise ValueError("budgets: is empty; give keep values (preset names, ratios or per-block lists)")
    if cfg.finetune_epochs < 0 or cfg.throughput_runs < 1 or cfg.throughput_batch_size < 1 or cfg.seeds < 1:
        raise ValueError(
            "finetune_epochs must be >= 0, seeds, throughput_runs and throughput_batch_size >= 1"
        )
    check_seed(cfg.seed)
    check_device(cfg.device, source="device")
    if cfg.pretrained:
        model_card(cfg.model)  # type: ignore[arg-type]


def _listed_methods(cfg: SweepConfig) -> list[str]:
    methods = cfg.methods if cfg.methods is not None else list_methods()
    if isinstance(methods, str):
        methods = comma_list(methods)
    if not isinstance(methods, list) or not all(isinstance(m, str) for m in methods):
        raise ValueError(f"methods: must be a list of method names, got {methods!r}")
    return methods


def methods_of(cfg: SweepConfig) -> list[str]:
    # The baseline is always measured once, first: every other point is read against it.
    return [BASELINE] + [m for m in dict.fromkeys(_listed_methods(cfg)) if m != BASELINE]


def method_options(cfg: SweepConfig, method: str) -> dict[str, Any]:
    """The ``pool_options`` that ``method`` takes (e.g. ``max_iters`` only reaches clustering)."""
    spec = METHODS[method]
    return {k: v for k, v in cfg.pool_options.items() if k in spec.options}


def _gflops_text_as_budget(keep: Any) -> Any:
    if isinstance(keep, str):
        try:
            gflops = parse_gflops_text(keep)
        except ValueError as err:
            raise ValueError(f"budgets: {err}") from None
        if gflops is not None:
            return gflops
    return keep


def budgets_of(cfg: SweepConfig) -> list[Any]:
    budgets = cfg.budgets if cfg.budgets is not None else []
    if not isinstance(budgets, list):
        budgets = [budgets]
    return budgets


def tome_rs(cfg: SweepConfig) -> list[Any]:
    rs = cfg.tome_r if cfg.tome_r is not None else []
    return rs if isinstance(rs, list) else [rs]


def budget_label(keep: Any) -> str:
    """The name of a sweep budget in results and tables: a string as written in the sweep
    file (a preset name, ``r16``), else :meth:`KeepSchedule.label` (``r0.7``, ``64-48-32``,
    ``16/block``)."""
    if isinstance(keep, str):
        return keep
    if is_gflops_budget(keep):
        return gflops_label(keep)
    try:
        return parse_keep(keep).label()
    except ValueError:
        return str(keep)  # a budget the model refuses is named in its own error message


# Methods whose result depends on a random draw: measured once per seed.
SEEDED_METHODS = ("random", "importance")


def sweep_points(cfg: SweepConfig) -> list[tuple[str, Any, int | None]]:
    """``(method, keep, seed)`` for every point, ``tome_r`` last (as method ``tome``); the
    baseline has ``keep=None``; ``seed`` is None for deterministic methods and
    ``0 .. seeds-1`` for the random ones."""
    points: list[tuple[str, Any, int | None]] = []
    for method in methods_of(cfg):
        if method == BASELINE:
            points.append((method, None, None))
            continue
        seeds: list[int | None] = list(range(cfg.seeds)) if method in SEEDED_METHODS else [None]
        points.extend((method, keep, seed) for keep in budgets_of(cfg) for seed in seeds)
    points.extend((TOME, {"r": r}, None) for r in tome_rs(cfg))
    return points
