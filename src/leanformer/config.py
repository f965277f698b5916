"""Typed run configuration: frozen dataclasses, YAML presets and dotted overrides.

``load_config(path, overrides)`` reads a YAML file (or the defaults) and applies
``{"optim.lr": "1e-3", "model_options.pool": "wkmedoids"}``-style overrides. Unknown
keys and badly typed values raise ``ValueError`` naming the key and close matches.

An option that also has a command-line flag declares it here, beside its field
(``flag(...)``; ``entry_flags`` for keys of a free-form mapping such as ``model_options``).
:func:`declared_flags` lists them; ``commands/_options.py`` turns them into argparse flags
and the parsed values back into dotted overrides, so a flag, a YAML key and a dotted
override of one option cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from leanformer.pooling.budgets import KEEP_HELP, KeepSchedule, parse_keep
from leanformer.strict_yaml import DuplicateKeyError, safe_load_strict
from leanformer.typed_values import coerce_value, parse_scalar

_FLAG = "leanformer_flag"  # dataclass field metadata keys
_ENTRY_FLAGS = "leanformer_entry_flags"


@dataclass(frozen=True)
class Flag:
    """The command-line flag of one config key (``--lr`` for ``optim.lr``). ``type`` reads
    the typed text: ``bool`` is a switch (on, or off with ``negate``); a callable other than
    ``int``/``float``/``str`` raises ``ValueError`` for a bad value; ``None``: the field's
    annotation. ``repeat``: the flag may be given several times and its values form a list."""

    name: str
    help: str
    type: Any = None
    repeat: bool = False
    negate: bool = False
    metavar: str | None = None


def flag(
    default: Any,
    name: str,
    help: str,
    type: Any = None,
    *,
    repeat: bool = False,
    negate: bool = False,
    metavar: str | None = None,
) -> Any:
    """A dataclass field whose value can also be given as ``name`` on the command line."""
    spec = Flag(name, help, type, repeat=repeat, negate=negate, metavar=metavar)
    return field(default=default, metadata={_FLAG: spec})


def entry_flags(**flags: Flag) -> dict[str, Any]:
    """Field metadata: flags for some keys of a free-form mapping (``model_options``)."""
    return {_ENTRY_FLAGS: flags}


def positive_int(text: str) -> int:
    """An integer >= 1 (``--batch-size``, ``--img-size``)."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


# torch's CPU generator keeps 32 bits of a seed: seeds 2^32 apart (or -1 and 2^32 - 1) ran
# bit-identical, so the range is the one its initial draws tell apart. (Streams derived
# from the seed, e.g. dropout's seed * 1000 + 1 + rank, wrap sooner.)
MAX_SEED = 2**32 - 1


def check_seed(value: int, name: str = "seed") -> int:
    """``value`` if it is a seed in [0, 2^32 - 1]; a ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise ValueError(f"{name} must be an integer from 0 to 2^32 - 1, got {value!r}")
    return value


def seed_argument(text: str) -> int:
    """``--seed``: an integer in [0, 2^32 - 1] (see :data:`MAX_SEED`)."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None
    return check_seed(value, "the seed")


