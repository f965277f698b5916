"""Per-modality feature extractors for paired-input models (DRRT's feature-extraction stage).

Each turns one modality's raw input into tokens ``[B, T, D]`` laid out on a 2-D grid
``grid = (rows, cols)`` (``T = rows * cols``), so default regions can be cut
topographically, and maps an input-level region map to per-token labels:

- :class:`ImagePatchTokens`: an image ``[B, C, H, W]`` -> non-overlapping patches, a
  learned position embedding (resampled for other sizes), optional transformer blocks.
- :class:`PointTokens`: point measurements ``[B, P]`` or ``[B, P, F]`` (e.g. a visual
  field's sensitivities on a grid of test locations) -> a shared per-point linear
  embedding plus a learned embedding per location, optional transformer blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import Tensor, nn

from leanformer.layers.block import Block
from leanformer.layers.checks import check_patch_grid, check_positive, head_dim
from leanformer.layers.patch_embed import PatchEmbed, resample_pos_embed, to_2tuple


def grid_regions(grid: tuple[int, int], region_grid: tuple[int, int]) -> Tensor:
    """Labels ``[rows * cols]`` cutting a token grid into ``rh x rw`` blocks (row-major).

    With ``region_grid=(2, 2)`` these are quadrants; tokens at the same relative
    position on two grids of different sizes get the same label.
    """
    (gh, gw), (rh, rw) = grid, region_grid
    if rh < 1 or rw < 1 or rh > gh or rw > gw:
        raise ValueError(f"cannot cut a {gh}x{gw} token grid into {rh}x{rw} regions")
    rows = torch.arange(gh) * rh // gh
    cols = torch.arange(gw) * rw // gw
    return (rows[:, None] * rw + cols[None, :]).flatten()


class _Encoder(nn.Module):
    """Optional pre-norm transformer blocks, then a LayerNorm: ``[B, T, D] -> [B, T, D]``.

    The final norm puts the features on a unit scale whatever the depth: the local
    recurrence after it would otherwise see embeddings at init scale (~0.02), far below
    its own bias, and its outputs would hardly differ between examples.
    """

    def __init__(self, dim: int, *, depth: int, num_heads: int, mlp_ratio: float, drop: float) -> None:
        super().__init__()
        check_positive(minimum=0, extractor_depth=depth)
        if depth:
            head_dim(dim, num_heads)
        self.blocks = nn.ModuleList(
            Block(dim, num_heads=num_heads, mlp_ratio=mlp_ratio, proj_drop=drop) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class ImagePatchTokens(nn.Module):
    """``[B, C, H, W] -> [B, (H/p)(W/p), D]``; any size that is a multiple of the patch."""

    def __init__(
        self,
        *,
        img_size: int | tuple[int, int],
        patch_size: int,
        in_chans: int,
        dim: int,
        depth: int = 0,
        num_heads: int = 4,
        mlp_ratio: float = 2.0,
        drop: float = 0.0,
    ) -> None:
        super().__init__()
        self.img_size = to_2tuple(img_size)
        check_patch_grid(self.img_size, patch_size)
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.dim = dim
        self.grid = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        self.num_tokens = self.grid[0] * self.grid[1]
        self.patch_embed = PatchEmbed(patch_size=patch_size, in_chans=in_chans, embed_dim=dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_tokens, dim))
        trunc_normal_(self.pos_embed, std=0.02)
        self.encoder = _Encoder(dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, drop=drop)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 4 or x.shape[1] != self.in_chans:
            raise ValueError(f"expected images [B, {self.in_chans}, H, W], got shape {tuple(x.shape)}")
        tokens, grid = self.patch_embed(x)
        return self.encoder(tokens + resample_pos_embed(self.pos_embed, self.grid, grid))

    def token_regions(self, region_map: Tensor, num_regions: int) -> Tensor:
        """Per-token labels from a pixel region map ``[H, W]`` or ``[B, H, W]`` (or per-token labels).

        A patch takes the label most of its pixels carry (ties -> the lower label; ``-1``,
        no region, counts as a label too). Labels that already have one entry per token
        (``[T]``, or ``[B, T]`` for the built token count) are returned as they are; a 2-D
        map of the built image size is read as a pixel map. For inputs of another size pass
        ``[T]`` or ``[B, H, W]``.
        """
        if region_map.ndim == 1:
            return region_map  # one label per token (checked against the token count later)
        # [H, W] at the built size is a pixel map even when W happens to equal T.
        if (
            region_map.ndim == 2
            and region_map.shape[-1] == self.num_tokens
            and tuple(region_map.shape) != self.img_size
        ):
            return region_map
        if region_map.ndim not in (2, 3):
            raise ValueError(
                f"an image region map must be [H, W], [B, H, W] or per token [T]; "
                f"got shape {tuple(region_map.shape)}"
            )
        if region_map.dtype.is_floating_point or region_map.dtype == torch.bool:
            raise ValueError(f"region maps must hold integer labels, got dtype {region_map.dtype}")
        p = self.patch_size
        H, W = region_map.shape[-2:]
        if H % p or W % p:
            raise ValueError(f"region map size {H}x{W} is not a multiple of the patch size {p}")
        batched = region_map if region_map.ndim == 3 else region_map[None]
        lo, hi = int(batched.min()), int(batched.max())  # one sync: one_hot needs the range
        if lo < -1 or hi >= num_regions:
            raise ValueError(
                f"region map labels must be in [0, {num_regions}) (or -1 for no region); got [{lo}, {hi}]"
            )
        # Count each label's pixels per patch with one pooling over one-hot planes (-1 -> plane 0).
        planes = F.one_hot(batched.long() + 1, num_regions + 1).permute(0, 3, 1, 2).float()
        counts = F.avg_pool2d(planes, p)  # [B, K+1, H/p, W/p]
        labels = counts.argmax(1).flatten(1) - 1  # [B, T]
        return labels if region_map.ndim == 3 else labels[0]


class PointTokens(nn.Module):
    """Point measurements on a ``rows x cols`` grid of locations -> tokens ``[B, P, D]``.

    Input ``[B, P]`` (one value per location) or ``[B, P, F]`` (``F = point_features``);
    locations are in row-major grid order. Each value goes through the same linear map
    and each location adds its own learned embedding (the location is the only thing
    that tells two measurements apart).
    """

    def __init__(
        self,
        *,
        grid: tuple[int, int] | int,
        point_features: int = 1,
        dim: int,
        depth: int = 0,
        num_heads: int = 4,
        mlp_ratio: float = 2.0,
        drop: float = 0.0,
    ) -> None:
        super().__init__()
        self.grid = to_2tuple(grid, name="points_grid")
        check_positive(point_features=point_features)
        self.num_tokens = self.grid[0] * self.grid[1]
        self.point_features = point_features
        self.dim = dim
        self.embed = nn.Linear(point_features, dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_tokens, dim))
        trunc_normal_(self.pos_embed, std=0.02)
        self.encoder = _Encoder(dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, drop=drop)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim == 2 and self.point_features == 1:
            x = x[..., None]
        if x.ndim != 3 or x.shape[1:] != (self.num_tokens, self.point_features):
            raise ValueError(
                f"expected point measurements [B, {self.num_tokens}]"
                + (f" or [B, {self.num_tokens}, 1]" if self.point_features == 1 else "")
                + f" with {self.point_features} feature(s) per point, got shape {tuple(x.shape)}; "
                f"this model's points_grid is {self.grid[0]}x{self.grid[1]}: build it for the data's "
                "grid (--opt points_grid=N for N x N points, or [rows, cols])"
            )
        return self.encoder(self.embed(x) + self.pos_embed)

    def token_regions(self, region_map: Tensor, num_regions: int) -> Tensor:
        """Per-point labels ``[P]`` or ``[B, P]`` are already per token; checked by the caller."""
        del num_regions
        return region_map


__all__ = ["ImagePatchTokens", "PointTokens", "grid_regions"]
