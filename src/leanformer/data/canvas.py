"""Garments scattered on a square canvas: the images, boxes, classes and masks of ``fashion_detect``.

:func:`compose_canvases` places 1 to ``max_objects`` garments (28x28 grey images) on each
canvas at random positions and sizes, later garments drawn over earlier ones. Two
garments may overlap a little: the intersection of their square placements is at most
``max_overlap`` of the smaller one. Every pixel belongs to at most one garment (the
``owner`` map), so instance masks (the garment's visible pixels), the semantic map and
the boxes (tight around the visible pixels) all derive from it and agree by construction.

Generation is batched over canvases (one step per object slot, not per canvas) and
depends only on the garments and the seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

_CHUNK = 512  # canvases composed at once: bounds the float work buffers (~75 MB at 128 px)


@dataclass(frozen=True)
class CanvasSpec:
    """How canvases are drawn. Sizes are the side, in pixels, of a garment's square placement."""

    canvas_size: int = 128
    max_objects: int = 6
    min_size: int = 20
    max_size: int = 64
    max_overlap: float = 0.2  # pairwise intersection / area of the smaller placement
    tries: int = 16  # positions tried per garment before it is left out
    threshold: float = 0.1  # a garment pixel brighter than this (in [0, 1]) is the garment's own

    def check(self) -> None:
        if not 1 <= self.max_objects <= 127:  # owner ids are int8
            raise ValueError(f"max_objects must be in [1, 127], got {self.max_objects}")
        if not 4 <= self.min_size <= self.max_size:
            raise ValueError(f"need 4 <= min_size <= max_size, got {self.min_size} and {self.max_size}")
        if self.max_size > self.canvas_size:
            raise ValueError(f"max_size {self.max_size} exceeds the canvas size {self.canvas_size}")
        if not 0.0 <= self.max_overlap < 1.0:
            raise ValueError(f"max_overlap must be in [0, 1), got {self.max_overlap}")
        if self.tries < 1:
            raise ValueError(f"tries must be >= 1, got {self.tries}")