def positive_number(text: str) -> float:
    """A number > 0 (``--lr``)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"must be > 0, got {text}")
    return value


def comma_list(text: str) -> list[str]:
    """``"merge, kmeans"`` -> ``["merge", "kmeans"]`` (``--methods``)."""
    return [item.strip() for item in text.split(",") if item.strip()]


@dataclass(frozen=True)
class DataConfig:
    name: str = flag("digits", "--data", "dataset name (digits, cifar10, imagefolder, digits_pairs, ...)")
    # local folder for cifar10 / imagefolder / paired data
    root: str | None = flag(None, "--data-root", "local folder for datasets read from disk")
    # None: the dataset's default
    img_size: int | None = flag(None, "--img-size", "input image size", positive_int)
    # global batch (split across processes under DDP)
    batch_size: int = flag(64, "--batch-size", "batch size", positive_int)
    eval_batch_size: int = 256
    limit_train: int | None = None  # use only the first N training samples (quick runs, tests)
    limit_test: int | None = None
    num_workers: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # extra dataset builder options


@dataclass(frozen=True)
class OptimConfig:
    # Built by timm's factories (timm.optim.create_optimizer_v2, timm.scheduler.create_scheduler_v2).
    opt: str = flag("adamw", "--optimizer", "optimizer, by timm's name (adamw, sgd, lamb, ...)", str)
    lr: float = flag(1e-3, "--lr", "peak learning rate", positive_number)
    weight_decay: float = flag(0.05, "--weight-decay", "weight decay (none on biases, norms, tokens)", float)
    epochs: int = flag(10, "--epochs", "number of epochs", positive_int)
    sched: str = flag(
        "cosine", "--sched", "learning-rate schedule after warm-up: cosine, step, constant", str
    )
    warmup_epochs: float = flag(1.0, "--warmup-epochs", "epochs of linear warm-up (fractions allowed)", float)
    warmup_lr: float = 1e-6  # the rate warm-up starts from
    min_lr: float = flag(1e-5, "--min-lr", "floor of the cosine schedule", float)
    decay_epochs: float = 30.0  # sched: step — epochs between decays
    decay_rate: float = 0.1  # sched: step — factor of each decay
    layer_decay: float | None = flag(
        None, "--layer-decay", "layer-wise lr decay (timm models with group_matcher; none: off)", float
    )
    beta1: float = 0.9
    beta2: float = 0.999


@dataclass(frozen=True)
class AugConfig:
    """The training recipe's augmentation and mixing (timm's), on top of a data set's own
    ``data.options.augment`` (shifts and flips). All off by default."""

    randaugment: str | None = flag(
        None, "--aug.randaugment", "timm RandAugment policy, e.g. rand-m9-mstd0.5 (none: off)", str
    )
    reprob: float = flag(0.0, "--aug.reprob", "random erasing probability (timm RandomErasing)", float)
    remode: str = "pixel"  # random erasing fill: const, rand or pixel (per-pixel noise)
    recount: int = 1  # random erasing: at most this many boxes
    mixup: float = flag(0.0, "--aug.mixup", "Mixup alpha (0: off)", float)
    cutmix: float = flag(0.0, "--aug.cutmix", "CutMix alpha (0: off)", float)
    mixup_prob: float = 1.0  # probability that a batch is mixed at all
    switch_prob: float = 0.5  # with both on: probability of CutMix instead of Mixup
    mixup_mode: str = "batch"  # batch, pair or elem (timm's Mixup modes)


@dataclass(frozen=True)
class TrainConfig:
    label_smoothing: float = 0.1
    grad_clip: float | None = 1.0
    query_masking: bool = flag(
        False, "--query-masking", "Perceiver Query Masking: train each batch on the first K~U[1,Q] queries"
    )
    query_distribution: str = "uniform"
    teacher: str | None = flag(
        None, "--teacher", "distillation teacher: a checkpoint or run folder, or a model with shipped weights"
    )
    init_from: str | None = flag(
        None,
        "--init-from",
        "start from these weights (a checkpoint or run folder, or a model with shipped weights): fine-tuning",
    )
    distill_weight: float = flag(0.5, "--distill-weight", "soft-label loss weight (1 = soft only)")
    distill_tau: float = flag(1.0, "--distill-tau", "distillation temperature")
    checkpoint: bool = True  # write last.safetensors after every epoch
    ema: bool = flag(
        False, "--ema", "keep an EMA of the weights (timm ModelEmaV3), saved with the checkpoint"
    )
    ema_decay: float = flag(0.9998, "--ema-decay", "EMA decay per step", float)
    precision: str = flag("fp32", "--precision", "training precision: fp32, or bf16 (autocast)", str)
    # The split evaluated after every epoch: choose settings on "val" where the data set has
    # one, and evaluate the test split once at the end (`leanformer eval`).
    eval_split: str = flag("test", "--eval-split", "split evaluated after every epoch (test, val)", str)


@dataclass(frozen=True)
class RunConfig:
    model: str = flag("deit_digits", "--model", "registered model name (see `leanformer models`)")
    # Constructor options of the model: any key it accepts (YAML, --opt KEY=VALUE, dotted
    # overrides); these have a flag of their own.
    model_options: dict[str, Any] = field(
        default_factory=dict,
        metadata=entry_flags(
            pool=Flag("--pool", "token pooling method (DeiT): wkmedoids, kmeans, powerbert, merge, ...", str),
            keep=Flag("--keep", KEEP_HELP, parse_keep),
            carry=Flag("--carry", "track token sizes (proportional attention)", bool),
            attention=Flag("--attention", "attention variant (detr_encoder: dense | enact)", str),
            sigma=Flag("--sigma", "ENACT entropy smoothing sigma (0 disables)", float),
        ),
    )
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    aug: AugConfig = field(default_factory=AugConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    device: str = "cpu"
    compile: bool = flag(
        False, "--compile", "evaluate torch.compile(model, fullgraph=True) (config: compile: true)"
    )

    def __post_init__(self) -> None:
        # The token budget is parsed here, once, whether it came from YAML, a dotted
        # override or Python; models receive the KeepSchedule as is.
        object.__setattr__(self, "model_options", parse_model_options(self.model_options))


def parse_model_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``keep`` (when given) parsed into a :class:`KeepSchedule`."""
    if options.get("keep") is None or isinstance(options["keep"], KeepSchedule):
        return options
    try:
        return {**options, "keep": parse_keep(options["keep"])}
    except ValueError as err:
        raise ValueError(f"model_options.keep: {err}") from None


