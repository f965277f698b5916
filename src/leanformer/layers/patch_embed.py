"""Patch embedding and position embeddings that work at any input resolution."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from leanformer.layers.checks import as_int, check_positive


def resample_pos_embed(pos_embed: Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int]) -> Tensor:
    """Bicubically resize a grid of position embeddings ``[1, H*W, C]`` -> ``[1, H'*W', C]``."""
    if old_grid == new_grid:
        return pos_embed
    C = pos_embed.shape[-1]
    grid = pos_embed.reshape(1, old_grid[0], old_grid[1], C).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new_grid, mode="bicubic", align_corners=False)
    return grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], C)


class PatchEmbed(nn.Module):
    """Non-overlapping ``patch_size`` conv: ``[B, C_in, H, W] -> ([B, H/p * W/p, D], (H/p, W/p))``.

    Unlike a fixed-size embedding it accepts any input whose sides are multiples of the
    patch size and reports the token grid, so position embeddings can be resampled.
    """

    def __init__(self, *, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        check_positive(patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        if x.ndim != 4:
            raise ValueError(f"expected images [B, C, H, W], got shape {tuple(x.shape)}")
        check_image_sides(x.shape[-2], x.shape[-1], (self.patch_size, self.patch_size))
        x = self.proj(x)
        grid = (x.shape[-2], x.shape[-1])
        return x.flatten(2).transpose(1, 2), grid


def check_image_sides(height: int, width: int, patch: tuple[int, int]) -> None:
    """A ValueError naming both sizes when an image's sides are not multiples of the patch."""
    if height % patch[0] or width % patch[1]:
        raise ValueError(
            f"image size {height}x{width} is not a multiple of the patch size {patch[0]}x{patch[1]}; "
            "give an image size that is a multiple of it (--img-size)"
        )


def to_2tuple(v: int | tuple[int, int] | list[int], *, name: str = "img_size") -> tuple[int, int]:
    """``224`` -> ``(224, 224)``; ``(H, W)`` stays; anything else, or sizes < 1, is a ``ValueError``."""
    side = as_int(v)
    pair: tuple[Any, ...] | None = (
        (v, v) if side is not None else tuple(v) if isinstance(v, tuple | list) else None
    )
    if pair is None or len(pair) != 2:
        raise ValueError(f"{name} must be a size or a (height, width) pair, got {v!r}")
    sides: dict[str, Any] = {f"{name} height": pair[0], f"{name} width": pair[1]}
    check_positive(**sides)
    return (int(pair[0]), int(pair[1]))


__all__ = ["PatchEmbed", "check_image_sides", "resample_pos_embed", "to_2tuple"]
