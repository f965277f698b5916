"""Sweep budgets given as a cost: ``{"gflops": 0.5}`` is "this method at half the unpooled
model's GFLOPs", whatever keep ratio that takes.

Methods spend GFLOPs differently at the same keep ratio (a K-Means iteration costs more
than a bipartite match), so a sweep over keep ratios lands every method at a different
cost. A GFLOPs budget is solved per method instead: the per-block keep ratios

    rho_i = rho ** (1 + tilt * u_i + bend * (u_i ** 2 - 1 / 3)),   u_i = 2 i / (depth - 1) - 1

(block i of depth, u from -1 at the first block to 1 at the last, capped at 1)

with ``rho`` found by bisection so the patched model costs at most the target fraction of
the unpooled model's GFLOPs, counted as the sweep counts them (the same images, before any
fine-tuning). K-Means and K-Medoids stop at their fixed point on CPU, so their count can
move a little with other images or fine-tuned weights; the row records what was counted.
``tilt = bend = 0`` is the same ratio in every block; ``tilt < 0`` removes more tokens in the
first blocks and fewer in the last ones, which kept more accuracy at equal GFLOPs on
Fashion-MNIST at 0.24x; ``bend > 0`` keeps more in the middle blocks and fewer at both
ends, which did at 0.36x and, with the tilt, at 0.24x (docs/BENCHMARKS.md, "Per-block
schedules at equal GFLOPs").
``u ** 2 - 1 / 3`` averages zero over u in [-1, 1], so the bend moves tokens between the
blocks more than it moves rho.

Spellings: ``{"gflops": 0.5}``, ``{"gflops": 0.36, "tilt": -1.2}`` or
``{"gflops": 0.36, "bend": 1}`` in a sweep file; ``g0.5``, ``g0.36t-1.2``, ``g0.36b1`` or
``g0.36t-1.2b1`` on the command line (``--budget``); tables name them by their numbers
(``g0.5``, ``g0.36t-1.2``, ``g0.36b1.0``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

GFLOPS = "gflops"
TILT = "tilt"
BEND = "bend"
# Bisection steps on rho: 2**-30 is far below the step of one token in one block.
_STEPS = 30
# Beyond this the first or last blocks keep every token or none whatever the target.
MAX_TILT = 10.0
MAX_BEND = 10.0
_TEXT = re.compile(r"g(?P<gflops>[0-9.eE+-]+?)(?:t(?P<tilt>[0-9.eE+-]+?))?(?:b(?P<bend>[0-9.eE+-]+))?")


def is_gflops_budget(keep: Any) -> bool:
    return isinstance(keep, Mapping) and GFLOPS in keep


def check_gflops_budget(keep: Mapping[str, Any]) -> dict[str, float]:
    """The budget with its numbers checked: ``gflops`` in (0, 1], ``tilt`` and ``bend`` finite
    (default 0). ``bend`` is left out when it is 0, so budgets without one read as before."""
    stray = sorted(set(keep) - {GFLOPS, TILT, BEND})
    if stray:
        raise ValueError(
            f"a GFLOPs budget takes gflops:, tilt: and bend:, not {', '.join(stray)} (got {dict(keep)!r})"
        )
    target, tilt, bend = keep[GFLOPS], keep.get(TILT, 0.0), keep.get(BEND, 0.0)
    for name, value in ((GFLOPS, target), (TILT, tilt), (BEND, bend)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"GFLOPs budget {dict(keep)!r}: {name} must be a finite number, got {value!r}")
    for name, value, limit in ((TILT, tilt, MAX_TILT), (BEND, bend, MAX_BEND)):
        if abs(value) > limit:
            raise ValueError(
                f"GFLOPs budget {dict(keep)!r}: {name} must lie in [-{limit}, {limit}], got {value}"
            )
    if not 0.0 < target <= 1.0:
        raise ValueError(
            f"GFLOPs budget {dict(keep)!r}: gflops is a fraction of the unpooled model's GFLOPs, "
            f"in (0, 1], got {target}"
        )
    checked = {GFLOPS: float(target), TILT: float(tilt)}
    return checked | ({BEND: float(bend)} if bend != 0.0 else {})


def parse_gflops_text(text: str) -> dict[str, float] | None:
    """``"g0.5"`` / ``"g0.36t-1.2"`` / ``"g0.36b1"`` -> the budget; None when ``text`` is not of that form."""
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
        for name in (TILT, BEND):
            if match[name] is not None:
                keep[name] = float(match[name])
    except ValueError:
        raise _misspelled(text) from None
    return check_gflops_budget(keep)


def _misspelled(text: str) -> ValueError:
    return ValueError(
        f"GFLOPs budget {text!r}: expected g<fraction>, optionally followed by t<tilt> and then b<bend>, "
        "e.g. g0.5, g0.36t-1.2 or g0.36b1"
    )


def gflops_label(keep: Mapping[str, Any]) -> str:
    """``g0.5``, ``g0.36t-1.2``, ``g0.36b1.0``: the point's name in results and tables."""
    budget = check_gflops_budget(keep)
    # repr: the shortest spelling that reads back as the same float, so two budgets never
    # share a label (the label is the point's key in results and for --resume).
    label = f"g{budget[GFLOPS]!r}"
    if budget[TILT] != 0.0:
        label += f"t{budget[TILT]!r}"
    if BEND in budget:
        label += f"b{budget[BEND]!r}"
    return label


def shaped_ratios(rho: float, tilt: float, depth: int, bend: float = 0.0) -> list[float]:
    """Per-block keep ratios of the module's formula, capped at 1. Without a bend their
    geometric mean is ``rho`` before the cap."""
    if depth == 1:
        return [rho]
    positions = [2.0 * i / (depth - 1) - 1.0 for i in range(depth)]
    return [min(1.0, rho ** (1.0 + tilt * u + bend * (u * u - 1.0 / 3.0))) for u in positions]


def solve_keep_ratios(
    keep: Mapping[str, Any], *, depth: int, cost: Callable[[list[float]], float], name: str
) -> list[float]:
    """The per-block ratios of ``keep``'s shape that cost at most its GFLOPs fraction.

    ``cost(ratios)`` is the patched model's GFLOPs over the unpooled model's. Among the
    schedules of this shape (tilt and bend) it returns the one with the largest ``rho``
    found not above the target (token counts are integers, so the cost moves in small
    steps).
    """
    budget = check_gflops_budget(keep)
    target = budget[GFLOPS]

    def shape(rho: float) -> list[float]:
        return shaped_ratios(rho, budget[TILT], depth, budget.get(BEND, 0.0))

    high = 1.0
    if cost(shape(high)) <= target:
        return shape(high)
    # The cheapest schedule of this shape (blocks keep no pooled token, or all of them
    # where the shape caps the ratio at 1). Every exponent is fixed, so the cost only
    # falls as rho does: bisection finds the boundary.
    cheapest = cost(shape(1e-6))
    if cheapest > target:
        raise ValueError(
            f"{name}: out of reach, the cheapest schedule of this tilt and bend still costs "
            f"{cheapest:.3f}x the unpooled GFLOPs"
        )
    low = 1e-6
    for _ in range(_STEPS):
        mid = (low + high) / 2
        low, high = (mid, high) if cost(shape(mid)) <= target else (low, mid)
    return shape(low)