def plain_options(options: dict[str, Any]) -> dict[str, Any]:
    """Model options as plain YAML/JSON values: a KeepSchedule becomes its spelling."""
    return {k: v.to_value() if isinstance(v, KeepSchedule) else v for k, v in options.items()}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def declared_flags(
    cls: type = RunConfig, prefix: str = "", *, nested: bool = True
) -> Iterator[tuple[str, Flag]]:
    """``(dotted key, flag)`` of every option of ``cls`` that has a flag, in field order;
    each flag's ``type`` is resolved (from the annotation when the declaration gives none).
    ``nested=False`` leaves out the options of sections (dataclass-typed fields)."""
    hints = _field_types(cls)
    for f in fields(cls):
        key, annotation = f"{prefix}{f.name}", hints[f.name]
        if nested and isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            yield from declared_flags(annotation, f"{key}.")
        if _FLAG in f.metadata:
            spec: Flag = f.metadata[_FLAG]
            # `int | None` -> int: None is what an absent flag already means.
            kinds = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
            yield key, replace(spec, type=spec.type or kinds[0])
        for entry, spec in f.metadata.get(_ENTRY_FLAGS, {}).items():
            yield f"{key}.{entry}", spec


def flag_names() -> dict[str, str]:
    """``{"optim.lr": "--lr", ...}``: messages name the flag the user would type."""
    return {key: spec.name for key, spec in declared_flags()}


def _unknown_key(key: str, cls: type) -> ValueError:
    names = [f.name for f in fields(cls)]
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], names, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(names)}"
    return ValueError(f"unknown config key {key!r}{hint}")


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested mapping, validating keys and types."""
    if not isinstance(data, dict):
        raise ValueError(f"config section {prefix or '<root>'} must be a mapping, got {data!r}")
    hints = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in hints:
            raise _unknown_key(full, cls)
        annotation = hints[key]
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            kwargs[key] = from_dict(annotation, value or {}, prefix=f"{full}.")
        else:
            kwargs[key] = coerce_value(value, annotation, full)
    return cls(**kwargs)


def to_dict(config: RunConfig) -> dict[str, Any]:
    """``config`` as plain YAML/JSON values (``from_dict`` reads it back)."""
    plain = dataclasses.asdict(replace(config, model_options={}))
    plain["model_options"] = plain_options(config.model_options)
    return plain


def apply_overrides(config: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """Apply dotted overrides (``"optim.lr": "3e-4"``, ``"model_options.keep": "[64, 32]"``)."""
    data = to_dict(config)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node: dict[str, Any] = data
        cls: type = RunConfig
        for depth, part in enumerate(parts[:-1]):
            hints = _field_types(cls) if cls is not dict else {}
            if cls is not dict and part not in hints:
                raise _unknown_key(".".join(parts[: depth + 1]), cls)
            sub = hints.get(part, dict) if cls is not dict else dict
            cls = sub if dataclasses.is_dataclass(sub) else dict
            node = node.setdefault(part, {})
            if not isinstance(node, dict):  # e.g. --seed.x: seed holds a value, not keys
                raise ValueError(
                    f"config key {'.'.join(parts[: depth + 1])} is not a section; {dotted} is invalid"
                )
        leaf = parts[-1]
        if cls is not dict and leaf not in _field_types(cls):
            raise _unknown_key(dotted, cls)
        # Free-form option dicts (model_options, data.options) take YAML values.
        node[leaf] = parse_scalar(value) if cls is dict and isinstance(value, str) else value
    return from_dict(RunConfig, data)


def read_yaml_mapping(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The YAML mapping in ``path`` (empty file: ``{}``); a ``ValueError`` naming ``what`` otherwise."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; give a YAML file")
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist")
    try:
        loaded = safe_load_strict(path.read_text(encoding="utf-8")) or {}
    except DuplicateKeyError as exc:
        raise ValueError(f"{what} {path}: {exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not a text file (not UTF-8); give a YAML file") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{what} {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{what} {path} must be a mapping of keys, got a YAML {type(loaded).__name__}")
    return loaded


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Defaults, then the YAML file at ``path`` (if any), then the dotted ``overrides``."""
    config = RunConfig()
    if path is not None:
        config = from_dict(RunConfig, read_yaml_mapping(path))
    return apply_overrides(config, overrides or {}) if overrides else config


def with_model_options(config: RunConfig, **options: Any) -> RunConfig:
    return replace(config, model_options={**config.model_options, **options})
