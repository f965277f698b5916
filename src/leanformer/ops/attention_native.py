"""Attention with received scores in C++ for eager CPU inference (``attention_received_cpu.cpp``).

:func:`leanformer.ops.received.blocked_attention_received` computes the probabilities
block by block with tensor operations, so that it can differentiate them; for inference on
the CPU this kernel does the same arithmetic in one pass per (item, head, block of
queries): a BLAS product for the logits, the softmax and its column sums while they are
in cache, a BLAS product for the output. It measured about as fast as PyTorch's fused
attention (which gives no scores) and faster than the tensor blocks (docs/BENCHMARKS.md,
"High resolution: 196, 576 and 784 tokens").
"""

from __future__ import annotations

import torch
from torch import Tensor

from leanformer.ops.native import MissingKernelNotice, counting, load, transformed

_kernel = load("_attention_received_cpu")
_missing = MissingKernelNotice(
    "attention kernel (leanformer.ops._attention_received_cpu), so attention with received "
    "scores runs its PyTorch blocks on the CPU: the same results, slower",
)

# Queries per task: about 2^17 logits (512 KiB in float32) a task, so the rows of keys
# and values each product packs are reused across many queries while the logits stay
# near the core (at 785 keys, 166 rows measured 3-4% faster than 83 and alike with 128
# or 227; at 197 keys every query is one task).
_TASK_LOGITS = 1 << 17


def kernel_available() -> bool:
    """Whether the package was built with the C++ attention kernel."""
    return _kernel is not None


def applies(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, needs_graph: bool
) -> bool:
    """Whether :func:`attention_received` may stand in for the tensor blocks: eager CPU
    inference in float32 or float64, no dropout, no FLOP counter watching (it would not
    see the kernel's products), values as wide as the queries."""
    if q.device.type != "cpu" or needs_graph or dropout_p > 0.0 or torch.compiler.is_compiling():
        return False
    if q.dtype not in (torch.float32, torch.float64) or not q.dtype == k.dtype == v.dtype or counting():
        return False
    if transformed(q, k, v, mask):  # forward tangents or torch.func wrappers: the blocks keep them
        return False
    if v.shape[-1] != q.shape[-1] or (mask is not None and mask.device.type != "cpu"):
        return False
    if min(k.shape[-2], q.shape[-1]) == 0 or not q.device == k.device == v.device:
        return False  # no keys or no features: the tensor blocks' empty products
    if _kernel is None:
        _missing.warn_once(stacklevel=4)  # past applies, blocked_attention_received and attention
        return False
    return True


def _blas_rows(t: Tensor) -> Tensor:
    """``t`` itself when a BLAS product can step through its rows, else a contiguous copy
    (or the values of a lazily negated view)."""
    t = t.resolve_neg()  # itself unless stored negated
    if t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1]:
        return t
    # clone, not contiguous(): with one row, contiguous() keeps any stride of that row.
    return t.clone(memory_format=torch.contiguous_format)


def attention_received(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """``(out [B, Nq, H, D], received [B, Nk])`` for ``q [B, H, Nq, D]``, ``k, v [B, H, Nk, D]``
    (already broadcast to the mask's items and heads) and an additive ``mask``
    broadcastable to ``[B, H, Nq, Nk]``. Needs :func:`applies`."""
    if _kernel is None:
        raise RuntimeError("leanformer was installed without its C++ attention kernel")
    batch, heads, num_queries, _ = q.shape
    num_keys = k.shape[-2]
    if mask is not None:
        mask = mask.to(q.dtype).expand(batch, heads, num_queries, num_keys)
        if mask.stride(-1) not in (0, 1):
            mask = mask.contiguous()
    rows = min(num_queries, max(16, _TASK_LOGITS // max(num_keys, 1)))
    mask = None if mask is None else mask.resolve_neg()  # the kernel reads stored values
    return _kernel.attention_received(_blas_rows(q), _blas_rows(k), _blas_rows(v), mask, scale, rows)
