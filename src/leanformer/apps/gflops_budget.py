"""Sweep budgets given as a cost: ``{"gflops": 0.5}`` (``g0.5`` on the command line, ``0.5x``
as everywhere else) is "this method at half the unpooled model's GFLOPs".

The spellings are :mod:`leanformer.pooling.budgets`'s and the solver is
:mod:`leanformer.pooling.gflops`; here are the sweep's names for its points. Spellings:
``{"gflops": 0.5}``, ``{"gflops": 0.36, "tilt": -1.2}`` or ``{"gflops": 0.36, "bend": 1}``
in a sweep file; ``0.5x``, ``g0.5``, ``g0.36t-1.2``,
``g0.36b1`` or ``g0.36t-1.2b1`` on the command line (``--budget``); tables name them by
their numbers (``g0.5``, ``g0.36t-1.2``, ``g0.36b1.0``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from leanformer.pooling.budgets import check_gflops_budget

__all__ = ["BEND", "GFLOPS", "TILT", "gflops_label", "is_gflops_budget"]

GFLOPS = "gflops"
TILT = "tilt"
BEND = "bend"


def is_gflops_budget(keep: Any) -> bool:
    return isinstance(keep, Mapping) and GFLOPS in keep


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
