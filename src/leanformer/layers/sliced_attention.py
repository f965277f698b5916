"""Sliced group self-attention and the SReT transformer block.

Sliced group self-attention (SReT, supplement algorithm 1) splits the ``N`` tokens into
``G`` groups of ``N / G`` consecutive tokens and lets each group attend only within
itself: the attention cost drops from ``N^2`` to ``N^2 / G``. All groups go through
one fused ``scaled_dot_product_attention`` call as a batch of ``B * G`` sequences.

Groups of consecutive tokens never exchange information, so SReT optionally
*permutes* the tokens before slicing (each group then holds a random subset of the
image) and applies the *inverse* permutation afterwards so the sequence order, which
the later convolutional pooling relies on, is restored. The ablation modes of the
supplement's table 2 are ``permute`` with and without ``inverse``.

In training the permutation is fresh for every call (``torch.randperm``, the same for
every sample of the batch, as in the official code). In eval mode it is a fixed
permutation per (layer, pass, token count): the order of counter-based noise hashed
from a seed (:mod:`leanformer.ops.hashed_noise`), so the same input always gives the
same output on any device, and the permutation is computed inside the graph:
``torch.compile(fullgraph=True)`` holds it, and nothing is cached between calls (the
official code draws a new one in eval mode too). A permutation followed by its inverse
around full attention (``G = 1``) is the identity, and is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from timm.layers import DropPath, Mlp
from torch import Tensor, nn

from leanformer.layers.checks import check_sizes, head_dim, hidden_width
from leanformer.layers.norm import LAYER_NORM
from leanformer.layers.residual_coeffs import LearnableResidual, LRCMode, check_lrc_mode
from leanformer.ops.attention import attention
from leanformer.ops.hashed_noise import hashed_uniform


def check_groups(num_tokens: int, groups: int) -> None:
    """Raise a ``ValueError`` unless ``num_tokens`` splits into ``groups`` equal groups."""
    if groups < 1:
        raise ValueError(f"the number of attention groups must be >= 1, got {groups}")
    if num_tokens % groups:
        raise ValueError(
            f"sliced attention cannot split {num_tokens} tokens into {groups} equal groups; "
            "choose an input size whose token count is a multiple of the groups, or fewer groups"
        )


def inverse_permutation(perm: Tensor) -> Tensor:
    """``perm [N]`` -> ``inv [N]`` with ``inv[perm[i]] = i`` (a scatter, cheaper than argsort)."""
    inv = torch.empty_like(perm)
    inv.scatter_(0, perm, torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype))
    return inv


class SlicedGroupAttention(nn.Module):
    """Multi-head self-attention within ``groups`` slices of the token sequence.

    ``forward(x [B, N, C], *, groups, permute, inverse, seed) -> [B, N, C]``. Parameters
    (``qkv``, ``proj``) do not depend on ``groups``, so one module serves every pass of a
    shared block with a different number of groups.
    """

    def __init__(
        self,
        dim: int,
        *,
        num_heads: int = 8,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim(dim, num_heads)
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def permutation(self, num_tokens: int, device: torch.device, seed: int) -> tuple[Tensor, Tensor]:
        """``(perm [N], inverse [N])``: random in training, fixed per ``seed`` in eval."""
        if self.training:
            perm = torch.randperm(num_tokens, device=device)
        else:
            # No generator (a stateful object stops fullgraph compiles) and no cache (a
            # tensor kept from a call under torch.inference_mode() cannot be saved for a
            # later call's backward): the stable order of hashed noise, a few cheap ops.
            noise = hashed_uniform(1, num_tokens, seed=seed, device=device)[0]
            perm = noise.argsort(stable=True)
        return perm, inverse_permutation(perm)

    def forward(
        self, x: Tensor, *, groups: int = 1, permute: bool = False, inverse: bool = True, seed: int = 0
    ) -> Tensor:
        B, N, C = x.shape
        check_groups(N, groups)
        # Permute + inverse around one group is exactly full attention: skip the copies.
        perm = inv = None
        if permute and (groups > 1 or not inverse):
            perm, inv = self.permutation(N, x.device, seed)
            x = x.index_select(1, perm)
        n = N // groups
        # [B, N, 3C] viewed as B*G sequences of n consecutive tokens: group g of sample b
        # is row b*G + g, the official code's contiguous slices.
        qkv = self.qkv(x).reshape(B * groups, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # [B*G, H, n, D]
        out, _ = attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        out = out.transpose(1, 2).reshape(B, N, C)
        if inv is not None and inverse:
            out = out.index_select(1, inv)
        return self.proj_drop(self.proj(out))


class SlicedBlock(nn.Module):
    """Pre-norm transformer block with sliced attention and learnable residual coefficients.

    ``x = res1(x, attn(norm1(x)))``, ``x = res2(x, mlp(norm2(x)))`` where ``res`` is
    :class:`~leanformer.layers.residual_coeffs.LearnableResidual`. The block is meant to be
    applied several times (recursion); ``forward(x [B, N, C], pass_index)`` picks that
    pass's number of groups ``groups[pass_index]`` and ``permute[pass_index]``.
    """

    def __init__(
        self,
        dim: int,
        *,
        num_heads: int,
        groups: Sequence[int] = (1,),
        permute: Sequence[bool] | None = None,
        inverse: bool = True,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        lrc: LRCMode = "both",
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        perm_seed: int = 0,
        norm_layer: Callable[[int], nn.Module] = LAYER_NORM,
        act_layer: type[nn.Module] = nn.GELU,
    ) -> None:
        super().__init__()
        self.groups = check_sizes("groups", groups)  # 8.5 groups is an error, not 8
        self.permute = tuple(
            bool(p) for p in (permute if permute is not None else [False] * len(self.groups))
        )
        if len(self.permute) != len(self.groups):
            raise ValueError(f"permute has {len(self.permute)} entries for {len(self.groups)} passes")
        check_lrc_mode(lrc)
        self.inverse = inverse
        self.perm_seed = perm_seed
        self.norm1 = norm_layer(dim)
        self.attn = SlicedGroupAttention(
            dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop
        )
        self.res1 = LearnableResidual(mode=lrc)
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(
            in_features=dim, hidden_features=hidden_width(dim, mlp_ratio), act_layer=act_layer, drop=proj_drop
        )
        self.res2 = LearnableResidual(mode=lrc)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    @property
    def passes(self) -> int:
        return len(self.groups)

    def forward(self, x: Tensor, pass_index: int = 0) -> Tensor:
        if not 0 <= pass_index < len(self.groups):
            raise ValueError(
                f"pass_index {pass_index} out of range for a block with {len(self.groups)} passes"
            )
        attn = self.attn(
            self.norm1(x),
            groups=self.groups[pass_index],
            permute=self.permute[pass_index],
            inverse=self.inverse,
            # Each (block, pass) gets its own fixed eval permutation.
            seed=self.perm_seed * 1009 + pass_index,
        )
        x = self.res1(x, self.drop_path(attn))
        return self.res2(x, self.drop_path(self.mlp(self.norm2(x))))


__all__ = ["SlicedBlock", "SlicedGroupAttention", "check_groups", "inverse_permutation"]
