"""DeiT / ViT family with an optional token reducer in every block.

Shapes follow DeiT (Touvron et al., 2021): patch 16 at 224x224 gives 196 tokens plus
a class token (and a distillation token for the distilled variants). Small-image
presets use patch 4 at 32x32 (64 tokens + class token) for the bundled data.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from leanformer.layers.block import Block, ReducePosition
from leanformer.layers.checks import check_positive, check_positive_number, check_rates
from leanformer.layers.classifier import classifier
from leanformer.layers.init import init_vit_weights
from leanformer.layers.patch_embed import PatchEmbed, resample_pos_embed, to_2tuple
from leanformer.models.registry import register


class DeiT(nn.Module):
    """Vision transformer with class (+ optional distillation) token.

    ``pool``/``keep``/``carry`` insert a token-pooling reducer into every block
    (see :mod:`leanformer.layers.token_pooling`); ``pool="none"`` is the plain model.
    """

    def __init__(
        self,
        *,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 192,
        depth: int = 12,
        num_heads: int = 3,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        init_values: float | None = None,
        distilled: bool = False,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        pool: str = "none",
        keep: Any = None,
        carry: bool = False,
        reduce_at: ReducePosition = "attn",
        pool_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        check_positive(patch_size=patch_size)  # in_chans and embed_dim: PatchEmbed checks them
        check_rates(drop_rate=drop_rate, attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate)
        check_positive_number(mlp_ratio=mlp_ratio)
        # LayerScale's init_values: 0 or None for none.
        check_positive_number(zero_ok=True, optional=True, init_values=init_values)
        if pool_options is not None and not isinstance(pool_options, dict):
            raise ValueError(f"pool_options must be a mapping of option names, got {pool_options!r}")
        check_positive(minimum=0, depth=depth)
        self.img_size = to_2tuple(img_size)
        if min(self.img_size) < patch_size:
            raise ValueError(f"img_size {self.img_size} is smaller than one patch ({patch_size})")
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.embed_dim = self.num_features = embed_dim
        self.depth = depth
        self.num_prefix_tokens = 2 if distilled else 1
        self.grid_size = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        num_patches = self.grid_size[0] * self.grid_size[1]

        self.patch_embed = PatchEmbed(patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + self.num_prefix_tokens, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        dpr = torch.linspace(0, drop_path_rate, depth).tolist()
        self.blocks = nn.ModuleList(
            Block(
                embed_dim,
                num_heads=num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                qk_norm=qk_norm,
                init_values=init_values,
                proj_drop=drop_rate,
                attn_drop=attn_drop_rate,
                drop_path=dpr[i],
            )
            for i in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = classifier(embed_dim, num_classes)
        self.head_dist = classifier(embed_dim, num_classes) if distilled else None
        self._init_weights()

        self.pool = pool
        self.carry = carry
        if pool != "none":
            from leanformer.layers.token_pooling import build_reducers

            reducers = build_reducers(
                method=pool,
                keep=keep,
                depth=depth,
                num_tokens=num_patches,
                dim=embed_dim,
                grid_size=self.grid_size,
                carry=carry,
                **(pool_options or {}),
            )
            for blk, reducer in zip(self.blocks, reducers, strict=True):
                blk.set_reducer(reducer, reduce_at)
        elif keep is not None or carry:
            raise ValueError("keep= and carry= need a pooling method: pass pool=... (e.g. pool='wkmedoids')")

    def _init_weights(self) -> None:
        init_vit_weights(self, self.pos_embed, self.cls_token, self.dist_token)

    def _pos_embed(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        n = self.num_prefix_tokens
        prefix_pos, patch_pos = self.pos_embed[:, :n], self.pos_embed[:, n:]
        patch_pos = resample_pos_embed(patch_pos, self.grid_size, grid)
        prefix = [self.cls_token] + ([self.dist_token] if self.dist_token is not None else [])
        prefix_tokens = torch.cat([t.expand(x.shape[0], -1, -1) for t in prefix], dim=1)
        x = torch.cat([prefix_tokens + prefix_pos, x + patch_pos], dim=1)
        return self.pos_drop(x)

    def forward_features(self, x: Tensor) -> Tensor:
        """``[B, C, H, W] -> [B, N', D]`` (normalised tokens, prefix first)."""
        x, grid = self.patch_embed(x)
        x = self._pos_embed(x, grid)
        sizes: Tensor | None = None
        for blk in self.blocks:
            x, sizes = blk(x, sizes, self.num_prefix_tokens)
        return self.norm(x)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Tokens ``[B, N', D]`` -> logits ``[B, classes]`` from the class (and distillation) token."""
        if pre_logits:
            return x[:, 0]
        logits = self.head(self.head_drop(x[:, 0]))
        if self.head_dist is not None:
            # DeiT inference: average the class-token and distillation-token heads.
            logits = (logits + self.head_dist(self.head_drop(x[:, 1]))) / 2
        return logits

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def reset_classifier(self, num_classes: int) -> None:
        self.head = classifier(self.embed_dim, num_classes)  # raises before the model changes
        if self.head_dist is not None:
            self.head_dist = classifier(self.embed_dim, num_classes)
        self.num_classes = num_classes


# The papers' shapes (224x224, patch 16, depth 12, mlp ratio 4). DeiT-e252/e318 are the
# Token Pooling paper's intermediate widths; it does not give their head counts, we use
# 4 heads (63 per head) and 6 heads (53 per head).
_FULL = dict(img_size=224, patch_size=16, depth=12, mlp_ratio=4.0)
_WIDTHS = {"tiny": (192, 3), "e252": (252, 4), "e318": (318, 6), "small": (384, 6)}
for _name, (_dim, _heads) in _WIDTHS.items():
    register(
        f"deit_{_name}",
        DeiT,
        family="deit",
        description=f"DeiT-{_name} (dim {_dim}, {_heads} heads), 224x224, patch 16",
        embed_dim=_dim,
        num_heads=_heads,
        **_FULL,
    )
    register(
        f"deit_{_name}_p4_32",
        DeiT,
        family="deit",
        description=f"DeiT-{_name} widths on 32x32 inputs, patch 4 (64 tokens + class token)",
        embed_dim=_dim,
        num_heads=_heads,
        img_size=32,
        patch_size=4,
        depth=12,
        num_classes=10,
    )
register(
    "deit_small_distilled",
    DeiT,
    family="deit",
    description="DeiT-S with a distillation token",
    embed_dim=384,
    num_heads=6,
    distilled=True,
    **_FULL,
)
# Small enough to train on the bundled digits in a couple of minutes on 2 CPU cores.
register(
    "deit_digits",
    DeiT,
    family="deit",
    description="6-layer DeiT (dim 96, 3 heads) on 32x32 digits, patch 4",
    embed_dim=96,
    num_heads=3,
    depth=6,
    img_size=32,
    patch_size=4,
    num_classes=10,
    in_chans=1,
)
# Real photographs at DeiT-S's token count: 28x28 Fashion-MNIST at patch 2 gives 14x14 = 196
# patch tokens, so the Token Pooling paper's per-layer budgets apply unchanged.
register(
    "deit_fashion",
    DeiT,
    family="deit",
    description="6-layer DeiT (dim 64, 2 heads) on 28x28 Fashion-MNIST, patch 2 (196 tokens + class token)",
    embed_dim=64,
    num_heads=2,
    depth=6,
    img_size=28,
    patch_size=2,
    num_classes=10,
    in_chans=1,
)
register(
    "deit_test",
    DeiT,
    family="deit",
    tiny=True,
    description="tiny DeiT for tests (dim 32, 2 heads, depth 3, 16x16, patch 4)",
    embed_dim=32,
    num_heads=2,
    depth=3,
    img_size=16,
    patch_size=4,
    num_classes=5,
)
