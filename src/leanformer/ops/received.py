"""Attention and the attention each key received, one block of the matrix at a time.

The score of key ``j`` is ``r_j = sum_h sum_i p_hij``, a column sum of the softmax
probabilities. A softmax row needs only its own query, so the ``[B, H, Nq, Nk]``
probabilities split into blocks of (batch items, heads, queries), each with all of its
keys: each block's probabilities give its rows of the output (``p @ v``) and its share
of the column sums, then are freed. The result is exactly the full computation's (the
same products and sums, grouped by blocks), while the live logits shrink to one block.

For eager inference on the CPU (no autograd, no dropout) a C++ kernel computes these
blocks (:mod:`leanformer.ops.attention_native`, the custom op
``torch.ops.leanformer.attention_received_cpu``): one item, one head and a block of
queries per task. Otherwise tensor operations
compute them, in one of two block layouts (:func:`default_block`):

- **Eager on the CPU: one batch item and a few heads.** Each intra-op thread gets the
  heads whose logits hold at most ``2**18`` numbers, or one head of up to ``2**20`` (at
  785 keys, all 785 queries), so its logits stay in its core's cache through the
  product, the softmax, the column sums and the second product. A matrix of at most
  ``2**21`` numbers (batch 8 at 197 tokens) is one block: cut finer, the per-block
  overhead showed. Compiled for the CPU without autograd or dropout, with at least
  ``2**20`` logits, the graph calls the eager code as one opaque op
  (``torch.ops.leanformer.attention_received``), so the C++ kernel where it applies.
- **On an accelerator, or traced (compiled with autograd or fewer logits): every item
  and head, a block of queries.** The loop over blocks is unrolled into the graph or
  launched as kernels, so blocks are few: at most ``4 * head_dim`` queries, about
  ``2**16 / Nk`` with many keys.

In both, a block holds no more numbers than the MLP's hidden activations
(``[B, N, 4 C]``) of a block with the same token count, and outside autograd the softmax
overwrites the logits, so one block buffer is live at a time: scores add no quadratic
term to a layer's peak memory. The output is written in place into a ``[B, Nq, H, D]``
buffer, the layout the hosts merge the heads from without a copy. Times against the
whole matrix and the fused kernel: ``benchmarks/bench_high_resolution.py`` (figures in
docs/BENCHMARKS.md, "High resolution: 196, 576 and 784 tokens").

Shapes: ``q [B, H, Nq, D]``, ``k, v [B, H, Nk, D]``, ``mask`` additive, of up to four
dimensions, broadcastable with ``[B, H, Nq, Nk]`` (a mask with more items or heads than
``q`` makes as many outputs, as ``scaled_dot_product_attention`` does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from leanformer.ops import attention_native

# Numbers in one eager-CPU block: its heads' logits stay in a core's cache (1 MiB in
# float32); a single head may take up to four times that rather than split its queries,
# which measured no faster at 785 keys (batch 8, 1 thread).
_CACHE_BLOCK = 1 << 18
_CACHE_HEAD = 1 << 20
# Up to this many numbers the whole matrix is one block: cutting it finer measured
# slower (per-block overhead) at batch 1 and 8 with 197 tokens.
_WHOLE = 1 << 21
# Compiled for the CPU, attention with at least this many logits is an opaque call into
# the eager code (see _compiling_for_cpu_inference).
_OPAQUE_FROM_LOGITS = 1 << 20


class BlockShape(NamedTuple):
    """How many batch items, heads and queries one block of the attention matrix spans."""

    items: int
    heads: int
    rows: int


def default_block_rows(head_dim: int, num_keys: int) -> int:
    """Queries per block across all items and heads: at most ``4 * head_dim`` (memory),
    about ``2**16 / num_keys`` (speed)."""
    return min(4 * head_dim, max(16, (1 << 16) // max(num_keys, 1)))


def default_block(q: Tensor, num_keys: int) -> BlockShape:
    """The block layout for ``q [B, H, Nq, D]`` against ``num_keys`` keys (see the module)."""
    batch, heads, num_queries, head_dim = q.shape
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return BlockShape(batch, heads, default_block_rows(head_dim, num_keys))
    # No block holds more numbers than the MLP's hidden layer of a block with as many
    # tokens (ratio 4), so scores never raise a layer's peak memory, even in narrow models.
    mlp_hidden = batch * num_queries * 4 * heads * head_dim
    if batch * heads * num_queries * num_keys <= min(_WHOLE, mlp_hidden):
        return BlockShape(batch, heads, num_queries)
    keys = max(num_keys, 1)
    rows = min(num_queries, max(16, min(_CACHE_HEAD, mlp_hidden) // keys))
    # Each of the intra-op threads takes heads of its own (a block of one head split
    # over 2 threads measured 1.2x slower than blocks of 2 heads at 785 keys).
    per_thread = max(1, _CACHE_BLOCK // (rows * keys))
    heads_per = min(heads, torch.get_num_threads() * per_thread, max(1, mlp_hidden // (rows * keys)))
    return BlockShape(1, heads_per, rows)


def _cut(mask: Tensor | None, full: torch.Size, cuts: tuple[slice, slice, slice]) -> Tensor | None:
    """The part of ``mask`` one block sees, as ``[items * heads | 1, rows | 1, Nk]``.

    ``cuts`` are the block's (items, heads, queries) of the logits ``full``
    ``[B, H, Nq, Nk]``. The mask's axes line up with the logits' from the right; an axis
    of size 1 broadcasts, so it serves every block uncut.
    """
    if mask is None:
        return None
    index = [slice(None)] * mask.dim()
    for offset, (cut, size) in enumerate(zip(cuts, full[:3], strict=True)):
        axis = mask.dim() - 4 + offset
        if axis >= 0 and mask.shape[axis] == size:
            index[axis] = cut
    mask = mask[tuple(index)]
    mask = mask.reshape((1,) * (4 - mask.dim()) + mask.shape)
    if mask.shape[0] * mask.shape[1] == 1:
        return mask.flatten(0, 1)
    # Items and heads flatten into the products' batch axis.
    items, heads = (cut.stop - cut.start for cut in cuts[:2])
    return mask.expand(items, heads, *mask.shape[2:]).flatten(0, 1)


def _items_and_heads(q: Tensor, mask: Tensor | None) -> torch.Size:
    """``(B, H)`` of the output: ``q``'s, broadcast with a mask's items and heads (SDPA
    makes as many outputs as a mask with more of them asks)."""
    if mask is None:
        return q.shape[:2]
    lead = mask.shape[:-2][-2:]
    # Eager, a mask that adds no items or heads (the size bias, [B, 1, 1, Nk]) skips
    # torch.broadcast_shapes: its symbolic-shape checks cost about 45 us a call, a tenth
    # of a small model's attention at batch 1.
    if not torch.compiler.is_compiling() and all(
        m in (1, n) for m, n in zip(reversed(lead), reversed(q.shape[:2]), strict=False)
    ):
        return q.shape[:2]
    return torch.broadcast_shapes(q.shape[:2], lead)


def _needs_graph(*tensors: Tensor | None) -> bool:
    """Whether autograd will record the block (then no op may write over its inputs)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _block(
    q: Tensor, k_t: Tensor, v: Tensor, mask: Tensor | None, scale: float, dropout_p: float
) -> tuple[Tensor, Tensor]:
    """One block: ``q [G, rows, D]``, ``k_t [G, D, Nk]``, ``v [G, Nk, D]`` ->
    ``(out [G, rows, D], received share [G, Nk])``.

    A function of its own so the block's logits and probabilities are freed on return,
    before the next block's are made.
    """
    # The scale rides in the product. The mask does not: a product that starts from a
    # broadcast mask copies it into the output first, which measured 5x slower than
    # adding it afterwards.
    logits = torch.baddbmm(q.new_zeros(()), q, k_t, beta=0.0, alpha=scale)
    if mask is not None:
        # In place (the product's backward does not need its output): one block buffer less.
        logits = logits.add_(mask)
    if _needs_graph(q, k_t, v, mask):
        probs = logits.softmax(dim=-1)
        del logits
    else:
        # Without autograd the probabilities overwrite the logits: one block buffer, not two.
        probs = torch.softmax(logits, dim=-1, out=logits)
    # Scores come from the probabilities before dropout: dropout is a training-time
    # perturbation, not part of what the token "received".
    share = probs.sum(dim=-2)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.bmm(probs, v), share