@dataclass(frozen=True)
class Canvases:
    """``images [N, S, S]`` uint8; ``owner [N, S, S]`` int8, the object slot drawn at each pixel
    (-1: background); ``labels [N, J]`` int64 class of each slot (-1: empty slot, or a garment
    left with no visible pixel); ``boxes [N, J, 4]`` float32 ``(x0, y0, x1, y1)`` in pixels,
    tight around the slot's visible pixels (``x1`` one past the last column, as COCO counts)."""

    images: Tensor
    owner: Tensor
    labels: Tensor
    boxes: Tensor

    def __len__(self) -> int:
        return self.images.shape[0]

    def semantic(self, index: int) -> Tensor:
        """``[S, S]`` int64: 0 background, ``1 + class`` where a garment shows."""
        owner = self.owner[index].long()
        classes = torch.cat([torch.zeros(1, dtype=torch.long), self.labels[index] + 1])
        return classes[owner + 1]

    def instances(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        """The canvas's objects: ``boxes [K, 4]``, ``labels [K]`` and ``masks [K, S, S]`` bool."""
        present = (self.labels[index] >= 0).nonzero().flatten()
        masks = self.owner[index][None] == present[:, None, None].to(torch.int8)
        return self.boxes[index, present], self.labels[index, present], masks


def compose_canvases(
    garments: Tensor, classes: Tensor, *, num_canvases: int, seed: int, spec: CanvasSpec | None = None
) -> Canvases:
    """``num_canvases`` canvases from ``garments [M, h, w]`` uint8 of ``classes [M]``, drawn
    (with replacement) by a generator seeded with ``seed``."""
    spec = spec or CanvasSpec()
    spec.check()
    if garments.ndim != 3 or classes.shape != garments.shape[:1] or len(garments) == 0:
        raise ValueError(
            f"need garments [M, h, w] and classes [M] with M >= 1, got {tuple(garments.shape)} "
            f"and {tuple(classes.shape)}"
        )
    if num_canvases < 1:
        raise ValueError(f"num_canvases must be >= 1, got {num_canvases}")
    generator = torch.Generator().manual_seed(seed)
    chunks = [
        _compose_chunk(garments, classes, min(_CHUNK, num_canvases - start), spec, generator)
        for start in range(0, num_canvases, _CHUNK)
    ]
    return Canvases(*(torch.cat(parts) for parts in zip(*chunks)))


def _compose_chunk(
    garments: Tensor, classes: Tensor, n: int, spec: CanvasSpec, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    S, J, T, M = spec.canvas_size, spec.max_objects, spec.tries, spec.max_size
    counts = torch.randint(1, J + 1, (n,), generator=generator)
    picks = torch.randint(len(garments), (n, J), generator=generator)
    sizes = torch.randint(spec.min_size, spec.max_size + 1, (n, J), generator=generator)
    # Top-left corners, uniform over the positions that keep the garment inside: [n, J, T, 2].
    room = (S - sizes + 1).float()[:, :, None, None]
    corners = (torch.rand(n, J, T, 2, generator=generator) * room).long()
    placed, active = _place(corners, sizes, counts, spec.max_overlap)
    tiles = _resized_tiles(garments, picks, sizes, M)
    canvas = torch.zeros(n, S + M, S + M)  # margin of M so a tile never needs clipping
    owner = torch.full((n, S + M, S + M), -1, dtype=torch.int8)
    rows_of = torch.arange(n)[:, None, None]
    span = torch.arange(M)
    for j in range(J):  # later slots are drawn over earlier ones
        rows = (placed[:, j, 1:2] + span)[:, :, None]  # [n, M, 1]
        cols = (placed[:, j, 0:1] + span)[:, None, :]  # [n, 1, M]
        draw = (tiles[:, j] > spec.threshold) & active[:, j, None, None]
        canvas[rows_of, rows, cols] = torch.where(draw, tiles[:, j], canvas[rows_of, rows, cols])
        owner[rows_of, rows, cols] = torch.where(draw, j, owner[rows_of, rows, cols]).to(torch.int8)
    canvas, owner = canvas[:, :S, :S], owner[:, :S, :S].contiguous()
    boxes, visible = _tight_boxes(owner, J)
    labels = torch.where(visible, classes.long()[picks], -1)
    images = (canvas * 255).round().clamp(0, 255).to(torch.uint8)
    return images, owner, labels, boxes


def _place(corners: Tensor, sizes: Tensor, counts: Tensor, max_overlap: float) -> tuple[Tensor, Tensor]:
    """Greedy placement, slot by slot: each garment takes its first tried corner whose
    overlap with every garment already placed is small enough. ``corners [n, J, T, 2]``
    (x, y) -> chosen corners ``[n, J, 2]`` and which slots hold a garment ``[n, J]``."""
    n, J, T, _ = corners.shape
    chosen = torch.zeros(n, J, 2, dtype=torch.long)
    active = torch.zeros(n, J, dtype=torch.bool)
    for j in range(J):
        x0, y0 = corners[:, j, :, 0], corners[:, j, :, 1]  # [n, T]
        s = sizes[:, j, None]
        fits = torch.ones(n, T, dtype=torch.bool)
        for k in range(j):
            px, py, ps = chosen[:, k, 0:1], chosen[:, k, 1:2], sizes[:, k, None]
            iw = (torch.minimum(x0 + s, px + ps) - torch.maximum(x0, px)).clamp_min(0)
            ih = (torch.minimum(y0 + s, py + ps) - torch.maximum(y0, py)).clamp_min(0)
            smaller = torch.minimum(s, ps).square()
            fits &= ~active[:, k, None] | (iw * ih <= max_overlap * smaller)
        first = fits.long().argmax(dim=1)  # the first fitting try (0 when none fits)
        chosen[:, j] = corners[torch.arange(n), j, first]
        active[:, j] = fits.any(dim=1) & (j < counts)
    return chosen, active


def _resized_tiles(garments: Tensor, picks: Tensor, sizes: Tensor, tile: int) -> Tensor:
    """``[n, J, tile, tile]`` floats in [0, 1]: each picked garment resized to its size, at the
    tile's top-left. Resized one size at a time (a few dozen sizes), not one garment at a time."""
    n, J = picks.shape
    tiles = torch.zeros(n * J, tile, tile)
    flat_picks, flat_sizes = picks.flatten(), sizes.flatten()
    for size in flat_sizes.unique().tolist():
        which = (flat_sizes == size).nonzero().flatten()
        source = garments[flat_picks[which]].float()[:, None] / 255
        resized = F.interpolate(
            source, size=(size, size), mode="bilinear", antialias=True, align_corners=False
        )
        tiles[which, :size, :size] = resized[:, 0].clamp(0, 1)
    return tiles.view(n, J, tile, tile)


def _tight_boxes(owner: Tensor, slots: int) -> tuple[Tensor, Tensor]:
    """Boxes ``[n, J, 4]`` around each slot's pixels in ``owner [n, S, S]`` and whether the slot
    has any ``[n, J]`` (an empty slot's box is zeros)."""
    S = owner.shape[-1]
    masks = owner[:, None] == torch.arange(slots, dtype=torch.int8)[None, :, None, None]  # [n, J, S, S]
    in_cols, in_rows = masks.any(dim=2), masks.any(dim=3)  # [n, J, S] each
    visible = in_cols.any(dim=2)
    index = torch.arange(S)

    def first_last(hit: Tensor) -> tuple[Tensor, Tensor]:
        first = torch.where(hit, index, S).amin(dim=2)
        last = torch.where(hit, index, -1).amax(dim=2)
        return first, last + 1

    x0, x1 = first_last(in_cols)
    y0, y1 = first_last(in_rows)
    boxes = torch.stack([x0, y0, x1, y1], dim=-1).float()
    return torch.where(visible[..., None], boxes, 0.0), visible
