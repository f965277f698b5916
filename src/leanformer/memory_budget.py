"""A memory budget checked before a model or a batch is built, so a size the machine cannot
hold is refused with the estimate and the limit instead of growing until the system's
out-of-memory killer ends the process.

Estimates are deliberately rough and on the safe side of refusing nothing normal: they
count what must exist (a model's parameters, a batch's inputs and the activations one
example needs, scaled by the batch) against the memory the system reports available.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

# A decoded image of more pixels than this is refused before it is decoded (RGB float32
# of 64 Mpx is already 768 MB, and the maps drawn from it several times that).
MAX_IMAGE_PIXELS = 64_000_000


def available_bytes() -> int | None:
    """Memory the system can give this process now (``MemAvailable``), or None when unknown."""
    try:
        import psutil  # type: ignore[import-untyped]

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _gb(size: float) -> str:
    return f"{size / 1e9:.1f} GB"


def check_fits(estimate: float, what: str, *, available: Callable[[], int | None] = available_bytes) -> None:
    """Refuse ``what`` when ``estimate`` bytes exceed the available memory (one line, both figures)."""
    limit = available()
    if limit is not None and estimate > limit:
        raise ValueError(
            f"{what} would need about {_gb(estimate)} of memory (estimate), more than the "
            f"{_gb(limit)} this machine has available; choose smaller sizes"
        )


# A batch up to this size is never estimated (the estimate runs one example's forward pass,
# and every normal configuration is under it).
ESTIMATE_ABOVE_BATCH = 256


def check_batch_fits(
    run_one_example: Callable[[], Any],
    *,
    input_bytes: int,
    batch_size: int,
    what: str,
    device: str | torch.device = "cpu",
    available: Callable[[], int | None] = available_bytes,
) -> None:
    """Refuse a batch of ``batch_size`` whose inputs and activations would not fit: one
    example's input bytes plus the memory ``run_one_example`` adds at its peak (measured),
    times the batch. Batches up to :data:`ESTIMATE_ABOVE_BATCH` are not measured."""
    if batch_size <= ESTIMATE_ABOVE_BATCH:
        return
    from leanformer.bench.memory import peak_memory_mb

    activation_mb = peak_memory_mb(run_one_example, device=device) or 0.0
    per_example = input_bytes + activation_mb * 1e6
    check_fits(
        per_example * batch_size,
        f"{what} {batch_size} ({per_example / 1e6:.2f} MB per example)",
        available=available,
    )


def check_image_pixels(width: int, height: int, what: str) -> None:
    """Refuse an image larger than :data:`MAX_IMAGE_PIXELS` before it is decoded."""
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"{what} is {width}x{height} = {width * height / 1e6:.0f} Mpx, more than the "
            f"{MAX_IMAGE_PIXELS / 1e6:.0f} Mpx leanformer decodes; resize it first"
        )


# Option values below this never make a model too large to think about: only a larger one
# pays for an estimate (normal configurations are neither refused nor slowed).
_LARGE_OPTION = 1024
# Options that repeat a block: the estimate builds one and two of them and extrapolates.
_REPEATS = re.compile(r"depth|layers|blocks")


def _meta_parameters(build: Callable[..., nn.Module], options: dict[str, Any]) -> int | None:
    """Parameters and buffers of ``build(**options)`` built on the meta device (no memory)."""
    try:
        with torch.device("meta"):
            model = build(**options)
    except Exception:  # a constructor that needs real tensors: no estimate
        return None
    return sum(t.numel() for t in (*model.parameters(), *model.buffers()))


def estimate_parameters(build: Callable[..., nn.Module], options: dict[str, Any]) -> int | None:
    """How many parameter and buffer elements ``build(**options)`` would hold, without
    building it: on the meta device, and with a repeat count (``depth``) above 2 as one
    and two blocks extrapolated (a billion blocks would exhaust memory as Python objects)."""
    for key, value in options.items():
        if _REPEATS.search(key) and isinstance(value, int) and not isinstance(value, bool) and value > 2:
            one = _meta_parameters(build, {**options, key: 1})
            two = _meta_parameters(build, {**options, key: 2})
            if one is None or two is None:
                return None
            return one + (value - 1) * max(0, two - one)
    return _meta_parameters(build, options)


def has_large_option(options: dict[str, Any]) -> bool:
    """Whether any integer option is large enough to be worth an estimate."""
    values = [
        v for value in options.values() for v in (value if isinstance(value, list | tuple) else [value])
    ]
    return any(isinstance(v, int) and not isinstance(v, bool) and v >= _LARGE_OPTION for v in values)


def check_model_budget(name: str, build: Callable[..., nn.Module], options: dict[str, Any]) -> None:
    """Refuse building model ``name`` when its float32 parameters alone exceed the memory
    available (checked only when an option is large: see :func:`has_large_option`)."""
    if not has_large_option(options):
        return
    count = estimate_parameters(build, options)
    if count is not None:
        given = ", ".join(f"{k}={v!r}" for k, v in options.items() if has_large_option({k: v}))
        check_fits(count * 4, f"model {name} with {given} ({count:.3g} parameters)")
