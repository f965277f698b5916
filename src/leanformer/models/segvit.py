"""``segvit``: a DeiT backbone with a linear head on every patch token, for semantic segmentation.

Segmenter's linear baseline: each patch token's features map to class logits, the
``rows x cols`` grid of them is upsampled bilinearly to the image. With token pooling
(``pool=...``) the backbone unpools (``unpool=True``): every patch position shows the
output of the token it was merged or clustered into, so any reducer serves the head.
``forward(images [B, C, H, W]) -> logits [B, classes, H, W]``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from leanformer.models.deit import DeiT
from leanformer.models.registry import register


class SegViT(DeiT):
    """DeiT + per-token linear head; ``num_classes`` counts the background too."""

    task = "semantic"

    def __init__(self, *, pool: str = "none", unpool: bool = True, **kwargs: Any) -> None:
        if pool != "none" and unpool is not True:
            raise ValueError(
                "segvit predicts every patch position: with token pooling it needs unpool=True "
                "(the default), which gives each position the output of the token it went into"
            )
        super().__init__(pool=pool, unpool=pool != "none", **kwargs)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """``x [B, P + N, C]`` (every patch position of an image at the configured size) ->
        logits on its patch grid ``[B, classes, rows, cols]``."""
        return self._grid_logits(x, self.grid_size, pre_logits)

    def _grid_logits(self, x: Tensor, grid: tuple[int, int], pre_logits: bool = False) -> Tensor:
        rows, cols = grid
        patches = x[:, self.num_prefix_tokens :]
        if patches.shape[1] != rows * cols:
            raise ValueError(
                f"segvit's head needs all {rows * cols} patch positions and got {patches.shape[1]}: "
                "keep model.token_pooling.unpool_output = True"
            )
        patches = self.head_drop(patches)
        if pre_logits:
            return patches
        logits = self.head(patches)  # [B, N, classes]
        return logits.transpose(1, 2).reshape(x.shape[0], -1, rows, cols)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        if attn_mask is not None or is_causal:
            raise ValueError("segvit attends over every patch: it takes no attention mask")
        grid = (x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size)  # any image size
        logits = self._grid_logits(self.forward_features(x), grid)
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


# The options are DeiT's (the registry, the CLI and their checks read them from the
# signature), with unpool on by default.
SegViT.__init__.__signature__ = inspect.signature(DeiT.__init__).replace(  # type: ignore[attr-defined]
    parameters=[
        p.replace(default=True) if p.name == "unpool" else p
        for p in inspect.signature(DeiT.__init__).parameters.values()
    ]
)

register(
    "segvit_fashion",
    SegViT,
    family="segvit",
    description="6-layer DeiT (dim 64, 2 heads), a linear head per patch; 128x128 fashion_detect, patch 8",
    embed_dim=64,
    num_heads=2,
    depth=6,
    img_size=128,
    patch_size=8,
    num_classes=11,
    in_chans=1,
)
register(
    "segvit_test",
    SegViT,
    family="segvit",
    description="tiny segvit for tests (dim 32, 2 heads, depth 3, 32x32, patch 8)",
    tiny=True,
    embed_dim=32,
    num_heads=2,
    depth=3,
    img_size=32,
    patch_size=8,
    num_classes=5,
    in_chans=1,
)
