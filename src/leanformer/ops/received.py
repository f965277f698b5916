"""Attention received per key without the ``[B, H, Nq, Nk]`` attention matrix.

The score of key ``j`` is ``r_j = sum_h sum_i p_hij`` with
``p_hij = exp(s_hij + b_hj - lse_hi)``, ``s = q k^T * scale``, ``b`` a per-key logit bias
(``log(size)``, a key-padding mask) and ``lse_hi`` the log-sum-exp of query ``i``'s row,
which the fused CPU attention kernel returns next to its output.

Swapping the roles of queries and keys turns the column sum into another fused call:
with keys as queries, queries as keys and ``-lse`` as an additive mask, the kernel's
log-sum-exp for "query" ``j`` is ``lse'_hj = log sum_i exp(s_hij - lse_hi)``, so
``r_j = sum_h exp(lse'_hj + b_hj)``. Both calls stream the logits through the kernel's
own blocks, so memory stays ``O(B H N)`` (the log-sum-exps) instead of ``O(B H N^2)``,
and the result is exact up to the kernel's float rounding. The value of the second call
is never used (the kernel insists on one with the head size of q and k).

Shapes: ``q [B, H, Nq, D]``, ``k, v [B, H, Nk, D]``, key bias broadcastable to
``[B, H, 1, Nk]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

_fused_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def key_bias_fits(q: Tensor, k: Tensor, bias: Tensor | None) -> bool:
    """Whether ``bias`` is a per-key logit bias that broadcasts to ``[B, H, 1, Nk]``.

    A bias with a query dimension (or a larger batch than q and k) is not one.
    """
    if bias is None:
        return True
    key_shape = (q.shape[0], q.shape[1], 1, k.shape[2])
    if bias.dim() > 4:
        return False
    try:
        return torch.broadcast_shapes(bias.shape, key_shape) == key_shape
    except RuntimeError:
        return False


def fused_received_supported(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, dropout_p: float) -> bool:
    """Whether :func:`attention_with_received` applies (otherwise use explicit probabilities).

    It needs the CPU fused kernel (the one that exposes the log-sum-exp), no dropout, a
    per-key bias, and no gradient through the scores: the kernel's log-sum-exp is not
    differentiable, and training keeps the probabilities for the backward pass anyway.
    """
    tensors = (q, k, v) if bias is None else (q, k, v, bias)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return (
        not needs_grad
        and dropout_p == 0.0
        and all(t.device.type == "cpu" for t in tensors)
        and q.dtype in _KERNEL_DTYPES
        and all(t.dtype == q.dtype for t in tensors)
        and q.dim() == k.dim() == v.dim() == 4
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and key_bias_fits(q, k, bias)
    )


@torch.library.custom_op("leanformer::received_from_lse", mutates_args=())
def received_from_lse(q: Tensor, k: Tensor, lse: Tensor, key_bias: Tensor | None, scale: float) -> Tensor:
    """``[B, Nk]`` attention received, from the row log-sum-exps ``lse [B, H, Nq]``.

    ``key_bias`` is 4-D, broadcastable to ``[B, H, 1, Nk]``. An op of its own so that FLOP
    counts keep the papers' convention (scores are a by-product of attention, not model
    FLOPs); its cost shows in measured time.
    """
    # Keys attend to the queries; -lse normalises each query's row. [B, H, 1, Nq]
    row_norm = lse.neg().unsqueeze(2).to(q.dtype)
    _, col_lse = _fused_cpu(k, q, q, attn_mask=row_norm, scale=scale)  # [B, H, Nk]
    if key_bias is not None:
        col_lse = col_lse + key_bias.squeeze(2)
    return col_lse.exp().sum(dim=1).to(q.dtype)


@received_from_lse.register_fake
def _(q: Tensor, k: Tensor, lse: Tensor, key_bias: Tensor | None, scale: float) -> Tensor:
    return q.new_empty((q.shape[0], k.shape[2]))


def attention_with_received(
    q: Tensor, k: Tensor, v: Tensor, *, bias: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Fused attention ``out [B, H, Nq, D]`` and the attention each key received ``[B, Nk]``.

    ``bias``: additive per-key logit bias (see :func:`key_bias_fits`) or None. Callers
    check :func:`fused_received_supported` first.
    """
    key_bias = None if bias is None else bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    out, lse = _fused_cpu(q, k, v, attn_mask=key_bias, scale=scale)
    return out, received_from_lse(q, k, lse, key_bias, scale)
