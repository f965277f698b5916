"""Which input patches does each token stand for? The trace behind `leanformer visualize clusters`.

Every reducer outputs, per example, a linear combination of its input tokens whose weights
come from a no-gradient plan (cluster means, kept tokens, merged pairs). Its Jacobian row
for output token k is therefore the membership of k, and composing these matrices over
the blocks gives, for every original patch, the token it ended up in. The trace reads
the Jacobians with one batched backward per pooling layer, so it works for every
method without knowing its internals (for ``conv``, the 2x2 window).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from leanformer.pooling.reducer import BudgetedReducer, Grid, count_after, reads_grid


class _SourceProbe(nn.Module):
    """Wraps a reducer; records ``S [B, K, N0]``: how much of each original patch is in each token."""

    def __init__(self, inner: nn.Module, trace: list[Tensor | None], index: int) -> None:
        super().__init__()
        self.inner = inner
        self.needs_received = bool(getattr(inner, "needs_received", False))
        self.reads_grid = reads_grid(inner)
        self.__dict__["_trace"] = trace  # shared, not a submodule
        self.index = index

    def output_count(self, n: int, grid: Grid | None = None) -> int:
        # The entry step (reduce_at="entry") sizes itself from every reducer's count.
        return count_after(cast(BudgetedReducer, self.inner), n, grid)

    def forward(
        self,
        tokens: Tensor,
        sizes: Tensor | None,
        received: Tensor | None,
        count: int | None = None,
        grid: Grid | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        trace: list[Tensor | None] = self.__dict__["_trace"]
        with torch.enable_grad():
            t = tokens.detach().requires_grad_(True)
            # The entry step's count, and conv's grid, reach the reducer as they reached us.
            extra = {k: v for k, v in (("count", count), ("grid", grid)) if v is not None}
            out, out_sizes = self.inner(t, sizes, received, **extra)
            B, K, C = out.shape
            # Cotangent j is one-hot on (token j, channel 0) for every example: row j of
            # each example's Jacobian in a single batched backward.
            cot = out.new_zeros(K, B, K, C)
            cot[torch.arange(K), :, torch.arange(K), 0] = 1.0
            (jac,) = torch.autograd.grad(out, t, grad_outputs=cot, is_grads_batched=True)
        # Sum |d out_j,0 / d t_n,c| over input channels: a cluster mean only touches
        # channel 0, a conv mixes channels; either way it is >0 exactly for members.
        member = jac.abs().sum(-1).permute(1, 0, 2)  # [B, K, N]
        prev = _last(trace)
        src = member if prev is None else member @ prev
        trace[self.index] = src
        return out.detach(), out_sizes


def _last(trace: list[Tensor | None]) -> Tensor | None:
    for s in reversed(trace):
        if s is not None:
            return s
    return None


def _reducer_slots(model: nn.Module) -> list[tuple[Any, Any, nn.Module | None]]:
    """``(block, set, reducer)`` per block of a token-pooled model (any host)."""
    pooling = getattr(model, "token_pooling", None)
    if pooling is None:
        raise ValueError(f"{type(model).__name__} has no token pooling to trace")
    slots = []
    for i in range(pooling.depth):
        key = str(i)

        def setter(r: nn.Module, key: str = key) -> None:
            pooling.reducers[key] = r

        slots.append((i, setter, pooling.reducer(i)))
    return slots


@torch.no_grad()
def trace_token_sources(model: nn.Module, x: Tensor) -> list[Tensor | None]:
    """Per block, ``S [B, K_l, N0]`` (>0 where patch n is part of token k after block l), or
    None for a block without a reducer. ``N0`` counts patch tokens (no prefix tokens)."""
    blocks: Any = getattr(model, "blocks", None)
    if getattr(model, "token_pooling", None) is None and isinstance(blocks, nn.Sequential):
        # The unpooled model (method none): every patch stays its own token in every block.
        return [None] * len(blocks)
    slots = _reducer_slots(model)
    trace: list[Tensor | None] = [None] * len(slots)
    replaced = []
    try:
        for i, setter, reducer in slots:
            if reducer is not None:
                setter(_SourceProbe(reducer, trace, i))
                replaced.append((setter, reducer))
        model.eval()
        model(x)
    finally:
        for setter, reducer in replaced:
            setter(reducer)
    return trace


def patch_assignment(trace: list[Tensor | None], layer: int, num_patches: int, batch: int) -> Tensor:
    """``[B, N0]`` token index of every patch after block ``layer`` (-1: dropped patch)."""
    src = _last(trace[: layer + 1])
    if src is None:  # nothing pooled yet: every patch is its own token
        return torch.arange(num_patches).expand(batch, num_patches).clone()
    best, idx = src.max(dim=1)
    return torch.where(best > 0, idx, torch.full_like(idx, -1))


def to_image(x: Tensor) -> Any:
    """``[C, H, W]`` normalised tensor -> ``[H, W, 3]`` array in [0, 1] (min-max per image)."""
    x = x.float()
    x = (x - x.min()) / (x.max() - x.min()).clamp_min(1e-8)
    img = x.permute(1, 2, 0).cpu().numpy()
    return img[..., :3] if img.shape[2] >= 3 else img[..., 0]


def grid_of(model: nn.Module) -> tuple[int, int]:
    grid = getattr(model, "grid_size", None)
    if grid is None:
        patch_embed: Any = model.patch_embed  # a timm ViT's
        grid = patch_embed.grid_size
    return int(grid[0]), int(grid[1])
