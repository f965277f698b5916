"""Attention and the attention each key received, a block of queries at a time.

The score of key ``j`` is ``r_j = sum_h sum_i p_hij``, a column sum of the softmax
probabilities. A softmax row needs only its own query, so the queries split into
blocks: each block's probabilities ``[B, H, rows, Nk]`` give its rows of the output
(``p @ v``) and its share of the column sums, then are freed. The result is exactly
the full computation's (the same products and sums, grouped by rows), while the live
logits shrink from ``[B, H, Nq, Nk]`` to one block.

The default block has at most ``4 * head_dim`` rows, so it holds no more numbers than
the MLP's hidden activations (``[B, N, 4 C]``) of a block with the same token count, and
outside autograd the softmax overwrites the logits, so one block buffer is live at a
time: scores add no quadratic term to a layer's peak memory. With many keys it takes
fewer rows, about ``2**16 / Nk`` (83 at 785 keys): each head's ``[rows, Nk]`` slab then
stays small enough for the softmax and the two products to run from cache, which
measured 1.4x faster than 256 rows at 785 keys (batch 8, 1 thread); with up to 256 keys
all queries up to ``4 * head_dim`` form one block.
Time and memory against one whole-matrix block: ``benchmarks/bench_high_resolution.py``
(figures in ``docs/BENCHMARKS.md``).

Shapes: ``q [B, H, Nq, D]``, ``k, v [B, H, Nk, D]``, ``mask`` additive and broadcastable
to ``[B, H, Nq, Nk]`` (or beyond it, in its batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def default_block_rows(head_dim: int, num_keys: int) -> int:
    """Queries per block: at most ``4 * head_dim`` (memory), about ``2**16 / num_keys`` (speed)."""
    return min(4 * head_dim, max(16, (1 << 16) // max(num_keys, 1)))


def _rows_of(mask: Tensor | None, start: int, stop: int, num_queries: int) -> Tensor | None:
    """The mask for queries ``start:stop`` (a mask without a query dimension serves all)."""
    if mask is None or mask.dim() < 2 or mask.shape[-2] != num_queries or num_queries == 1:
        return mask
    return mask[..., start:stop, :]


def _needs_graph(*tensors: Tensor | None) -> bool:
    """Whether autograd will record the block (then no op may write over its inputs)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _block(q: Tensor, k_t: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> tuple[Tensor, Tensor]:
    """One block of (pre-scaled) queries: ``(out [B, H, rows, D], received share [B, Nk])``.

    A function of its own so the block's logits and probabilities are freed on return,
    before the next block's are made.
    """
    logits = q @ k_t
    if mask is not None:
        # In place when the mask broadcasts to the logits (the usual case): one block
        # buffer less (the matmul's backward does not need its output).
        fits = torch.broadcast_shapes(logits.shape, mask.shape) == logits.shape
        logits = logits.add_(mask) if fits else logits + mask
    if _needs_graph(q, k_t, v, mask):
        probs = logits.softmax(dim=-1)
        del logits
    else:
        # Without autograd the probabilities overwrite the logits: one block buffer, not two.
        probs = torch.softmax(logits, dim=-1, out=logits)
    # Scores come from the probabilities before dropout: dropout is a training-time
    # perturbation, not part of what the token "received".
    share = probs.sum(dim=(1, 2))
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v, share


def blocked_attention_received(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None,
    dropout_p: float,
    scale: float,
    block_rows: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out [B, H, Nq, D], received [B, Nk])``, ``block_rows`` queries at a time.

    Differentiable in every input (autograd keeps each block's probabilities).
    ``block_rows >= Nq`` is the plain computation through the whole matrix.
    """
    num_queries = q.shape[-2]
    rows = default_block_rows(q.shape[-1], k.shape[-2]) if block_rows is None else block_rows
    if rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {rows}")
    if num_queries >= 4 * rows:
        # k and v are usually strided views of one qkv projection, which every block's
        # matmul would copy whole again. With four blocks or more they are copied once
        # here instead, the scale going into the keys' copy so the queries need none
        # (with fewer, the saving is small and the copies, live through the loop, would
        # raise the peak above that of copies made and freed block by block).
        k, v = (k * scale).contiguous(), v.contiguous()
    else:
        q = q * scale
    k_t = k.transpose(-2, -1)
    outs: list[Tensor] = []
    received: Tensor | None = None
    # A fixed number of blocks, known from the shapes: no host sync, compiles unrolled.
    for start in range(0, num_queries, rows):
        stop = min(start + rows, num_queries)
        out, share = _block(
            q[..., start:stop, :], k_t, v, _rows_of(mask, start, stop, num_queries), dropout_p
        )
        outs.append(out)
        received = share if received is None else received + share
    if received is None:
        raise ValueError("attention with received scores needs at least one query, got 0")
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    return out, received
