"""A batch of variable-length token sequences packed row by row, for attention in buckets.

Dynamic Query Selection leaves every input with its own number of latents. Everything
in a transformer block except attention is token-wise (norms, projections, MLP,
residuals), so those parts run on all kept tokens packed into one ``[T, C]`` matrix
(``T`` = total kept tokens) and cost exactly what the kept tokens cost. Only attention
needs a per-sequence layout: :meth:`RaggedBatch.padded` cuts the packed rows into
*buckets* of sequences of similar length, pads each bucket to its longest sequence
(``[b, n, D]`` plus a key mask), and :meth:`RaggedBatch.packed` puts the results back.

Packed order: sequence by sequence, bucket by bucket, tokens in order within a
sequence. A bucket whose sequences all have its length is a plain reshape of its rows
(no copy, no mask, the unmasked fused kernel runs). Masks come as additive logit biases
``[b, 1, 1, n]`` (0 or -inf), built once per dtype and reused by every block: a boolean
mask would be converted again by every attention call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Bucket:
    """``num_seqs`` consecutive sequences padded to ``length``, rows ``[start, stop)`` of the pack."""

    num_seqs: int
    length: int
    start: int
    stop: int
    # Padded layout only (None when every sequence has ``length`` tokens):
    slot_rows: Tensor | None = None  # [num_seqs * length] packed row of each slot (clamped)
    real_slots: Tensor | None = None  # [stop - start] flat slot of each real token, in pack order
    key_mask: Tensor | None = None  # [num_seqs, length] bool, True = real token


class RaggedBatch:
    """``lengths [S]`` (in packed order) grouped into buckets of ``bucket_sizes`` sequences.

    Build it once per batch; it holds index tensors only, so it is reused by every block.
    """

    def __init__(self, lengths: Tensor, bucket_sizes: Sequence[int]) -> None:
        if lengths.ndim != 1 or lengths.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"lengths must be a 1-D integer tensor, got {lengths.dtype} of shape {tuple(lengths.shape)}"
            )
        if sum(bucket_sizes) != lengths.shape[0] or any(s < 1 for s in bucket_sizes):
            raise ValueError(
                f"bucket sizes {list(bucket_sizes)} must be positive and add up to "
                f"{lengths.shape[0]} sequences"
            )
        lengths = lengths.long()
        self._biases: dict[torch.dtype, list[Tensor | None]] = {}
        # The one host synchronisation: bucket lengths decide tensor shapes.
        lens = lengths.tolist()
        if min(lens, default=1) < 1:
            raise ValueError("every sequence needs at least one token")
        offsets = torch.cumsum(lengths, 0) - lengths  # first packed row of each sequence
        self.lengths = lengths
        self.num_tokens = sum(lens)
        self.buckets: list[Bucket] = []
        seq = start = 0
        for size in bucket_sizes:
            seq_lens = lens[seq : seq + size]
            longest, stop = max(seq_lens), start + sum(seq_lens)
            if min(seq_lens) == longest:
                self.buckets.append(Bucket(size, longest, start, stop))
            else:
                slot = torch.arange(longest, device=lengths.device)
                bucket_lengths = lengths[seq : seq + size, None]
                key_mask = slot[None, :] < bucket_lengths
                # Padding slots repeat the sequence's last real row: finite values that
                # the key mask hides and whose outputs are never read back.
                rows = offsets[seq : seq + size, None] + torch.minimum(slot[None, :], bucket_lengths - 1)
                real = key_mask.flatten().nonzero().squeeze(1)
                self.buckets.append(Bucket(size, longest, start, stop, rows.flatten(), real, key_mask))
            seq += size
            start = stop

    @property
    def num_seqs(self) -> int:
        return int(self.lengths.shape[0])

    def padded(self, packed: Tensor) -> list[tuple[Tensor, Tensor | None]]:
        """``packed [T, D]`` -> per bucket ``(padded [b, n, D], attn_bias [b, 1, 1, n] | None)``.

        ``attn_bias`` is 0 for real keys and -inf for padding, in ``packed``'s dtype: pass it
        to attention as an additive mask. None when the bucket has no padding.
        """
        self._check(packed)
        biases = self.attention_biases(packed.dtype)
        out: list[tuple[Tensor, Tensor | None]] = []
        for bk, bias in zip(self.buckets, biases, strict=True):
            if bk.slot_rows is None:
                out.append((packed[bk.start : bk.stop].reshape(bk.num_seqs, bk.length, -1), None))
            else:
                padded = packed.index_select(0, bk.slot_rows).reshape(bk.num_seqs, bk.length, -1)
                out.append((padded, bias))
        return out

    def attention_biases(self, dtype: torch.dtype) -> list[Tensor | None]:
        """Per bucket the additive key mask ``[b, 1, 1, n]`` (0 real, -inf padding), or None."""
        cached = self._biases.get(dtype)
        if cached is None:
            cached = [
                None
                if bk.key_mask is None
                else torch.zeros(bk.key_mask.shape, dtype=dtype, device=bk.key_mask.device).masked_fill_(
                    ~bk.key_mask, float("-inf")
                )[:, None, None, :]
                for bk in self.buckets
            ]
            self._biases[dtype] = cached
        return cached

    def packed(self, padded: Sequence[Tensor]) -> Tensor:
        """Inverse of :meth:`padded`: per-bucket ``[b, n, D]`` -> ``[T, D]`` (padding dropped)."""
        if len(padded) != len(self.buckets):
            raise ValueError(f"expected {len(self.buckets)} buckets, got {len(padded)}")
        parts = []
        for bk, x in zip(self.buckets, padded, strict=True):
            flat = x.reshape(bk.num_seqs * bk.length, -1)
            parts.append(flat if bk.real_slots is None else flat.index_select(0, bk.real_slots))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _check(self, packed: Tensor) -> None:
        if packed.ndim != 2 or packed.shape[0] != self.num_tokens:
            raise ValueError(
                f"expected packed tokens [{self.num_tokens}, D], got shape {tuple(packed.shape)}"
            )


__all__ = ["Bucket", "RaggedBatch"]
