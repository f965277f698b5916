"""Cross-attention of a set of query tokens onto a set of input tokens (Perceiver style).

The block is split in two halves so Dynamic Query Selection can look at the attention
outputs of *every* candidate query and then spend the rest of the block only on the
kept ones:

* :meth:`CrossAttentionBlock.mix` -- ``Y = softmax(Q K^T / sqrt(d)) V`` for each query
  (the weighted average of value tokens the paper compares), before the output
  projection: ``[B, K, C]``.
* :meth:`CrossAttentionBlock.finish` -- output projection, residual onto the query
  tokens, then the pre-norm MLP: ``[B, K, C]``.

``forward`` is ``finish(mix(...))``.
"""

from __future__ import annotations

import torch
from timm.layers import DropPath, LayerScale, Mlp
from torch import Tensor, nn

from leanformer.layers.checks import head_dim, hidden_width
from leanformer.ops.attention import attention
from leanformer.ops.ragged import RaggedBatch


class CrossAttention(nn.Module):
    """Multi-head attention of queries ``[Bq, K, C]`` onto inputs ``[B, N, C]``.

    ``Bq`` is ``B`` or 1: learned queries shared by the whole batch are projected once
    and broadcast, so their projection does not scale with the batch size.
    """

    def __init__(
        self,
        dim: int,
        *,
        num_heads: int = 1,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim(dim, num_heads)
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _heads(self, x: Tensor) -> Tensor:
        """``[B, N, C] -> [B, H, N, C/H]``."""
        B, N, _ = x.shape
        return x.reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)

    def project(self, queries: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per-head ``q [B, H, K, D]``, ``k, v [B, H, N, D]`` (queries broadcast to the batch)."""
        k, v = self._split_kv(self.kv(x))
        return self._broadcast_q(queries, k.shape[0]), k, v

    def _broadcast_q(self, queries: Tensor, batch_size: int) -> Tensor:
        q = self._heads(self.q(queries))
        return q if q.shape[0] == batch_size else q.expand(batch_size, -1, -1, -1)

    def _split_kv(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """Fused key/value projections ``[B, N, 2C] -> k, v [B, H, N, C/H]``."""
        B, N, _ = kv.shape
        k, v = kv.reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return k, v

    def mix(
        self, queries: Tensor, x: Tensor, key_mask: Tensor | None = None, ragged: RaggedBatch | None = None
    ) -> Tensor:
        """Attention outputs before the output projection: ``[B, K, C]``.

        ``key_mask [B, N]`` (bool, True = real token) hides padded inputs. ``ragged``:
        ``x [T, C]`` packs one variable-length input per output row (:mod:`leanformer.ops.ragged`);
        the key/value projection runs on the packed rows, the attention per bucket, and
        rows come out in packed sequence order. Queries must then be shared (``Bq = 1``).
        """
        if ragged is None:
            mask = None if key_mask is None else key_mask[:, None, None, :]
            return self._mix(*self.project(queries, x), mask)
        if key_mask is not None or queries.shape[0] != 1:
            raise ValueError("a ragged batch needs shared queries [1, K, C] and no key_mask")
        kv = self.kv(x)
        outs = []
        for part, bias in ragged.padded(kv):
            k, v = self._split_kv(part)
            outs.append(self._mix(self._broadcast_q(queries, part.shape[0]), k, v, bias))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _mix(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """``mask``: SDPA attention mask broadcast to ``[B, H, K, N]`` (bool or additive)."""
        out, _ = attention(q, k, v, attn_mask=mask, dropout_p=self.attn_drop if self.training else 0.0)
        B, H, K, D = out.shape
        return out.transpose(1, 2).reshape(B, K, H * D)

    def out(self, mixed: Tensor) -> Tensor:
        """Output projection ``[B, K, C] -> [B, K, C]``."""
        return self.proj_drop(self.proj(mixed))

    def forward(self, queries: Tensor, x: Tensor, key_mask: Tensor | None = None) -> Tensor:
        return self.out(self.mix(queries, x, key_mask))

    @torch.no_grad()
    def probs(self, queries: Tensor, x: Tensor) -> Tensor:
        """Explicit attention probabilities ``[B, H, K, N]`` (for visualisation, not the hot path)."""
        q, k, _ = self.project(queries, x)
        return ((q * self.head_dim**-0.5) @ k.transpose(-2, -1)).softmax(dim=-1)


class CrossAttentionBlock(nn.Module):
    """Pre-norm cross-attention block: ``z = q + attn(norm_q(q), norm_kv(x))``; ``z + mlp(norm2(z))``.

    ``queries [Bq, K, C]`` (``Bq`` in ``{1, B}``), ``x [B, N, C]`` -> ``[B, K, C]``.
    """

    def __init__(
        self,
        dim: int,
        *,
        num_heads: int = 1,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        init_values: float | None = None,
        mlp_layer: type[nn.Module] = Mlp,
        norm_layer: type[nn.Module] = nn.LayerNorm,
        act_layer: type[nn.Module] = nn.GELU,
    ) -> None:
        super().__init__()
        self.norm_q = norm_layer(dim)
        self.norm_kv = norm_layer(dim)
        self.attn = CrossAttention(
            dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop
        )
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = mlp_layer(
            in_features=dim, hidden_features=hidden_width(dim, mlp_ratio), act_layer=act_layer, drop=proj_drop
        )
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def mix(
        self, queries: Tensor, x: Tensor, key_mask: Tensor | None = None, ragged: RaggedBatch | None = None
    ) -> Tensor:
        """Raw attention outputs ``Y [B, K, C]`` (weighted averages of the values)."""
        return self.attn.mix(self.norm_q(queries), self.norm_kv(x), key_mask, ragged)

    def finish(self, queries: Tensor, mixed: Tensor) -> Tensor:
        """Projection + residual onto ``queries [Bq, K, C]`` + MLP; ``mixed [B, K, C]`` -> ``[B, K, C]``."""
        z = queries + self.drop_path1(self.ls1(self.attn.out(mixed)))
        return z + self.drop_path2(self.ls2(self.mlp(self.norm2(z))))

    def forward(
        self, queries: Tensor, x: Tensor, key_mask: Tensor | None = None, ragged: RaggedBatch | None = None
    ) -> Tensor:
        return self.finish(queries, self.mix(queries, x, key_mask, ragged))

    def attention_probs(self, queries: Tensor, x: Tensor) -> Tensor:
        """``[B, H, K, N]`` attention probabilities of each query over the inputs."""
        return self.attn.probs(self.norm_q(queries), self.norm_kv(x))
