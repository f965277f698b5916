"""Typed values from text: YAML scalars, checked against a type annotation.

Shared by the run configuration and the dataset registry, so that a flag, a YAML key and
a dataset option read ``true``, ``3e-4`` or ``maybe`` the same way, and a value of the
wrong type is refused with the key's name instead of failing later inside a builder.
"""

from __future__ import annotations

import types
import typing
from typing import Any

import yaml

from leanformer.strict_yaml import safe_load_strict

_NULL_WORDS = ("", "none", "null", "~")


def parse_scalar(text: str) -> Any:
    """YAML scalar parsing, plus ``3e-4``-style floats that YAML 1.1 reads as strings."""
    if text.strip().lower() in _NULL_WORDS:
        return None
    try:
        value = safe_load_strict(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value) if any(c in value.lower() for c in ".e") and "_" not in value else value
        except ValueError:
            return value
    return value


def coerce_value(value: Any, annotation: Any, key: str) -> Any:
    """Convert ``value`` (often a string from the command line) to ``annotation``; a
    ValueError naming ``key`` when it is of another type."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation) if origin in (types.UnionType, typing.Union) else ()
    if isinstance(value, str) and str in args:
        # A folder named "123" stays a string; only the null words mean "not set".
        return None if value.strip().lower() in _NULL_WORDS and type(None) in args else value
    if isinstance(value, str) and annotation is not str:
        value = parse_scalar(value)
    if args:
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce_value(value, arg, key)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"{key}: bad value {value!r}")
    if annotation is Any:
        return value
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key} expects a mapping, got {value!r}")
        return dict(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{key} expects true/false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} expects an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} expects a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ValueError(f"{key} expects a string, got {value!r}")
        return value
    raise ValueError(f"{key}: unsupported type {annotation}")
