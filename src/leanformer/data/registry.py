"""Dataset registry: ``build_dataset(name, split=..., **options)``.

Items are ``(input, target)``; ``input`` is a tensor, or a tuple of tensors for
multi-input models (the engine then calls ``model(*input)``). Every dataset carries
``info: DatasetInfo`` so the engine can size the model's stem and head.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

import leanformer.data as pkg
from leanformer.typed_values import coerce_value

SPLITS = ("train", "test")  # every dataset has these; a builder may add more in ``builder.splits``


@dataclass(frozen=True)
class DatasetInfo:
    num_classes: int
    in_chans: int | None = None  # None for non-image inputs
    img_size: int | None = None
    inputs: int = 1  # inputs per example: 1 (an image), 2 (a pair, for relation models)
    # Per-channel mean and std the images were normalised with (pixels in [0, 1]): image
    # augmentations that work on pixels (RandAugment) undo and redo it. None: unknown.
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    # What a target is: "classification" (a class index), "detection" (a dict of boxes,
    # labels, masks per image) or "semantic" (a class per pixel).
    task: str = "classification"


Builder = Callable[..., Dataset]
_BUILDERS: dict[str, Builder] = {}
_LOADED = False


def register_dataset(name: str) -> Callable[[Builder], Builder]:
    """Register ``builder(*, split, **options) -> Dataset`` under ``name``."""

    def wrap(builder: Builder) -> Builder:
        if name in _BUILDERS:
            raise ValueError(f"dataset {name!r} is registered twice")
        _BUILDERS[name] = builder
        return builder

    return wrap


def _load_builtin() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in ("registry", "loaders", "sampler") and not info.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{info.name}")


def list_datasets() -> list[str]:
    _load_builtin()
    return sorted(_BUILDERS)


def build_dataset(name: str, *, split: str, **options: Any) -> Dataset:
    """Build dataset ``name`` for ``split`` ("train" or "test"); options go to its builder."""
    _load_builtin()
    if not isinstance(name, str):
        raise TypeError(
            f"a dataset name must be a string, got {name!r}; known: {', '.join(sorted(_BUILDERS))}"
        )
    if name not in _BUILDERS:
        close = difflib.get_close_matches(name, sorted(_BUILDERS), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(sorted(_BUILDERS))}"
        raise ValueError(f"unknown dataset {name!r}{hint}")
    builder = _BUILDERS[name]
    splits = getattr(builder, "splits", SPLITS)
    if split not in splits:
        raise ValueError(f"dataset {name!r} has splits {', '.join(splits)}; got {split!r}")
    params = inspect.signature(builder).parameters
    required = [
        p
        for p, spec in params.items()
        if spec.kind is inspect.Parameter.KEYWORD_ONLY
        and spec.default is inspect.Parameter.empty
        and p != "split"
    ]
    missing = [p for p in required if p not in options]
    if missing:
        flag = " (--data-root)" if missing == ["root"] else ""
        raise ValueError(f"dataset {name!r} needs the option {missing[0]!r}{flag}")
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(params))
        if unknown:
            raise ValueError(
                f"dataset {name!r} has no option {unknown[0]!r}; options are "
                f"{', '.join(p for p in params if p != 'split')}"
            )
    dataset = builder(split=split, **_typed_options(name, builder, options))
    if not isinstance(getattr(dataset, "info", None), DatasetInfo):
        raise TypeError(f"dataset {name!r} does not carry a DatasetInfo as .info")
    return dataset


def _typed_options(name: str, builder: Builder, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` checked against the builder's annotations: ``validation: true`` or
    ``augment: maybe`` would otherwise be read as 1 and as on, and ``abc`` would fail deep
    inside the builder."""
    try:
        hints = typing.get_type_hints(builder)
    except (NameError, TypeError):  # a user's builder whose annotations do not resolve
        return dict(options)
    typed = dict(options)
    for key, value in options.items():
        if key in hints and _checkable(hints[key]):
            try:
                typed[key] = coerce_value(value, hints[key], key)
            except ValueError as err:
                raise ValueError(f"dataset {name!r}: option {err}") from None
    return typed


def _checkable(annotation: Any) -> bool:
    """Plain scalars (or their union with None); a builder's other annotations (a tuple, a
    path, a literal) are left for the builder to check."""
    union = typing.get_origin(annotation) in (types.UnionType, typing.Union)
    kinds = typing.get_args(annotation) if union else (annotation,)
    return all(kind in (bool, int, float, str, type(None)) for kind in kinds)
