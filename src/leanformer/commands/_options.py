"""Command-line options shared by the commands, and their translation to configs."""

from __future__ import annotations

import argparse
import re
from typing import Any

from leanformer.config import parse_scalar
from leanformer.layers.budgets import KEEP_HELP, KeepSchedule, parse_keep
from leanformer.models.query_budget import check_query_count, has_query_budget


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


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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


def keep_argument(text: str) -> KeepSchedule:
    """``--keep``: :func:`leanformer.layers.budgets.parse_keep`, its errors as usage errors."""
    try:
        return parse_keep(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_key_value(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    key, value = text.split("=", 1)
    if not key.isidentifier():
        raise argparse.ArgumentTypeError(f"bad option name {key!r} in {text!r}")
    return key, parse_scalar(value)


def add_model_arguments(parser: argparse.ArgumentParser, *, model_required: bool = False) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model", required=model_required, help="registered model name (see `leanformer models`)"
    )
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
    group.add_argument("--pool", help="token pooling method (DeiT): wkmedoids, kmeans, powerbert, merge, ...")
    group.add_argument("--keep", type=keep_argument, help=KEEP_HELP)
    group.add_argument(
        "--carry", action="store_true", default=None, help="track token sizes (proportional attention)"
    )
    group.add_argument("--attention", help="attention variant (detr_encoder: dense | enact)")
    group.add_argument("--sigma", type=float, help="ENACT entropy smoothing sigma (0 disables)")
    group.add_argument("--num-queries", type=int, help="Perceiver: use the first K latent queries")
    group.add_argument("--dqs-threshold", type=float, help="Perceiver: Dynamic Query Selection threshold t")
    group.add_argument(
        "--dqs-rule",
        choices=("any", "kept"),
        help="DQS rule: drop a query similar to any previous one (paper) or to a previous kept one",
    )


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """Constructor overrides from the flags (only those the user gave)."""
    options: dict[str, Any] = dict(args.opt)
    for flag in ("pool", "keep", "carry", "attention", "sigma"):
        value = getattr(args, flag, None)
        if value is not None:
            options[flag] = value
    return options


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


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--data", help="dataset name (digits, cifar10, imagefolder, digits_pairs, ...)")
    group.add_argument("--data-root", help="local folder for datasets read from disk")
    group.add_argument("--img-size", type=positive_int, help="input image size")
    group.add_argument("--batch-size", type=positive_int, help="batch size")


def data_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for flag, key in (
        ("data", "data.name"),
        ("data_root", "data.root"),
        ("img_size", "data.img_size"),
        ("batch_size", "data.batch_size"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[key] = value
    return overrides


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
