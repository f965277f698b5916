"""Command-line options shared by the commands, and their translation to configs.

The flags of config options are not written here: each is declared once, beside its field
in :mod:`leanformer.config`. :func:`add_config_flags` adds them to a parser and
:func:`config_flags_given` reads them back as dotted overrides.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leanformer.config import RunConfig, declared_flags, parse_scalar, to_dict
from leanformer.models.query_budget import check_query_count, has_query_budget
from leanformer.ops.query_selection import check_dqs_threshold
from leanformer.pooling.budgets import KeepSchedule, parse_keep


def parse_size(text: str) -> tuple[int, int]:
    """``"25x34"`` -> ``(25, 34)``; ``"32"`` -> ``(32, 32)``."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected HxW (e.g. 25x34) or a single size, got {text!r}")
    h = int(match.group(1))
    w = int(match.group(2)) if match.group(2) else h
    if h < 1 or w < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return h, w


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (argparse type)."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of integers, got {text!r}"
        ) from None


def float_list(text: str) -> list[float]:
    """``"0.6,0.9"`` -> ``[0.6, 0.9]`` (argparse type)."""
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of numbers, got {text!r}"
        ) from None


def dqs_threshold(text: str) -> float:
    """``--dqs-threshold``: a number in [-1, 1] (a cosine similarity)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    try:
        return check_dqs_threshold(value, "a DQS threshold")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def dqs_thresholds(text: str) -> list[float]:
    """``--thresholds``: a comma-separated list of numbers in [-1, 1]."""
    return [dqs_threshold(str(value)) for value in float_list(text)]


def argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type: its ``ValueError`` message becomes the usage error
    (argparse itself would print only "invalid <name> value")."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def figure_path(out: str, default_name: str) -> Path:
    """``--out`` of a command that draws one figure: a file path, or a folder to put
    ``default_name`` in (not ``<folder>.png`` beside it): an existing one, or one written
    with a trailing slash (``runs/figures/``)."""
    path = Path(out)
    return path / default_name if path.is_dir() or out.endswith(("/", os.sep)) else path


def keep_argument(text: str) -> KeepSchedule:
    """``--keep``: :func:`leanformer.pooling.budgets.parse_keep`, its errors as usage errors."""
    return argument_type(parse_keep)(text)


def _under(key: str, sections: tuple[str, ...]) -> bool:
    return any(key == s or key.startswith(f"{s}.") for s in sections)


def add_config_flags(
    parser: Any,
    *sections: str,
    schema: type = RunConfig,
    nested: bool = True,
    defaults: dict[str, Any] | None = None,
) -> None:
    """Add the declared flag of every option of ``schema`` in ``sections`` (dotted keys or
    their prefixes: ``"data"``, ``"optim"``, ``"model"``; all without), in field order.
    ``nested=False``: only ``schema``'s own fields, not those of its sections.

    Every flag defaults to ``None``, "not given": the config file's value then stands. A
    command without a config file (a demo) gives its own ``defaults`` by dotted key.
    """
    defaults = defaults or {}
    for key, spec in declared_flags(schema, nested=nested):
        if sections and not _under(key, sections):
            continue
        if spec.type is bool:
            action = "store_false" if spec.negate else "store_true"
            parser.add_argument(spec.name, action=action, default=None, help=spec.help)
            continue
        # int/float/str keep argparse's own message ("invalid int value: 'x'").
        kind = spec.type if spec.type in (str, int, float) else argument_type(spec.type)
        action = "append" if spec.repeat else "store"
        help = f"{spec.help} (default: %(default)s)" if key in defaults else spec.help
        parser.add_argument(
            spec.name, type=kind, action=action, default=defaults.get(key), metavar=spec.metavar, help=help
        )


def show_config_defaults(parser: argparse.ArgumentParser, *, unless: str) -> None:
    """Name the built-in config's value in the help of every config flag ``parser`` has
    (they default to "not given", so argparse shows none): ``(default: 1e-3, unless
    --config sets it)``. For commands whose flags fall back on exactly that config."""
    built_in = to_dict(RunConfig())
    options = {name: action for action in parser._actions for name in action.option_strings}
    for key, spec in declared_flags(RunConfig):
        value: Any = built_in
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        action = options.get(spec.name)
        if action is None or value is None or spec.type is bool or action.default is not None:
            continue
        action.help = f"{action.help} (default: {value}, unless {unless} sets it)"


def config_flags_given(
    args: argparse.Namespace, *sections: str, schema: type = RunConfig, nested: bool = True
) -> dict[str, Any]:
    """``{dotted key: value}`` of the declared flags of ``schema`` in ``sections`` that were
    given (all of them without ``sections``)."""
    values: dict[str, Any] = {}
    for key, spec in declared_flags(schema, nested=nested):
        value = getattr(args, spec.name.lstrip("-").replace("-", "_"), None)
        if value is not None and (not sections or _under(key, sections)):
            values[key] = value
    return values


def parse_key_value(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    key, value = text.split("=", 1)
    if not key.isidentifier():
        raise argparse.ArgumentTypeError(f"bad option name {key!r} in {text!r}")
    return key, parse_scalar(value)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    add_config_flags(group, "model")
    group.add_argument(
        "--opt",
        action="append",
        default=[],
        type=parse_key_value,
        metavar="KEY=VALUE",
        help="model constructor option (repeatable), e.g. --opt depth=6",
    )
    group.add_argument(
        "--pretrained",
        action="store_true",
        help="load the weights shipped with leanformer (see `leanformer models --pretrained`)",
    )
    add_config_flags(group, "model_options")
    group.add_argument("--num-queries", type=int, help="Perceiver: use the first K latent queries")
    group.add_argument(
        "--dqs-threshold",
        type=dqs_threshold,
        help="Perceiver: Dynamic Query Selection threshold t in [-1, 1]",
    )
    group.add_argument(
        "--dqs-rule",
        choices=("any", "kept"),
        help="DQS rule: drop a query similar to any previous one (paper) or to a previous kept one",
    )


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """Constructor overrides from the flags (only those the user gave); a flag of its own
    (``--pool``) wins over the same key in ``--opt``."""
    given = config_flags_given(args, "model_options")
    return {**dict(args.opt), **{key.split(".", 1)[1]: value for key, value in given.items()}}


def forward_kwargs(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    """Call-time options for ``model`` (they change what a forward pass computes, not the weights).

    They exist for Visual Perceivers only; any other model refuses them by name.
    """
    kwargs: dict[str, Any] = {}
    if getattr(args, "num_queries", None) is not None:
        kwargs["num_queries"] = args.num_queries
    if getattr(args, "dqs_threshold", None) is not None:
        kwargs["dqs_threshold"] = args.dqs_threshold
    if getattr(args, "dqs_rule", None) is not None:
        if "dqs_threshold" not in kwargs:
            raise ValueError("--dqs-rule needs --dqs-threshold")
        kwargs["dqs_rule"] = args.dqs_rule
    if kwargs and not has_query_budget(model):
        flags = ", ".join("--" + key.replace("_", "-") for key in kwargs)
        name = getattr(model, "leanformer_name", type(model).__name__)
        raise ValueError(f"{flags}: only for Visual Perceiver models; {name} has no latent queries")
    if "num_queries" in kwargs:
        check_query_count(kwargs["num_queries"], model.num_queries, name="--num-queries")
    return kwargs


def refuse_beside_checkpoint(
    args: argparse.Namespace, *flags: str, names: str = "model", hint: str = ""
) -> None:
    """``--checkpoint`` names its model (and config): the ``flags`` that would too are refused."""
    given = [flag for flag in flags if getattr(args, flag[2:].replace("-", "_"), None)]
    if args.checkpoint and given:
        raise ValueError(
            f"{' and '.join(given)} cannot be combined with --checkpoint: "
            f"the checkpoint names its {names}{hint}"
        )


def add_split_argument(parser: argparse.ArgumentParser) -> None:
    """``--split`` of the commands that evaluate: test (default), train, or val."""
    parser.add_argument(
        "--split",
        default="test",
        choices=("train", "test", "val"),
        help="val: the split --data.options.validation N holds out of the training images",
    )


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser.add_argument_group("data"), "data")


def data_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return config_flags_given(args, "data")


def dotted_overrides(extra: list[str]) -> dict[str, str]:
    """Turn leftover ``--optim.lr 1e-3`` / ``--optim.lr=1e-3`` words into ``{"optim.lr": "1e-3"}``."""
    overrides: dict[str, str] = {}
    i = 0
    while i < len(extra):
        word = extra[i]
        if not word.startswith("--") or "." not in word.split("=", 1)[0]:
            raise ValueError(f"unrecognised argument {word!r} (config overrides look like --optim.lr 1e-3)")
        if "=" in word:
            key, value = word[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(extra):
                raise ValueError(f"override {word} needs a value")
            key, value = word[2:], extra[i + 1]
            i += 2
        overrides[key] = value
    return overrides
