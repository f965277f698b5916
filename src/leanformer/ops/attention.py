"""Scaled dot-product attention with token sizes and attention-received scores.

Shapes: ``q [B, H, Nq, D]``, ``k, v [B, H, Nk, D]``. Token *sizes* ``[B, Nk]`` say how
many input tokens each key stands for (after pooling or merging); they enter the
logits as an additive ``log(size)`` bias, so a key of size s counts as s identical
keys (proportional attention). The bias goes through the fused
``scaled_dot_product_attention`` kernel as an ``attn_mask``. When the attention each key
received is asked for, the probabilities are computed one block at a time
(:mod:`leanformer.ops.received`), so the ``[B, H, Nq, Nk]`` matrix is never whole.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from leanformer.ops.received import blocked_attention_received


def size_bias(sizes: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``[B, Nk]`` sizes -> ``[B, 1, 1, Nk]`` additive logit bias ``log(size)`` (or None)."""
    if sizes is None:
        return None
    return sizes.to(dtype).log()[:, None, None, :]


def combine_masks(bias: Tensor | None, attn_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Merge an additive bias and a boolean/additive mask into one additive mask.

    A boolean ``attn_mask`` follows SDPA's convention: True means *may attend*.
    """
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(
            ~attn_mask, float("-inf")
        )
    if bias is None:
        return attn_mask
    if attn_mask is None:
        return bias
    return bias + attn_mask


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    sizes: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    return_received: bool = False,
    scale: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Multi-head attention; returns ``(out [B, H, Nq, D], received [B, Nk] | None)``.

    ``received`` is the attention each key receives, summed over heads and queries
    (the significance score of PoWER-BERT / Token Pooling). It is computed only when
    asked; otherwise the fused SDPA kernel runs alone.
    """
    mask = combine_masks(size_bias(sizes, q.dtype), attn_mask, q.dtype)
    if not return_received:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale), None
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return blocked_attention_received(q, k, v, mask=mask, dropout_p=dropout_p, scale=scale)


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, *, sizes: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Slow, obviously-correct reference: duplicate each key ``size`` times (integer sizes).

    Used by tests to show that the ``log(size)`` bias equals attending to repeated keys.
    """
    B, D = q.shape[0], q.shape[-1]
    outs, recs = [], []
    for b in range(B):
        kb, vb = k[b], v[b]
        reps = torch.ones(k.shape[2], dtype=torch.long) if sizes is None else sizes[b].round().long().cpu()
        kk = torch.repeat_interleave(kb, reps.to(kb.device), dim=1)
        vv = torch.repeat_interleave(vb, reps.to(vb.device), dim=1)
        p = torch.softmax(q[b] @ kk.transpose(-2, -1) / math.sqrt(D), dim=-1)
        outs.append(p @ vv)
        # received per original key = sum over its copies
        owner = torch.repeat_interleave(torch.arange(k.shape[2]), reps)
        rec = torch.zeros(k.shape[2], dtype=q.dtype, device=q.device)
        rec.index_add_(0, owner.to(q.device), p.sum(dim=(0, 1)))
        recs.append(rec)
    return torch.stack(outs), torch.stack(recs)
