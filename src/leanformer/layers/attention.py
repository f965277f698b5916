"""Multi-head self-attention that accepts token sizes and can report attention received."""

from __future__ import annotations

from torch import Tensor, nn

from leanformer.layers.checks import head_dim
from leanformer.ops.attention import attention
from leanformer.ops.ragged import RaggedBatch


class Attention(nn.Module):
    """timm-compatible self-attention (``qkv``, ``q_norm``, ``k_norm``, ``proj``).

    ``forward(x [B, N, C], sizes [B, N] | None, need_received) -> (out [B, N, C], received [B, N] | None)``;
    ``forward(x [T, C], ragged=...)`` for packed variable-length sequences.
    """

    def __init__(
        self,
        dim: int,
        *,
        num_heads: int = 8,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: type[nn.Module] = nn.LayerNorm,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim(dim, num_heads)
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
        self,
        x: Tensor,
        sizes: Tensor | None = None,
        need_received: bool = False,
        attn_mask: Tensor | None = None,
        ragged: RaggedBatch | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``ragged``: ``x`` is ``[T, C]``, variable-length sequences packed row by row
        (:mod:`leanformer.ops.ragged`); the projections run on the packed rows and only
        the attention itself runs per bucket, padded and masked."""
        qkv = self.qkv(x)
        if ragged is None:
            out, received = self._attend(qkv, sizes, need_received, attn_mask)
            return self.proj_drop(self.proj(out)), received
        if sizes is not None or need_received or attn_mask is not None:
            raise ValueError("a ragged batch cannot be combined with sizes, attn_mask or received scores")
        outs = [self._attend(part, attn_mask=bias)[0] for part, bias in ragged.padded(qkv)]
        return self.proj_drop(self.proj(ragged.packed(outs))), None

    def _attend(
        self,
        qkv: Tensor,
        sizes: Tensor | None = None,
        need_received: bool = False,
        attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Fused projections ``[B, N, 3C]`` -> attention output before ``proj`` ``[B, N, C]``."""
        B, N, _ = qkv.shape
        qkv = qkv.reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        out, received = attention(
            q,
            k,
            v,
            sizes=sizes,
            attn_mask=attn_mask,
            dropout_p=self.attn_drop if self.training else 0.0,
            return_received=need_received,
        )
        return out.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim), received
