"""Learnable residual coefficients (LRC) of SReT.

A residual connection ``x + f(x)`` becomes ``alpha * x + beta * f(x)`` with scalar
``alpha`` (on the skip / identity branch) and ``beta`` (on the branch), both
initialised to 1 so a fresh model starts as the plain residual network. Recursion
applies the same block several times; the coefficients let each application scale
how much of the shared branch it adds (supplement, section 9 and figures 5-6).

The three designs of the supplement's table 8, plus the baseline without LRC:

* ``"skip"``   (1): ``alpha * x + f(x)``
* ``"branch"`` (2): ``x + beta * f(x)``
* ``"both"``   (3): ``alpha * x + beta * f(x)`` (the paper's choice, default)
* ``"none"``:       ``x + f(x)``
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor, nn

LRCMode = Literal["both", "skip", "branch", "none"]
LRC_MODES: tuple[str, ...] = get_args(LRCMode)


def check_lrc_mode(mode: str | None) -> LRCMode:
    """Validate ``mode`` (raises ``ValueError`` naming the choices); None is ``"none"``:
    ``--opt lrc=none`` reads as YAML's null."""
    if mode is None:
        return "none"
    if mode not in LRC_MODES:
        raise ValueError(f"lrc must be one of {', '.join(LRC_MODES)}; got {mode!r}")
    return mode  # type: ignore[return-value]


class LearnableResidual(nn.Module):
    """``forward(x [..., C], branch [..., C]) -> alpha * x + beta * branch``.

    ``alpha`` exists for modes ``"both"``/``"skip"``, ``beta`` for ``"both"``/``"branch"``;
    an absent coefficient is the constant 1 (no parameter, so every parameter is used).
    """

    def __init__(self, *, mode: LRCMode = "both") -> None:
        super().__init__()
        self.mode = check_lrc_mode(mode)
        self.alpha = nn.Parameter(torch.ones(1)) if mode in ("both", "skip") else None
        self.beta = nn.Parameter(torch.ones(1)) if mode in ("both", "branch") else None

    def forward(self, x: Tensor, branch: Tensor) -> Tensor:
        skip = x if self.alpha is None else self.alpha * x
        if self.beta is None:
            return skip + branch
        # addcmul fuses the scale and the add into one kernel.
        return torch.addcmul(skip, self.beta, branch)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}"


__all__ = ["LRC_MODES", "LRCMode", "LearnableResidual", "check_lrc_mode"]
