"""Recursion over shared blocks with non-linear projection layers in between (SReT).

A recursive stage owns ``U`` unique blocks and applies each of them ``loops`` times
with the *same* parameters, so the stage is ``U * loops`` layers deep at the parameter
cost of ``U``. Feeding a block its own output again makes the passes nearly
redundant; SReT therefore puts a small, unshared *non-linear projection layer* (NLL:
LayerNorm -> MLP with learnable residual coefficients, no attention, no drop-path)
after every application::

    blk0, nll0, blk0, nll1, blk1, nll2, blk1, nll3, ...

Blocks are called as ``block(x, pass_index)`` so a block may behave differently per
pass (sliced attention uses different group counts); any ``nn.Module`` with that
call signature works, which is how the recursive All-MLP reuses this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from timm.layers import Mlp
from torch import Tensor, nn

from leanformer.layers.checks import check_positive, check_positive_number, hidden_width
from leanformer.layers.norm import LAYER_NORM
from leanformer.layers.residual_coeffs import LearnableResidual, LRCMode


class NonLinearProjection(nn.Module):
    """``x -> res(x, mlp(norm(x)))``, hidden width ``int(dim * ratio)``: ``[B, N, C] -> [B, N, C]``."""

    def __init__(
        self,
        dim: int,
        *,
        ratio: float = 1.0,
        lrc: LRCMode = "both",
        drop: float = 0.0,
        norm_layer: Callable[[int], nn.Module] = LAYER_NORM,
        act_layer: type[nn.Module] = nn.GELU,
    ) -> None:
        super().__init__()
        self.norm = norm_layer(dim)
        hidden = hidden_width(dim, ratio, name="nll_ratio")
        self.mlp = Mlp(in_features=dim, hidden_features=hidden, act_layer=act_layer, drop=drop)
        self.res = LearnableResidual(mode=lrc)

    def forward(self, x: Tensor) -> Tensor:
        return self.res(x, self.mlp(self.norm(x)))


class RecursiveStage(nn.Module):
    """Apply each of ``blocks`` ``loops`` times, an unshared NLL after every application.

    ``forward(x [B, N, C]) -> [B, N, C]``. ``nll_ratio = 0`` leaves the NLLs out (the
    ablation "recursion without NLL"). ``layers()`` lists the execution order.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        *,
        dim: int,
        loops: int = 2,
        nll_ratio: float = 1.0,
        lrc: LRCMode = "both",
        drop: float = 0.0,
        norm_layer: Callable[[int], nn.Module] = LAYER_NORM,
    ) -> None:
        super().__init__()
        check_positive(loops=loops)
        if len(blocks) < 1:
            raise ValueError("a recursive stage needs at least one block")
        check_positive_number(zero_ok=True, nll_ratio=nll_ratio)  # 0 disables the NLL layers
        self.loops = loops
        self.blocks = nn.ModuleList(blocks)
        n = len(blocks) * loops
        self.nlls = (
            nn.ModuleList(
                NonLinearProjection(dim, ratio=nll_ratio, lrc=lrc, drop=drop, norm_layer=norm_layer)
                for _ in range(n)
            )
            if nll_ratio > 0
            else None
        )

    @property
    def depth(self) -> int:
        """Number of block applications (the stage's depth as the paper counts it)."""
        return len(self.blocks) * self.loops

    def layers(self) -> list[tuple[nn.Module, int | None]]:
        """Execution order as ``(module, pass_index)``; NLLs have ``pass_index`` None."""
        order: list[tuple[nn.Module, int | None]] = []
        for b, block in enumerate(self.blocks):
            for p in range(self.loops):
                order.append((block, p))
                if self.nlls is not None:
                    order.append((self.nlls[b * self.loops + p], None))
        return order

    def forward(self, x: Tensor) -> Tensor:
        for module, pass_index in self.layers():
            x = module(x) if pass_index is None else module(x, pass_index)
        return x


__all__ = ["NonLinearProjection", "RecursiveStage"]
