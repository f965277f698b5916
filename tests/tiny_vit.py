"""The tiny timm ViT that takes any image size, shared by the grid and compile tests:
16x16 images, patch 4 (a 4x4 grid), width 16, 2 heads, 3 blocks, 3 classes."""

from __future__ import annotations

import timm
import torch
from torch import nn


def tiny_vit(img_size: int | tuple[int, int] = 16, dynamic: bool = True) -> nn.Module:
    """Seeded, in eval mode; ``dynamic``: timm's ``dynamic_img_size`` (other image sizes)."""
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        depth=3,
        img_size=img_size,
        patch_size=4,
        embed_dim=16,
        num_heads=2,
        num_classes=3,
        dynamic_img_size=dynamic,
    ).eval()
