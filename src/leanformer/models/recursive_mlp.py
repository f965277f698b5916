"""Recursive All-MLP: an MLP-Mixer with SReT's recursion, NLL layers and LRC (supplement, sec. 8).

Every Mixer block (token-mixing MLP across the ``S`` patches, then channel MLP) gets
learnable residual coefficients and is applied ``loops`` times with shared weights,
an unshared non-linear projection layer after each application, exactly as in the
transformer (:class:`~leanformer.layers.recursive.RecursiveStage`). The supplement
uses Mixer-B/16 (12 layers, C 768, S 196, D_C 3072, D_S 384) as the backbone; it does
not say how many unique blocks or how wide the NLLs are, so ``recursive_mixer_b16``
applies each of the 12 blocks twice (as the paper's recursive DeiT does) with NLL
ratio 1.0. The token-mixing MLP is sized for a fixed number of patches, so inputs
must have the model's ``img_size``.
"""

from __future__ import annotations

from collections.abc import Callable

from timm.layers import DropPath, Mlp
from torch import Tensor, nn

from leanformer.layers.checks import check_patch_grid, check_positive, check_rates
from leanformer.layers.classifier import classifier
from leanformer.layers.init import init_vit_weights
from leanformer.layers.norm import LAYER_NORM
from leanformer.layers.patch_embed import PatchEmbed, to_2tuple
from leanformer.layers.recursive import RecursiveStage
from leanformer.layers.residual_coeffs import LearnableResidual, LRCMode, check_lrc_mode
from leanformer.models.registry import register


class RecursiveMixerBlock(nn.Module):
    """Mixer block with LRC: ``[B, S, C] -> [B, S, C]``; ``pass_index`` is accepted and ignored."""

    def __init__(
        self,
        dim: int,
        *,
        num_tokens: int,
        token_mlp_dim: int,
        channel_mlp_dim: int,
        lrc: LRCMode = "both",
        drop: float = 0.0,
        drop_path: float = 0.0,
        norm_layer: Callable[[int], nn.Module] = LAYER_NORM,
    ) -> None:
        super().__init__()
        check_positive(token_mlp_dim=token_mlp_dim, channel_mlp_dim=channel_mlp_dim)
        self.norm1 = norm_layer(dim)
        self.token_mlp = Mlp(num_tokens, token_mlp_dim, act_layer=nn.GELU, drop=drop)
        self.res1 = LearnableResidual(mode=lrc)
        self.norm2 = norm_layer(dim)
        self.channel_mlp = Mlp(dim, channel_mlp_dim, act_layer=nn.GELU, drop=drop)
        self.res2 = LearnableResidual(mode=lrc)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: Tensor, pass_index: int = 0) -> Tensor:
        # Token mixing acts along the patch axis: [B, S, C] -> [B, C, S] -> MLP over S.
        mixed = self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        x = self.res1(x, self.drop_path(mixed))
        return self.res2(x, self.drop_path(self.channel_mlp(self.norm2(x))))


class RecursiveMixer(nn.Module):
    """Patch embedding -> recursive Mixer stage -> LayerNorm -> mean over patches -> head.

    ``forward(x [B, in_chans, H, W]) -> logits [B, num_classes]``, with ``(H, W) = img_size``.
    """

    def __init__(
        self,
        *,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        unique: int = 12,
        loops: int = 2,
        token_mlp_dim: int = 384,
        channel_mlp_dim: int = 3072,
        nll_ratio: float = 1.0,
        lrc: LRCMode = "both",
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        check_lrc_mode(lrc)
        self.img_size = to_2tuple(img_size)
        check_patch_grid(self.img_size, patch_size)
        check_positive(unique=unique, loops=loops)
        check_rates(drop_rate=drop_rate, drop_path_rate=drop_path_rate)
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_features = self.embed_dim = embed_dim
        self.grid = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        num_tokens = self.grid[0] * self.grid[1]
        self.patch_embed = PatchEmbed(patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        blocks = [
            RecursiveMixerBlock(
                embed_dim,
                num_tokens=num_tokens,
                token_mlp_dim=token_mlp_dim,
                channel_mlp_dim=channel_mlp_dim,
                lrc=lrc,
                drop=drop_rate,
                drop_path=drop_path_rate * b / max(unique - 1, 1),
            )
            for b in range(unique)
        ]
        self.stage = RecursiveStage(
            blocks, dim=embed_dim, loops=loops, nll_ratio=nll_ratio, lrc=lrc, drop=drop_rate
        )
        self.norm = LAYER_NORM(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = classifier(embed_dim, num_classes)
        init_vit_weights(self)

    def forward_features(self, x: Tensor) -> Tensor:
        """``[B, C, H, W] -> [B, S, D]`` normalised patch tokens."""
        if x.ndim == 4 and tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(
                f"the recursive Mixer's token-mixing MLPs are sized for "
                f"{self.img_size[0]}x{self.img_size[1]} inputs, got {x.shape[-2]}x{x.shape[-1]}"
            )
        x, _ = self.patch_embed(x)
        return self.norm(self.stage(x))

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = x.mean(dim=1)
        if pre_logits:
            return x
        return self.head(self.head_drop(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def reset_classifier(self, num_classes: int) -> None:
        self.head = classifier(self.embed_dim, num_classes)  # raises before the model changes
        self.num_classes = num_classes


register(
    "recursive_mixer_b16",
    RecursiveMixer,
    family="recursive_mlp",
    description="Mixer-B/16 (C 768, S 196, D_C 3072, D_S 384) with 12 blocks each applied twice, NLL + LRC",
)
register(
    "recursive_mixer_digits",
    RecursiveMixer,
    family="recursive_mlp",
    description="small recursive Mixer on 32x32 1-channel digits (patch 4, dim 96, 3 blocks x 2)",
    img_size=32,
    patch_size=4,
    in_chans=1,
    num_classes=10,
    embed_dim=96,
    unique=3,
    token_mlp_dim=48,
    channel_mlp_dim=384,
    nll_ratio=0.5,
)
register(
    "recursive_mixer_test",
    RecursiveMixer,
    family="recursive_mlp",
    tiny=True,
    description="tiny recursive Mixer for tests (16x16, patch 4, dim 32, 2 blocks x 2)",
    img_size=16,
    patch_size=4,
    num_classes=5,
    embed_dim=32,
    unique=2,
    token_mlp_dim=16,
    channel_mlp_dim=64,
)

__all__ = ["RecursiveMixer", "RecursiveMixerBlock"]
