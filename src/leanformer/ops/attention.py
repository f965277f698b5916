"""Scaled dot-product attention with token sizes and attention-received scores.

Shapes: ``q [B, H, Nq, D]``, ``k, v [B, H, Nk, D]``. Token *sizes* ``[B, Nk]`` say how
many input tokens each key stands for (after pooling or merging); they enter the
logits as an additive ``log(size)`` bias, so a key of size s counts as s identical
keys (proportional attention). The bias goes through the fused
``scaled_dot_product_attention`` kernel as an ``attn_mask``. The attention each key
received comes from two fused calls (:mod:`leanformer.ops.received`) where the kernel
exposes its log-sum-exp, so the ``[B, H, Nq, Nk]`` probabilities are never stored;
only a gradient through the scores, dropout or a mask with a query dimension need the
explicit probabilities.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from leanformer.ops.received import attention_with_received, fused_received_supported


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
    if fused_received_supported(q, k, v, mask, dropout_p):
        return attention_with_received(q, k, v, bias=mask, scale=scale)
    return _explicit_attention(q, k, v, mask=mask, dropout_p=dropout_p, scale=scale)


def _explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, dropout_p: float, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention through the stored probabilities; the scores keep their autograd graph."""
    logits = (q * scale) @ k.transpose(-2, -1)
    if mask is not None:
        # In place when the mask broadcasts to the logits (the usual case): one [B, H, N, N]
        # buffer less (the matmul's backward does not need its output).
        fits = torch.broadcast_shapes(logits.shape, mask.shape) == logits.shape
        logits = logits.add_(mask) if fits else logits + mask
    probs = logits.softmax(dim=-1)
    # Scores come from the probabilities before dropout: dropout is a training-time
    # perturbation, not part of what the token "received".
    received = probs.sum(dim=(1, 2))
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v, received


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
