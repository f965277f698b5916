"""Constructor argument checks shared by layers and models, so a bad option fails with
a message naming it instead of a division by zero or a shape error deep inside torch."""

from __future__ import annotations

import math
import operator
from typing import Any


def as_int(value: object) -> int | None:
    """``value`` as an int if it is an integer of any kind (numpy, 0-dim tensor), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_positive(*, minimum: int = 1, optional: bool = False, **values: object) -> None:
    """Every named value must be an integer >= ``minimum``; the error names the first that is not.

    ``optional``: None passes too (an option whose None means "derive it", e.g. a width
    defaulting to the model's). 0 does not: ``width or default`` would silently read it as None.
    """
    for name, value in values.items():
        if optional and value is None:
            continue
        number = as_int(value)
        if number is None or number < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_sizes(name: str, values: object, *, minimum: int = 1) -> tuple[int, ...]:
    """``values`` as a tuple of ints: a list or tuple of integers >= ``minimum`` (e.g. one per
    stage); the error names the entry (``embed_dims[1]``). Floats are refused, not truncated."""
    if not isinstance(values, list | tuple):
        raise ValueError(f"{name} must be a list of integers, got {values!r}")
    check_positive(minimum=minimum, **{f"{name}[{i}]": v for i, v in enumerate(values)})
    return tuple(operator.index(v) for v in values)


def check_positive_number(*, zero_ok: bool = False, optional: bool = False, **values: object) -> None:
    """Every named value must be a finite number > 0, or >= 0 with ``zero_ok`` (where 0 switches
    something off, e.g. ``nll_ratio``): width ratios, scales, fractions. ``optional``: None
    passes too (e.g. LayerScale's ``init_values``, None for none)."""
    for name, value in values.items():
        if optional and value is None:
            continue
        number = value if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
        if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
            raise ValueError(f"{name} must be a number {'>= 0' if zero_ok else '> 0'}, got {value!r}")


def hidden_width(dim: int, ratio: float, *, name: str = "mlp_ratio") -> int:
    """An MLP's hidden width ``int(dim * ratio)``, checked to be at least 1: timm's ``Mlp``
    reads a hidden width of 0 as "the input width", so a tiny ratio would silently build
    a full-width MLP."""
    values: dict[str, object] = {name: ratio}
    check_positive_number(**values)  # type: ignore[arg-type]  # the name is the caller's
    width = int(dim * ratio)
    if width < 1:
        raise ValueError(
            f"{name} {ratio!r} leaves no hidden unit at width {dim} (int({dim} * {ratio!r}) = {width}): "
            f"{dim} * {name} must be at least 1"
        )
    return width


def head_dim(dim: int, num_heads: int, *, dim_name: str = "dim") -> int:
    """Width of one attention head: ``dim // num_heads``, after checking both."""
    named: dict[str, Any] = {dim_name: dim, "num_heads": num_heads}
    check_positive(**named)
    if dim % num_heads:
        raise ValueError(f"{dim_name} ({dim}) must be divisible by num_heads ({num_heads})")
    return dim // num_heads


def check_patch_grid(img_size: tuple[int, int], patch_size: int) -> None:
    """``patch_size`` must be an integer >= 1 that divides both sides of ``img_size``."""
    check_positive(patch_size=patch_size)
    if img_size[0] % patch_size or img_size[1] % patch_size:
        raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")


def check_rates(**values: object) -> None:
    """Every named value must be a probability in ``[0, 1)`` (dropout, drop-path)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
