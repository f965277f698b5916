"""What an unpooled output shows where a selection dropped a token: the token that the
nearest surviving patch went into.

A merging or clustering reducer sends every token somewhere, so its unpooled output
needs no fill. A selection (PoWER-BERT's top-K, random, importance sampling) drops
tokens; their positions take the output of the patch nearest on the image grid (Euclidean
distance between patch centres; of equally near ones, the lower output index) whose
token survived every block. This is nearest-neighbour upsampling of what survived: one
small distance search per forward, on positions only, after the last block.

Why by position: the alternative, a search in every block that drops tokens for the kept
token most like each dropped one (cosine similarity), shows selections' dropped patches
better (higher mIoU on segmentation: ``benchmarks/bench_unpool_fill.py``), but its many
small products cost 7.4% of a DeiT-S block at batch 32, where this search, on positions
only and once per forward, costs a fraction of that (``benchmarks/bench_unpool.py``).
Merging and clustering reducers, which keep the most per GFLOP, need no fill at all.
"""

from __future__ import annotations

import torch
from torch import Tensor

from leanformer.pooling.reducer import Grid


def fill_from_nearest_position(assign: Tensor, *, num_prefix: int, outputs: int, grid: Grid | None) -> Tensor:
    """``assign [B, P + N]`` (prefix tokens first; for each token, the one of the ``outputs``
    output tokens it went into, -1 where it was dropped) with every dropped patch given
    the output token whose patches' centre is nearest to it, on ``grid`` (rows, cols; None
    or a grid that does not hold ``N`` patches: their order in the sequence). After
    selections alone each output token holds one patch, so this is the nearest surviving
    patch. Rows in which every patch was dropped keep -1 (the caller shows the class token).
    Memory ``B x N x outputs`` (a few tensors of it): each position against the output
    tokens, not against every other position."""
    patches = assign[:, num_prefix:]
    B, n = patches.shape
    if n == 0 or outputs == 0:
        return assign
    index = torch.arange(n, device=assign.device)
    if grid is not None and grid[0] * grid[1] == n:
        rows, cols = torch.div(index, grid[1], rounding_mode="floor"), index % grid[1]
        where = torch.stack([rows, cols], dim=-1).float()
    else:
        where = index[:, None].float()
    # Each output token's centre: the mean position of the patches it holds (a slot for
    # dropped patches, index `outputs`, collects them and is cut off).
    slot = torch.where(patches >= 0, patches, outputs)
    sums = where.new_zeros(B, outputs + 1, where.shape[1]).index_put_(
        (torch.arange(B, device=assign.device)[:, None], slot), where.expand(B, n, -1), accumulate=True
    )
    counts = where.new_zeros(B, outputs + 1).index_put_(
        (torch.arange(B, device=assign.device)[:, None], slot), where.new_ones(B, n), accumulate=True
    )
    centres = sums[:, :outputs] / counts[:, :outputs, None].clamp(min=1)
    # Squared distances; output tokens holding no patch (prefix tokens) are never nearest.
    # Ties go to the lower output index (argmin's first): the fill is deterministic.
    # One coordinate at a time: no [B, N, outputs, 2] temporary.
    distance = (where[None, :, None, 0] - centres[:, None, :, 0]).square()  # [B, N, outputs]
    for d in range(1, where.shape[1]):  # the grid's columns, when it has them
        distance = distance + (where[None, :, None, d] - centres[:, None, :, d]).square()
    distance = distance.masked_fill((counts[:, None, :outputs] == 0), float("inf"))
    nearest = distance.argmin(dim=-1)
    # A row with no patch left keeps -1 (every distance inf there).
    nearest = torch.where((counts[:, :outputs] > 0).any(dim=1, keepdim=True), nearest, -1)
    filled = torch.where(patches >= 0, patches, nearest)
    return torch.cat([assign[:, :num_prefix], filled], dim=1)
