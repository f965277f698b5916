"""Token budgets given as a cost: ``keep="0.5x"`` is "this method at half the unpooled model's
GFLOPs", whatever per-block budgets that takes. The one solver of such budgets, for
:func:`leanformer.apply_token_pooling`, ``create_model``, ``model.token_pooling.keep`` and
the trade-off sweep alike.

Methods spend GFLOPs differently at the same keep ratio (a K-Means iteration costs more
than a bipartite match), so a GFLOPs budget is solved per method and model. For most
methods the per-block keep ratios are

    rho_i = rho ** (1 + tilt * u_i + bend * (u_i ** 2 - 1 / 3)),   u_i = 2 i / (depth - 1) - 1

(block i of depth, u from -1 at the first block to 1 at the last, capped at 1) with ``rho``
found by bisection so the patched model costs at most the target fraction of the unpooled
model's GFLOPs. ``tilt = bend = 0`` is the same ratio in every block; ``tilt < 0`` removes
more tokens in the first blocks and fewer in the last ones, which kept more accuracy at equal
GFLOPs on Fashion-MNIST at 0.24x; ``bend > 0`` keeps more in the middle blocks and fewer at
both ends, which did at 0.36x and, with the tilt, at 0.24x (docs/BENCHMARKS.md, "Per-block
schedules at equal GFLOPs"). ``u ** 2 - 1 / 3`` averages zero over u in [-1, 1], so the bend
moves tokens between the blocks more than it moves rho.

``tome`` is solved in its own form, a constant ``r`` per block (the smallest r that meets
the target): ToMe's matching removes at most half of a block's tokens, and ToMe's users
compare at a constant r.

``conv`` is solved over its placements (one learned 2x2 downsampling after block j, two
after blocks j < k, or one after every block from j on): each keeps a quarter of the
tokens, so its costs step coarsely; the second layer of a pair fills the steps between
two single placements. Token counts are integers, so every model's cost moves in steps: a method whose
reachable costs step over the target by more than ``TOLERANCE`` is refused, naming the
nearest costs it reaches. The trade-off sweep
takes the cheapest point at most at the target instead (its rows record the GFLOPs reached).
A FLOP counter sees every K-Means iteration (as an accelerator runs them), so its cost is a
function of the token counts; K-Medoids counts the distances its C++ iterations compute,
which stop at their fixed point, so its count can move a little with other images or weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from leanformer.pooling.budgets import KeepSchedule, check_gflops_budget, effective_counts

# A solved budget lands within this fraction of its target, or is refused.
TOLERANCE = 0.02
# Bisection steps on rho: 2**-30 is far below the step of one token in one block.
_STEPS = 30
_CHEAPEST_RHO = 1e-6


def shaped_ratios(rho: float, tilt: float, depth: int, bend: float = 0.0) -> list[float]:
    """Per-block keep ratios of the module's formula, capped at 1. Without a bend their
    geometric mean is ``rho`` before the cap."""
    if depth == 1:
        return [rho]
    positions = [2.0 * i / (depth - 1) - 1.0 for i in range(depth)]
    return [min(1.0, rho ** (1.0 + tilt * u + bend * (u * u - 1.0 / 3.0))) for u in positions]


@dataclass(frozen=True)
class Solved:
    """A solved budget: the schedule, its cost, and the cost of the next schedule of its
    shape above the target (None when the target was the full model or out of reach)."""

    schedule: KeepSchedule
    cost: float
    cost_above: float | None


def _bisect_ratios(
    keep: Mapping[str, Any], *, depth: int, cost: Callable[[list[float]], float], name: str
) -> tuple[list[float], float, tuple[list[float], float] | None]:
    budget = check_gflops_budget(keep)
    target = budget["gflops"]

    def shape(rho: float) -> list[float]:
        return shaped_ratios(rho, budget["tilt"], depth, budget.get("bend", 0.0))

    full = cost(shape(1.0))
    if full <= target:
        return shape(1.0), full, None
    # The cheapest schedule of this shape (blocks keep no pooled token, or all of them
    # where the shape caps the ratio at 1). Every exponent is fixed, so the cost only
    # falls as rho does: bisection finds the boundary.
    cheapest = cost(shape(_CHEAPEST_RHO))
    if cheapest > target:
        raise ValueError(
            f"{name}: out of reach, the cheapest schedule of this tilt and bend still costs "
            f"{cheapest:.3f}x the unpooled GFLOPs"
        )
    low, high, low_cost, high_cost = _CHEAPEST_RHO, 1.0, cheapest, full
    for _ in range(_STEPS):
        mid = (low + high) / 2
        mid_cost = cost(shape(mid))
        if mid_cost <= target:
            low, low_cost = mid, mid_cost
        else:
            high, high_cost = mid, mid_cost
    return shape(low), low_cost, (shape(high), high_cost)


def solve_keep_ratios(
    keep: Mapping[str, Any], *, depth: int, cost: Callable[[list[float]], float], name: str
) -> list[float]:
    """The per-block ratios of ``keep``'s shape that cost at most its GFLOPs fraction.

    ``cost(ratios)`` is the patched model's GFLOPs over the unpooled model's. Among the
    schedules of this shape (tilt and bend) it returns the one with the largest ``rho``
    found not above the target (token counts are integers, so the cost moves in small
    steps).
    """
    return _bisect_ratios(keep, depth=depth, cost=cost, name=name)[0]


def _solve_r(
    target: float, *, num_tokens: int, cost: Callable[[KeepSchedule], float], name: str
) -> tuple[KeepSchedule, float, tuple[KeepSchedule, float] | None]:
    """The smallest constant r whose cost is at most ``target`` (more r, fewer tokens: the
    cost falls as r grows, up to half of the first block's tokens, after which it stays)."""
    full = cost(KeepSchedule(remove=0))
    if full <= target:
        return KeepSchedule(remove=0), full, None
    most = max(1, num_tokens // 2)
    cheapest = cost(KeepSchedule(remove=most))
    if cheapest > target:
        raise ValueError(
            f"{name}: out of reach, ToMe's largest r ({most}) still costs {cheapest:.3f}x the unpooled GFLOPs"
        )
    low, high, low_cost, high_cost = 0, most, full, cheapest  # cost(low) > target >= cost(high)
    while high - low > 1:
        mid = (low + high) // 2
        mid_cost = cost(KeepSchedule(remove=mid))
        if mid_cost <= target:
            high, high_cost = mid, mid_cost
        else:
            low, low_cost = mid, mid_cost
    return KeepSchedule(remove=high), high_cost, (KeepSchedule(remove=low), low_cost)


def _solve_conv(
    target: float, *, depth: int, cost: Callable[[KeepSchedule], float]
) -> tuple[KeepSchedule, float, tuple[KeepSchedule, float] | None]:
    """``conv``'s placements: one layer after block j, two after blocks j < k, or one after
    every block from j on (each keeps a quarter of the tokens, so a keep ratio's shape would
    place all of them or none). The costliest placement at most at ``target``, and the
    cheapest one above it."""
    full = cost(KeepSchedule(blocks=(1.0,) * depth))
    if full <= target:
        return KeepSchedule(blocks=(1.0,) * depth), full, None

    def at(*blocks: int) -> tuple[float, ...]:
        # A quarter, what each layer keeps: the conv builder places a layer wherever a
        # block keeps at most half of what it receives, on odd counts too (half of 49
        # tokens rounds to 25, above the 24 of the rule).
        return tuple(0.25 if i in blocks else 1.0 for i in range(depth))

    candidates = {at(j) for j in range(depth)}
    candidates |= {at(j, k) for j in range(depth) for k in range(j + 1, depth)}
    candidates |= {at(*range(j, depth)) for j in range(depth)}
    costs = sorted((cost(KeepSchedule(blocks=c)), c) for c in candidates)
    below = [(c, ratios) for c, ratios in costs if c <= target]
    above = [(c, ratios) for c, ratios in costs if c > target] + [(full, (1.0,) * depth)]
    next_up = (KeepSchedule(blocks=above[0][1]), above[0][0])
    if not below:
        raise ValueError(
            f"conv at {target:g}x: out of reach, its cheapest placement costs "
            f"{costs[0][0]:.3f}x the unpooled GFLOPs"
        )
    return KeepSchedule(blocks=below[-1][1]), below[-1][0], next_up


def solve_gflops(
    schedule: KeepSchedule,
    *,
    method: str,
    depth: int,
    num_tokens: int,
    cost: Callable[[KeepSchedule], float],
    tolerance: float | None = TOLERANCE,
) -> Solved:
    """Per-block budgets with which ``method`` spends ``schedule.gflops`` of the unpooled GFLOPs.

    ``cost(candidate)`` is the model's GFLOPs with ``method`` at the per-block ``candidate``
    over the unpooled model's. ``tolerance``: how far from the target the cost may land, as a
    fraction of it (None: any amount below it, the sweep's rule). The cheapest schedule at
    most at the target is preferred; where it falls short by more, the next one above is
    taken if it lands within the tolerance; else the budget is refused, naming the nearest
    costs the method reaches.
    """
    if schedule.gflops is None:
        raise ValueError(f"keep={schedule} is not a fraction of the GFLOPs")
    target = schedule.gflops
    name = f"{method} at {schedule}"
    if method == "tome":
        if schedule.tilt != 0.0 or schedule.bend != 0.0:
            raise ValueError(
                f"{name}: tome spends a GFLOPs budget as ToMe's constant r per block; "
                "tilt and bend shape the keep ratios of the other methods"
            )
        solved, reached, next_up = _solve_r(target, num_tokens=num_tokens, cost=cost, name=name)
    elif method == "conv":
        if schedule.tilt != 0.0 or schedule.bend != 0.0:
            raise ValueError(f"{name}: conv places whole layers; tilt and bend shape keep ratios")
        solved, reached, next_up = _solve_conv(target, depth=depth, cost=cost)
    else:
        # Ratios that keep the same token counts in every block build the same reducers:
        # the bisection's late steps cost nothing but this look-up.
        memo: dict[tuple[float, ...], float] = {}

        def cost_of_ratios(ratios: list[float]) -> float:
            key = tuple(map(float, effective_counts(ratios, num_tokens)))
            if key not in memo:
                memo[key] = cost(KeepSchedule(blocks=tuple(ratios)))
            return memo[key]

        shape = {"gflops": target, "tilt": schedule.tilt, "bend": schedule.bend}
        ratios, reached, up = _bisect_ratios(shape, depth=depth, cost=cost_of_ratios, name=name)
        solved = KeepSchedule(blocks=tuple(ratios))
        next_up = None if up is None else (KeepSchedule(blocks=tuple(up[0])), up[1])
    above = None if next_up is None else next_up[1]
    if tolerance is not None and target - reached > tolerance * target:
        if next_up is not None and next_up[1] - target <= tolerance * target:
            # The next step up lands within the tolerance where the one below does not.
            return Solved(next_up[0], next_up[1], None)
        nearest = f"{reached:.3g}x" + ("" if above is None else f" and {above:.3g}x")
        raise ValueError(
            f"{method} cannot spend {target:g}x of the unpooled GFLOPs (within {tolerance:.0%}): "
            f"the nearest budgets it reaches are {nearest}"
        )
    return Solved(solved, reached, above)