def blocked_attention_received(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None,
    dropout_p: float,
    scale: float,
    block: BlockShape | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out [B, H, Nq, D], received [B, Nk])``, one ``block`` of the matrix at a time.

    Differentiable in every input (autograd keeps each block's probabilities).
    ``block=BlockShape(B, H, Nq)`` is the plain computation through the whole matrix;
    ``None`` takes :func:`default_block`.
    """
    if q.shape[-2] == 0:
        raise ValueError("attention with received scores needs at least one query, got 0")
    if mask is not None and mask.dim() > 4:
        raise ValueError(
            f"the mask must have at most 4 dimensions [B, H, Nq, Nk], got shape {tuple(mask.shape)}"
        )
    if block is None and _compiling_for_cpu_inference(q, k, v, mask, dropout_p):
        out, received = torch.ops.leanformer.attention_received(q, k, v, mask, scale)
        return out.transpose(1, 2), received
    if mask is not None:
        # A mask with more items or heads than q, k and v (SDPA broadcasts them against
        # it) gets them expanded to its own: every block then cuts all four alike.
        lead = _items_and_heads(q, mask)
        q, k, v = (t.expand(*lead, *t.shape[2:]) for t in (q, k, v))
    if block is None and attention_native.applies(q, k, v, mask, dropout_p):
        out, received = attention_native.attention_received(q, k, v, mask, scale)
        return out.transpose(1, 2), received
    batch, heads, num_queries, head_dim = q.shape
    num_keys = k.shape[-2]
    items, heads_per, rows = default_block(q, num_keys) if block is None else block
    if min(items, heads_per, rows) < 1:
        raise ValueError(f"every side of a block must be >= 1, got {BlockShape(items, heads_per, rows)}")
    starts = [
        (b, h, r)
        for b in range(0, batch, items)
        for h in range(0, heads, heads_per)
        for r in range(0, num_queries, rows)
    ]
    if items > 1 and len(starts) > 1:
        # k and v are usually strided views of one qkv projection: blocks that span
        # several items flatten items and heads into one batch axis, which copies them,
        # so they are copied once here rather than by every block.
        k, v = k.contiguous(), v.contiguous()
    elif len(starts) >= 4 and num_keys >= 4 * head_dim:
        # One item per block: with many keys v's product reads it faster contiguous
        # (1.1x at 785 keys), worth one copy when there are several blocks; with fewer
        # keys than 4 head sizes the copy costs more than it saves (0.93x without it at
        # 197 keys, batch 32); k's measured no faster.
        v = v.contiguous()
    k_t = k.transpose(-2, -1)
    full = torch.Size((batch, heads, num_queries, num_keys))
    # The output is laid out [B, Nq, H, D], so the hosts' merge of the heads
    # (``out.transpose(1, 2).reshape(B, Nq, H * D)``) is a view, not a copy.
    out = q.new_empty(batch, num_queries, heads, head_dim)
    received = q.new_zeros(batch, heads, num_keys)
    # A fixed number of blocks, known from the shapes: no host sync, compiles unrolled.
    for b, h, r in starts:
        cuts = (slice(b, min(b + items, batch)), slice(h, min(h + heads_per, heads)), slice(r, r + rows))
        block_out, share = _block(
            q[cuts].flatten(0, 1),
            k_t[cuts[:2]].flatten(0, 1),
            v[cuts[:2]].flatten(0, 1),
            _cut(mask, full, cuts),
            scale,
            dropout_p,
        )
        block_items = cuts[0].stop - cuts[0].start
        out[cuts[0], cuts[2], cuts[1]] = block_out.unflatten(0, (block_items, -1)).transpose(1, 2)
        received[cuts[:2]] += share.unflatten(0, (block_items, -1))
    return out.transpose(1, 2), received.sum(dim=1)


def _compiling_for_cpu_inference(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float
) -> bool:
    """Whether this call is traced for the CPU, without autograd or dropout, with at least
    ``_OPAQUE_FROM_LOGITS`` logits: then the blocks run as one opaque call into the eager
    code, which lays them out for the cache (one item and a few heads).

    Traced, the blocks span every item and head, in fused kernels. Timed compiled, the
    opaque call wins clearly at hundreds of keys and large batches, the two are even
    around two million logits, and the traced blocks are slightly faster below that
    (docs/BENCHMARKS.md, "High resolution: 196, 576 and 784 tokens").
    """
    if q.device.type != "cpu" or not torch.compiler.is_compiling():
        return False  # eager: decided before the shapes are broadcast
    items, heads = _items_and_heads(q, mask)
    logits = items * heads * q.shape[2] * k.shape[-2]
    return dropout_p == 0.0 and logits >= _OPAQUE_FROM_LOGITS and not _needs_graph(q, k, v, mask)


@torch.library.custom_op("leanformer::attention_received", mutates_args=())
def _attention_received_op(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """:func:`blocked_attention_received` in its default blocks, run eagerly, as one opaque
    call: ``(out [B, Nq, H, D], received [B, Nk])``; ``out`` is the contiguous buffer the
    heads are written into (the caller's transpose makes it ``[B, H, Nq, D]``)."""
    out, received = blocked_attention_received(q, k, v, mask=mask, dropout_p=0.0, scale=scale)
    return out.transpose(1, 2), received


@_attention_received_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    batch, heads = _items_and_heads(q, mask)
    return q.new_empty(batch, q.shape[-2], heads, v.shape[-1]), q.new_empty(batch, k.shape[-2])
