"""``conv``: a learned 2x2 stride-2 convolution on the token grid (Token Pooling, appendix D),
placed at the blocks a budget asks to halve (or at ``layers=[...]``)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leanformer.pooling.budgets import KeepLike, budget_to_count, parse_keep
from leanformer.pooling.reducer import OFF_GRID, Grid, ReducerBase, halved_grid
from leanformer.pooling.registry import NothingPlaced, PoolingMethod, register


class ConvDownsample(ReducerBase):
    """Learned 2x2 stride-2 convolution on the token grid, same width (appendix D).

    Tokens must be in raster order on an ``h x w`` grid. A patched host passes the grid it
    embedded (``grid=``), so any input size is read right. Called without one, the layer
    reads the count: the grid given at construction, that grid halved (the entry step
    ran this layer once before), or, when the count differs (another input resolution),
    a square grid. A grid with an
    odd side is padded by repeating its last row/column (sizes of the padding are 0), so
    the output grid is ``ceil(h/2) x ceil(w/2)``. Tokens that no longer form a grid (after
    a clustering/selection layer) raise a ``ValueError``: conv can only follow conv.

    The kernel starts as 2x2 average pooling (identity per channel / 4), so an inserted
    layer is sensible before any training; it is learned from there. Output sizes are the
    sums of the window's sizes.
    """

    needs_received = False
    reads_grid = True

    def __init__(self, *, dim: int, grid_size: tuple[int, int], carry: bool = False) -> None:
        super().__init__(keep=1.0, carry=carry)
        self.grid_size = (int(grid_size[0]), int(grid_size[1]))
        self.conv = nn.Conv2d(dim, dim, kernel_size=2, stride=2)
        with torch.no_grad():
            self.conv.weight.zero_()
            eye = torch.eye(dim)[:, :, None, None].expand(dim, dim, 2, 2)
            self.conv.weight.copy_(eye / 4.0)
            assert self.conv.bias is not None  # Conv2d's default bias=True
            self.conv.bias.zero_()

    def grid_for(self, n: int, grid: Grid | None = None) -> Grid:
        """The grid ``n`` tokens lie on: ``grid`` when given (checked against ``n``), else
        read from the count as the class docstring says."""
        if grid == OFF_GRID:
            raise ValueError(
                f"conv downsampling needs the tokens on their grid: the {n} tokens it got come "
                "from a clustering, selection or merge before it; conv can only follow other conv layers"
            )
        if grid is not None:
            h, w = grid
            if h * w != n:
                raise ValueError(
                    f"conv downsampling got {n} tokens on a {h}x{w} grid ({h * w} places): "
                    "conv can only follow other conv layers"
                )
            return h, w
        h, w = built = self.grid_size
        if n == h * w:
            return h, w
        # Its own grid halved (2x2 windows, odd sides rounded up): what this layer receives
        # after the entry step (reduce_at="entry") ran it once on the full grid.
        while h * w > 1:
            h, w = halved_grid(h, w)
            if n == h * w:
                return h, w
        side = math.isqrt(n)
        if side * side == n:
            return side, side
        raise ValueError(
            f"conv downsampling needs the tokens on their grid: got {n} tokens, expected "
            f"{built[0]}x{built[1]}={built[0] * built[1]}, a 2x2 halving of it, or a square number; "
            "conv can only follow other conv layers"
        )

    def output_count(self, n: int, grid: Grid | None = None) -> int:
        h, w = self.grid_for(n, grid)
        return n if n <= 1 else math.prod(halved_grid(h, w))

    def _reduce(
        self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None, k: int, grid: Grid | None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        B, N, C = tokens.shape
        h, w = self.grid_for(N, grid)
        h2, w2 = halved_grid(h, w)
        if k != h2 * w2:  # output_count (N > k >= 1 here, so N > 1)
            # A 2x2 window has one output count per grid; keeping any other (the entry
            # step's fade, a caller's count=) would silently keep this one instead.
            raise ValueError(
                f"conv downsampling keeps {h2 * w2} of {N} tokens (2x2 windows); "
                f"it cannot keep {k}: use a clustering, selection or merging method for that budget"
            )
        pad = (0, w % 2, 0, h % 2)  # right, bottom
        grid_tokens = tokens.transpose(1, 2).reshape(B, C, h, w)
        if any(pad):
            grid_tokens = F.pad(grid_tokens, pad, mode="replicate")
        out = self.conv(grid_tokens).flatten(2).transpose(1, 2)
        out_sizes = None
        if sizes is not None:
            s = F.pad(sizes.reshape(B, 1, h, w), pad)  # padded copies stand for no token
            out_sizes = F.avg_pool2d(s, 2).flatten(1) * 4.0
        rows = torch.arange(h, device=tokens.device) // 2
        cols = torch.arange(w, device=tokens.device) // 2
        assign = (rows[:, None] * w2 + cols[None, :]).flatten().expand(B, N)
        return out, out_sizes, assign

    def extra_repr(self) -> str:
        return f"grid_size={self.grid_size}, carry={self.carry}"


def _build_conv(
    keep: KeepLike | None,
    *,
    depth: int,
    num_tokens: int,
    dim: int,
    grid_size: tuple[int, int],
    carry: bool,
    layers: Any = None,
) -> list[nn.Module | None]:
    """``conv``: a learned downsampler at the blocks in ``layers``, or else at each block
    where ``keep`` asks to drop at least half of the tokens it receives."""
    h, w = int(grid_size[0]), int(grid_size[1])
    if layers is None:
        if keep is None:
            raise ValueError("conv pooling needs layers=[block indices] or keep= to place its layers")
        budgets = parse_keep(keep).per_block(depth=depth, num_tokens=h * w)
        chosen, n, gh, gw = [], h * w, h, w
        for i, budget in enumerate(budgets):
            if n > 1 and budget_to_count(budget, n) <= n // 2:
                chosen.append(i)
                gh, gw = halved_grid(gh, gw)
                n = gh * gw
        if not chosen and any(budget_to_count(b, h * w) < h * w for b in budgets):
            # Placing none would silently leave the model unpooled.
            raise NothingPlaced(
                f"conv cannot keep keep={parse_keep(keep)} of the tokens: each conv layer keeps a "
                "quarter of them (2x2 windows) and sits only where a block keeps half or fewer, so the "
                "nearest budgets it reaches keep 1.0 (no layer) or 0.25 at a block: give keep=0.5 or "
                "lower, layers=[...], or a GFLOPs fraction such as 0.6x"
            )
        layers = chosen
    else:
        if isinstance(layers, int | str):
            layers = [int(t) for t in str(layers).split(",") if t.strip()]
        for i in layers:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < depth:
                raise ValueError(f"conv layers must be block indices in [0, {depth}), got {i!r}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"conv layers must be distinct, got {list(layers)}")
    reducers: list[nn.Module | None] = [None] * depth
    for i in sorted(layers):
        reducers[i] = ConvDownsample(dim=dim, grid_size=(h, w), carry=carry)
        h, w = halved_grid(h, w)
    return reducers


register(
    PoolingMethod("conv", "learned 2x2 stride-2 conv on the token grid", None, ("layers",), build=_build_conv)
)
