"""Pre-norm transformer block for the families that run attention on their own tokens.

The Visual Perceiver's latent self-attention and DRRT's pair embedding use it; vision
transformers over patch tokens are timm ``VisionTransformer`` configurations (see
:mod:`leanformer.models.deit`), token-pooled through :mod:`leanformer.patch.adapter`.
"""

from __future__ import annotations

from timm.layers import DropPath, LayerScale, Mlp
from torch import Tensor, nn

from leanformer.layers.attention import Attention
from leanformer.layers.checks import hidden_width
from leanformer.ops.ragged import RaggedBatch

__all__ = ["Block"]


class Block(nn.Module):
    """``x + ls1(attn(norm1(x)))`` then ``x + ls2(mlp(norm2(x)))``: ``[B, N, C] -> [B, N, C]``."""

    def __init__(
        self,
        dim: int,
        *,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        init_values: float | None = None,
        attn_layer: type[nn.Module] = Attention,
        mlp_layer: type[nn.Module] = Mlp,
        norm_layer: type[nn.Module] = nn.LayerNorm,
        act_layer: type[nn.Module] = nn.GELU,
    ) -> None:
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = attn_layer(
            dim,
            num_heads=num_heads,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            attn_drop=attn_drop,
            proj_drop=proj_drop,
        )
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = mlp_layer(
            in_features=dim, hidden_features=hidden_width(dim, mlp_ratio), act_layer=act_layer, drop=proj_drop
        )
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(
        self, x: Tensor, attn_mask: Tensor | None = None, ragged: RaggedBatch | None = None
    ) -> Tensor:
        """``attn_mask`` (SDPA convention, e.g. ``[B, 1, 1, N]`` bool, True = may attend) hides
        padded tokens; ``ragged`` says ``x [T, C]`` packs variable-length sequences (only
        attention needs to know: everything else in the block is token-wise)."""
        if ragged is not None and self.training and not isinstance(self.drop_path1, nn.Identity):
            raise ValueError("drop path is per sequence and cannot run on a packed ragged batch")
        kwargs = {} if ragged is None else {"ragged": ragged}
        attn_out, _ = self.attn(self.norm1(x), attn_mask=attn_mask, **kwargs)
        x = x + self.drop_path1(self.ls1(attn_out))
        del attn_out  # freed before the MLP, whose hidden layer is then the block's peak
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
