"""DETR's transformer encoder (Carion et al., 2020) with dense or ENACT self-attention.

Input: a backbone feature map ``[B, in_chans, H, W]`` and its padding mask ``[B, H, W]``
(True = padding; DETR pads images at the bottom and right). A 1x1 conv projects to
``d_model``, a 2-D sine encoding gives positions, and six post-norm encoder layers
(``x = norm1(x + attn(x, pos)); x = norm2(x + ffn(x))``) produce the memory
``[B, HW, d_model]`` a DETR decoder would read. So that the encoder can be trained and
tested like every other registry model, ``forward_head`` mean-pools the memory over
valid positions into a linear classifier.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leanformer.layers.checks import check_positive
from leanformer.layers.classifier import classifier
from leanformer.layers.enact_attention import (
    DenseSelfAttention,
    EntropyClusteredAttention,
    layer_cluster_ratios,
)
from leanformer.layers.patch_embed import to_2tuple
from leanformer.layers.position_encoding import SinePositionEncoding2d
from leanformer.models.registry import register
from leanformer.ops.entropy_map import check_sigma

ATTENTIONS = ("dense", "enact")


class DETREncoderLayer(nn.Module):
    """Post-norm encoder layer of DETR; ``attn_layer`` is any module with the
    ``(x, pos, spatial_shape, key_padding_mask)`` interface of :class:`DenseSelfAttention`.

    ``forward(x [B, N, C], pos [B, N, C], spatial_shape, key_padding_mask [B, N] | None) -> [B, N, C]``.
    """

    def __init__(
        self,
        d_model: int,
        *,
        num_heads: int,
        dim_feedforward: int,
        dropout: float,
        attn_layer: nn.Module,
    ) -> None:
        super().__init__()
        self.self_attn = attn_layer
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(
        self, x: Tensor, pos: Tensor, spatial_shape: tuple[int, int], key_padding_mask: Tensor | None
    ) -> Tensor:
        x = self.norm1(x + self.dropout1(self.self_attn(x, pos, spatial_shape, key_padding_mask)))
        ffn = self.linear2(self.dropout(F.relu(self.linear1(x))))
        return self.norm2(x + self.dropout2(ffn))


class DETREncoder(nn.Module):
    """DETR encoder over a feature map; ``attention="dense" | "enact"``.

    ``img_size`` is the backbone's input size in pixels and ``backbone_stride`` its total
    stride: together they only set the default feature size of :meth:`example_inputs`
    (800x1088 / 32 = 25x34, DETR's typical COCO map). Any feature size works. ``sigma``
    (ENACT's entropy smoothing) and ``cluster_inputs`` are ignored by dense attention.
    """

    def __init__(
        self,
        *,
        in_chans: int = 2048,
        num_classes: int = 1000,
        img_size: int | tuple[int, int] = (800, 1088),
        backbone_stride: int = 32,
        d_model: int = 256,
        num_layers: int = 6,
        num_heads: int = 8,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        attention: str = "dense",
        sigma: float = 3.0,
        cluster_inputs: bool = True,
    ) -> None:
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
        check_sigma(sigma)  # here too, so that a dense model rejects it the same way
        check_positive(
            in_chans=in_chans,
            d_model=d_model,
            num_layers=num_layers,
            dim_feedforward=dim_feedforward,
            backbone_stride=backbone_stride,
        )
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.img_size = to_2tuple(img_size)
        self.backbone_stride = backbone_stride
        self.d_model = self.num_features = d_model
        self.attention = attention
        self.input_proj = nn.Conv2d(in_chans, d_model, kernel_size=1)
        self.position = SinePositionEncoding2d(d_model // 2)

        def attn() -> nn.Module:
            if attention == "enact":
                return EntropyClusteredAttention(
                    d_model, num_heads, dropout=dropout, sigma=sigma, cluster_inputs=cluster_inputs
                )
            return DenseSelfAttention(d_model, num_heads, dropout=dropout)

        self.layers = nn.ModuleList(
            DETREncoderLayer(
                d_model,
                num_heads=num_heads,
                dim_feedforward=dim_feedforward,
                dropout=dropout,
                attn_layer=attn(),
            )
            for _ in range(num_layers)
        )
        self.head = classifier(d_model, num_classes)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # DETR: xavier-uniform for every matrix.
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    @staticmethod
    def _check(x: Tensor, mask: Tensor | None, in_chans: int) -> None:
        if x.dim() != 4 or x.shape[1] != in_chans:
            raise ValueError(f"features must be [B, {in_chans}, H, W], got {tuple(x.shape)}")
        if mask is not None and (mask.shape != (x.shape[0], *x.shape[2:]) or mask.dtype != torch.bool):
            raise ValueError(
                f"mask must be bool [B, H, W] = {(x.shape[0], *x.shape[2:])}, "
                f"got {mask.dtype} {tuple(mask.shape)}"
            )

    def forward_features(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Features ``[B, in_chans, H, W]`` + mask ``[B, H, W]`` -> encoder memory ``[B, HW, d_model]``."""
        self._check(x, mask, self.in_chans)
        B, _, H, W = x.shape
        pad = mask if mask is not None else torch.zeros(B, H, W, dtype=torch.bool, device=x.device)
        # Contiguous [B, HW, d] once here, not a hidden copy in every layer's reshapes.
        pos = self.position(pad, dtype=x.dtype).flatten(2).transpose(1, 2).contiguous()
        src = self.input_proj(x).flatten(2).transpose(1, 2).contiguous()
        key_padding_mask = mask.flatten(1) if mask is not None else None
        for layer in self.layers:
            src = layer(src, pos, (H, W), key_padding_mask)
        return src

    def forward_head(self, x: Tensor, pre_logits: bool = False, *, mask: Tensor | None = None) -> Tensor:
        """Memory ``[B, HW, d]`` -> logits ``[B, num_classes]``: mean over valid positions, then linear."""
        if mask is None:
            pooled = x.mean(dim=1)
        else:
            keep = (~mask.flatten(1)).to(x.dtype)[..., None]  # [B, HW, 1]
            pooled = (x * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        return pooled if pre_logits else self.head(pooled)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.forward_head(self.forward_features(x, mask), mask=mask)

    def reset_classifier(self, num_classes: int) -> None:
        self.head = classifier(self.d_model, num_classes)  # raises before the model changes
        self.num_classes = num_classes

    def default_feature_size(self) -> tuple[int, int]:
        s = self.backbone_stride
        return (-(-self.img_size[0] // s), -(-self.img_size[1] // s))

    def example_inputs(
        self,
        batch_size: int,
        *,
        img_size: int | tuple[int, int] | None = None,
        feature_size: int | tuple[int, int] | None = None,
        seed: int = 0,
    ) -> tuple[Tensor, Tensor]:
        """Spatially smooth features ``[B, in_chans, H, W]`` and a mask ``[B, H, W]`` with some padding.

        Features are Gaussian noise on a 4x coarser grid, bilinearly upsampled (a stand-in
        for a backbone's smooth feature maps). Every other image is padded at the bottom
        (10% of rows) and right (15% of columns), as DETR pads a batch of images of
        different sizes. ``feature_size`` (H, W) wins over ``img_size`` (pixels / stride).
        """
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if feature_size is not None:
            H, W = to_2tuple(feature_size)
        elif img_size is not None:
            h, w = to_2tuple(img_size)
            H, W = -(-h // self.backbone_stride), -(-w // self.backbone_stride)
        else:
            H, W = self.default_feature_size()
        if H <= 0 or W <= 0:
            raise ValueError(f"feature size must be positive, got {H}x{W}")
        device = next(self.parameters()).device
        gen = torch.Generator().manual_seed(seed)
        coarse = torch.randn(batch_size, self.in_chans, max(1, H // 4), max(1, W // 4), generator=gen)
        feats = F.interpolate(coarse, size=(H, W), mode="bilinear", align_corners=False)
        mask = torch.zeros(batch_size, H, W, dtype=torch.bool)
        hv, wv = H - int(0.1 * H), W - int(0.15 * W)
        mask[1::2, hv:, :] = True
        mask[1::2, :, wv:] = True
        return feats.to(device), mask.to(device)

    def cluster_ratios(self) -> list[float]:
        """Per ENACT layer, the mean over maps of clusters / valid positions in the last call."""
        layers: list[Any] = list(self.layers)  # encoder layers, each with its self_attn
        return layer_cluster_ratios(layer.self_attn for layer in layers)

    def bench_extras(self) -> dict[str, Any]:
        """Fields for ``leanformer bench``: attention kind and mean cluster ratio L/HW of the last call."""
        ratios = self.cluster_ratios()
        extras: dict[str, Any] = {"attention": self.attention}
        if self.attention == "enact":
            extras["cluster_ratio"] = sum(ratios) / len(ratios) if ratios else None
            extras["cluster_ratio_per_layer"] = [round(r, 4) for r in ratios]
        else:
            extras["cluster_ratio"] = 1.0
        return extras


register(
    "detr_encoder",
    DETREncoder,
    family="detr",
    description="DETR encoder: 6 post-norm layers, d 256, 8 heads, FFN 2048, on a 2048-ch feature map "
    "(attention='dense' | 'enact')",
)
register(
    "detr_encoder_test",
    DETREncoder,
    family="detr",
    tiny=True,
    description="tiny DETR encoder with ENACT attention for tests (d 32, 4 heads, 2 layers, 6x7 map)",
    in_chans=16,
    num_classes=5,
    img_size=(6, 7),
    backbone_stride=1,
    d_model=32,
    num_layers=2,
    num_heads=4,
    dim_feedforward=64,
    dropout=0.0,
    attention="enact",
    sigma=1.0,
)
