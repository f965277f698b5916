"""Pre-norm transformer block with an optional token reducer inside it."""

from __future__ import annotations

from timm.layers import DropPath, LayerScale, Mlp
from torch import Tensor, nn

from leanformer.layers.attention import Attention
from leanformer.layers.reducer import ReducePosition, TokenReducer, reduce_tokens
from leanformer.ops.ragged import RaggedBatch

__all__ = ["Block", "ReducePosition"]


class Block(nn.Module):
    """``x + attn(norm1(x))`` -> [reduce] -> ``x + mlp(norm2(x))`` -> [reduce].

    ``reducer`` (set by the model, None by default) sits either between the attention
    and the MLP (``reduce_at="attn"``, where PoWER-BERT and Token Pooling place it, so
    the MLP already runs on fewer tokens) or after the MLP (``"mlp"``).

    ``forward(x [B, N, C], sizes [B, N] | None, num_prefix) -> (x [B, N', C], sizes)``.
    """

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
            in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop
        )
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.reducer: nn.Module | None = None
        self.reduce_at: ReducePosition = "attn"

    def set_reducer(self, reducer: nn.Module | None, reduce_at: ReducePosition = "attn") -> None:
        if reduce_at not in ("attn", "mlp"):
            raise ValueError(f"reduce_at must be 'attn' or 'mlp', got {reduce_at!r}")
        if reducer is not None and not isinstance(reducer, TokenReducer):
            raise TypeError(f"{type(reducer).__name__} does not implement the TokenReducer interface")
        self.reducer = reducer
        self.reduce_at = reduce_at

    def forward(
        self,
        x: Tensor,
        sizes: Tensor | None = None,
        num_prefix: int = 0,
        attn_mask: Tensor | None = None,
        ragged: RaggedBatch | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``attn_mask`` (SDPA convention, e.g. ``[B, 1, 1, N]`` bool, True = may attend) hides
        padded tokens; ``ragged`` says ``x [T, C]`` packs variable-length sequences (only
        attention needs to know: everything else in the block is token-wise). Both
        describe a fixed token set, so neither can be combined with a reducer."""
        reducer = self.reducer
        if (attn_mask is not None or ragged is not None) and reducer is not None:
            raise ValueError("attn_mask or a ragged batch cannot be combined with a token reducer")
        if ragged is not None and self.training and not isinstance(self.drop_path1, nn.Identity):
            raise ValueError("drop path is per sequence and cannot run on a packed ragged batch")
        need_received = reducer is not None and bool(reducer.needs_received)
        kwargs = {} if ragged is None else {"ragged": ragged}
        attn_out, received = self.attn(
            self.norm1(x), sizes=sizes, need_received=need_received, attn_mask=attn_mask, **kwargs
        )
        x = x + self.drop_path1(self.ls1(attn_out))
        if reducer is not None and self.reduce_at == "attn":
            x, sizes = reduce_tokens(reducer, x, sizes, received, num_prefix)
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        if reducer is not None and self.reduce_at == "mlp":
            # Scores still come from this block's attention: the token set is unchanged.
            x, sizes = reduce_tokens(reducer, x, sizes, received, num_prefix)
        return x, sizes
