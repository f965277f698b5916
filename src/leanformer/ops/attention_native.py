"""Attention with received scores in C++ for eager CPU inference
(``attention_received_cpu.cpp``), as the custom op ``torch.ops.leanformer.attention_received_cpu``.

:func:`leanformer.ops.received.blocked_attention_received` computes the probabilities
block by block with tensor operations, so that it can differentiate them; for inference on
the CPU this kernel does the same arithmetic in one pass per (item, head, block of
queries): a BLAS product for the logits, the softmax and its column sums while they are
in cache, a BLAS product for the output (docs/BENCHMARKS.md, "High resolution: 196, 576
and 784 tokens"). Its FLOP formula counts those two products, as the blocks' are counted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from leanformer.ops.native import check_one_device, extension, register_kernel, use_kernel

OP = "attention_received_cpu"

register_kernel(
    OP,
    "_attention_received_cpu",
    what="attention kernel",
    instead="attention with received scores runs its PyTorch blocks on the CPU: the same results, slower",
)

# Queries per task: about 2^17 logits (512 KiB in float32) a task, so the rows of keys
# and values each product packs are reused across many queries while the logits stay
# near the core (at 785 keys, 166 rows measured 3-4% faster than 83 and alike with 128
# or 227; at 197 keys every query is one task).
_TASK_LOGITS = 1 << 17


def applies(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> bool:
    """Whether :func:`attention_received` may stand in for the tensor blocks: the gate
    (:func:`leanformer.ops.native.use_kernel`: eager CPU inference in float32 or float64),
    and what this kernel alone asks: no dropout, one floating type for ``q``, ``k`` and
    ``v``, values as wide as the queries, at least one key and one feature."""
    if dropout_p > 0.0 or not q.dtype == k.dtype == v.dtype or v.shape[-1] != q.shape[-1]:
        return False
    if min(k.shape[-2], q.shape[-1]) == 0:
        return False  # no keys or no features: the tensor blocks' empty products
    return use_kernel(OP, q, k, v, mask)


def _blas_rows(t: Tensor) -> Tensor:
    """``t`` itself when a BLAS product can step through its rows, else a contiguous copy
    (or the values of a lazily negated view)."""
    t = t.resolve_neg()  # itself unless stored negated
    if t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1]:
        return t
    # clone, not contiguous(): with one row, contiguous() keeps any stride of that row.
    return t.clone(memory_format=torch.contiguous_format)


@torch.library.custom_op(f"leanformer::{OP}", mutates_args=())
def attention_received(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """``(out [B, Nq, H, D], received [B, Nk])`` for ``q [B, H, Nq, D]``, ``k, v [B, H, Nk, D]``
    (already broadcast to the mask's items and heads) and an additive ``mask``
    broadcastable to ``[B, H, Nq, Nk]``; ``out`` is contiguous."""
    batch, heads, num_queries, _ = q.shape
    num_keys = k.shape[-2]
    if mask is not None:
        mask = mask.to(q.dtype).expand(batch, heads, num_queries, num_keys)
        if mask.stride(-1) not in (0, 1):
            mask = mask.contiguous()
        mask = mask.resolve_neg()  # the kernel reads stored values
    rows = min(num_queries, max(16, _TASK_LOGITS // max(num_keys, 1)))
    return extension(OP).attention_received(_blas_rows(q), _blas_rows(k), _blas_rows(v), mask, scale, rows)


@attention_received.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    check_one_device(OP, q, k, v, mask)
    batch, heads, num_queries, _ = q.shape
    return q.new_empty(batch, num_queries, heads, v.shape[-1]), q.new_empty(batch, k.shape[-2])


@register_flop_formula(torch.ops.leanformer.attention_received_cpu)
def _flops(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    # The logits (q k^T) and the output (p v): the two products the blocks count.
    batch, heads, num_queries, head_dim = q
    return 2 * batch * heads * num_queries * k[-2] * (head_dim + v[-1])
