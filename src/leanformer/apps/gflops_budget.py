"""Sweep budgets given as a cost: ``{"gflops": 0.5}`` is "this method at half the unpooled
model's GFLOPs", whatever keep ratio that takes.

Methods spend GFLOPs differently at the same keep ratio (a K-Means iteration costs more
than a bipartite match), so a sweep over keep ratios lands every method at a different
cost. A GFLOPs budget is solved per method instead: the per-block keep ratios

    rho_i = rho ** (1 + tilt * (2 i / (depth - 1) - 1))     (block i of depth, capped at 1)

with ``rho`` found by bisection so the patched model costs at most the target fraction of
the unpooled model's GFLOPs, counted as the sweep counts them (the same images, before any
fine-tuning). K-Means and K-Medoids stop at their fixed point on CPU, so their count can
move a little with other images or fine-tuned weights; the row records what was counted.
``tilt = 0`` is the same ratio in every block; ``tilt < 0`` removes more tokens in the first blocks and
fewer in the last ones, which kept more accuracy at equal GFLOPs on Fashion-MNIST
(docs/BENCHMARKS.md, "Per-block schedules at equal GFLOPs").

Spellings: ``{"gflops": 0.5}`` or ``{"gflops": 0.36, "tilt": -1.2}`` in a sweep file;
``g0.5`` or ``g0.36t-1.2`` on the command line (``--budget``) and in result tables.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

GFLOPS = "gflops"
TILT = "tilt"
# Bisection steps on rho: 2**-30 is far below the step of one token in one block.
_STEPS = 30
# Beyond this the first or last blocks keep every token or none whatever the target.
MAX_TILT = 10.0
_TEXT = re.compile(r"g(?P<gflops>[0-9.eE+-]+?)(?:t(?P<tilt>[0-9.eE+-]+))?")


def is_gflops_budget(keep: Any) -> bool:
    return isinstance(keep, Mapping) and GFLOPS in keep


def check_gflops_budget(keep: Mapping[str, Any]) -> dict[str, float]:
    """The budget with its numbers checked: ``gflops`` in (0, 1], ``tilt`` finite (default 0)."""
    stray = sorted(set(keep) - {GFLOPS, TILT})
    if stray:
        raise ValueError(
            f"a GFLOPs budget takes gflops: and tilt:, not {', '.join(stray)} (got {dict(keep)!r})"
        )
    target, tilt = keep[GFLOPS], keep.get(TILT, 0.0)
    for name, value in ((GFLOPS, target), (TILT, tilt)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"GFLOPs budget {dict(keep)!r}: {name} must be a finite number, got {value!r}")
    if abs(tilt) > MAX_TILT:
        raise ValueError(
            f"GFLOPs budget {dict(keep)!r}: tilt must lie in [-{MAX_TILT}, {MAX_TILT}], got {tilt}"
        )
    if not 0.0 < target <= 1.0:
        raise ValueError(
            f"GFLOPs budget {dict(keep)!r}: gflops is a fraction of the unpooled model's GFLOPs, "
            f"in (0, 1], got {target}"
        )
    return {GFLOPS: float(target), TILT: float(tilt)}


def parse_gflops_text(text: str) -> dict[str, float] | None:
    """``"g0.5"`` / ``"g0.36t-1.2"`` -> the budget; None when ``text`` is not of that form."""
    text = text.strip()
    match = _TEXT.fullmatch(text)
    if match is None:
        # No preset name starts with g followed by a digit or point: such a text was meant
        # as a GFLOPs budget, and is better told so than shown the list of presets.
        if re.fullmatch(r"[gG][0-9.].*", text):
            raise _misspelled(text)
        return None
    try:
        keep = {GFLOPS: float(match["gflops"])}
        if match["tilt"] is not None:
            keep[TILT] = float(match["tilt"])
    except ValueError:
        raise _misspelled(text) from None
    return check_gflops_budget(keep)


def _misspelled(text: str) -> ValueError:
    return ValueError(f"GFLOPs budget {text!r}: expected g<fraction> or g<fraction>t<tilt>, e.g. g0.5")


def gflops_label(keep: Mapping[str, Any]) -> str:
    """``g0.5``, ``g0.36t-1.2``: the point's name in results and tables."""
    budget = check_gflops_budget(keep)
    # repr: the shortest spelling that reads back as the same float, so two budgets never
    # share a label (the label is the point's key in results and for --resume).
    label = f"g{budget[GFLOPS]!r}"
    return label if budget[TILT] == 0.0 else f"{label}t{budget[TILT]!r}"


def tilted_ratios(rho: float, tilt: float, depth: int) -> list[float]:
    """Per-block keep ratios whose geometric mean is ``rho`` before the cap at 1."""
    if depth == 1:
        return [rho]
    return [min(1.0, rho ** (1.0 + tilt * (2.0 * i / (depth - 1) - 1.0))) for i in range(depth)]


def solve_keep_ratios(
    keep: Mapping[str, Any], *, depth: int, cost: Callable[[list[float]], float], name: str
) -> list[float]:
    """The per-block ratios of ``keep``'s shape that cost at most its GFLOPs fraction.

    ``cost(ratios)`` is the patched model's GFLOPs over the unpooled model's. Among the
    schedules of this tilt it returns the one with the largest ``rho`` found not above
    the target (token counts are integers, so the cost moves in small steps).
    """
    budget = check_gflops_budget(keep)
    target, tilt = budget[GFLOPS], budget[TILT]
    high = 1.0
    if cost(tilted_ratios(high, tilt, depth)) <= target:
        return tilted_ratios(high, tilt, depth)
    # The cheapest schedule of this tilt (blocks keep no pooled token, or all of them where
    # the tilt caps the ratio at 1).
    floor = tilted_ratios(1e-6, tilt, depth)
    cheapest = cost(floor)
    if cheapest > target:
        raise ValueError(
            f"{name}: out of reach, the cheapest schedule of this tilt still costs "
            f"{cheapest:.3f}x the unpooled GFLOPs"
        )
    low = 1e-6
    for _ in range(_STEPS):
        mid = (low + high) / 2
        low, high = (mid, high) if cost(tilted_ratios(mid, tilt, depth)) <= target else (low, mid)
    return tilted_ratios(low, tilt, depth)
