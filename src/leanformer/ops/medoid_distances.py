"""Token-to-token squared distances for K-Medoids, computed only where the iterations read them.

K-Medoids (:func:`leanformer.ops.clustering.kmedoids_plan`) reads the distance between
two tokens in two places:

- assignment: every non-medoid against every current medoid;
- medoid update: every pair of tokens in the same cluster.

Neither ever reads the distance between two *initial* medoids that have both stayed
medoids so far: both are medoids, so neither is assigned and they sit in different
clusters. With K = N/2 (the usual budget) those pairs are a quarter of the matrix, so
:class:`MedoidDistances` leaves them out of the products (the non-medoids' rows only,
``[N - K, C] x [C, N]`` per example at most, instead of ``[N, C] x [C, N]``; see
:func:`split_point` for the part of those rows that is each other's transpose). When an
initial medoid is demoted, its row is computed then (:meth:`MedoidDistances.reveal`);
on typical inputs few are.

Tokens are held in *medoids-first order*: the K initial medoids, in medoid order, then
the other tokens in index order. The unknown block is then the leading ``[K, K]`` block
of the matrix, and the product's output rows are the trailing ``N - K`` rows. Unknown
entries hold ``+inf``: they only ever meet a minimum over medoids (where the medoid's
own 0 wins) or sums that are not read.

Every entry is ``(|x_j|^2 - g_ij) + (|x_i|^2 - g_ji)`` from Gram entries ``g``, written
identically at ``(i, j)`` and ``(j, i)``: the matrix is bitwise symmetric with a zero
diagonal, so exact ties (the two members of a 2-token cluster have equal cost) go to the
lower index as in a per-example reference.
"""

from __future__ import annotations

import torch
from torch import Tensor


def medoids_first_order(init: Tensor, num_tokens: int) -> Tensor:
    """``init [B, K]`` medoid indices -> ``[B, N]`` token order: ``init``, then the rest by index."""
    B, k = init.shape
    is_medoid = torch.zeros(B, num_tokens, dtype=torch.uint8, device=init.device).scatter_(1, init, 1)
    rest = is_medoid.argsort(dim=1, stable=True)[:, : num_tokens - k]
    return torch.cat([init, rest], dim=1)


def split_point(num_medoids: int, num_tokens: int) -> int:
    """Where the non-medoids ``[K, N)`` split into the groups P = ``[K, s)`` and Q = ``[s, N)``.

    The products skip the P x Q block (it is the transpose of Q x P), about a quarter of
    the non-medoids' block against themselves when the groups are equal. ``s`` is ``K``
    plus half the non-medoids, rounded up to a multiple of 16: with MKL on AVX-512 a
    first product whose column count is a multiple of 16 measured faster than nearby
    counts (at N = 196, K = 98: 160 columns, 8% less time than one product; 148
    columns, 4%). ``N`` (no split) when that reaches ``N``.
    """
    s = -(-(num_medoids + (num_tokens - num_medoids) // 2) // 16) * 16
    return min(s, num_tokens)


class MedoidDistances:
    """Squared distances ``[B, N, N]`` between tokens ``x [B, N, C]`` in medoids-first order.

    ``num_medoids = K``: the first K tokens are the initial medoids. ``matrix`` holds
    ``+inf`` between two of them until :meth:`reveal` computes their rows, and otherwise
    the distances (see the module doc). ``reveal_all=True`` computes everything at once,
    with no host sync (for accelerators, where :meth:`reveal` would sync).
    """

    def __init__(self, x: Tensor, num_medoids: int, *, reveal_all: bool = False) -> None:
        B, N, _ = x.shape
        k = num_medoids
        self.x = x
        self.num_medoids = k
        # Positions in three groups: the initial medoids M = [0, k), then the non-medoids
        # split into P = [k, s) and Q = [s, N). Gram entries g_ij = x_i . x_j come from two
        # products, (P u Q) x (M u P) and Q x Q: the Q x P block is computed once and
        # serves P x Q too (see split_point).
        s = split_point(k, N)
        d = x.new_empty(B, N, N)
        torch.bmm(x[:, k:], x[:, :s].transpose(1, 2), out=d[:, k:, :s])
        if s < N:
            torch.bmm(x[:, s:], x[:, s:].transpose(1, 2), out=d[:, s:, s:])
        # |x_i|^2: for the non-medoids from the products' diagonals; for the initial
        # medoids, whose Gram block is not computed, as a norm (one pass over the tokens;
        # vecdot is a product, then a sum).
        sq = x.new_empty(B, N)
        torch.linalg.vector_norm(x[:, :k], dim=-1, out=sq[:, :k]).square_()
        for group in (slice(k, s), slice(s, N)):
            sq[:, group] = d[:, group, group].diagonal(dim1=1, dim2=2)
        self.sq = sq
        # Blocks computed on one side only (rows, columns): both halves from the one g_rc,
        # and the result copied to the mirror block.
        one_sided = [(slice(k, N), slice(0, k)), (slice(s, N), slice(k, s))]
        other_halves = [sq[:, rows, None] - d[:, rows, cols] for rows, cols in one_sided]  # |x_r|^2 - g_rc
        # |x_j|^2 - g_ij wherever g was computed, in place.
        torch.sub(sq[:, None, :s], d[:, k:, :s], out=d[:, k:, :s])
        torch.sub(sq[:, None, s:], d[:, s:, s:], out=d[:, s:, s:])
        for (rows, cols), half in zip(one_sided, other_halves, strict=True):
            d[:, rows, cols].add_(half)
            d[:, cols, rows] = d[:, rows, cols].transpose(1, 2)
        # Blocks computed on both sides (P x P, Q x Q): (i, j) plus (j, i), exactly
        # symmetric (addition commutes). A copy, always: with one token the transpose is
        # the same memory as the block.
        for group in (slice(k, s), slice(s, N)):
            both = d[:, group, group]
            both.add_(both.transpose(1, 2).clone(memory_format=torch.contiguous_format))
        d[:, :k, :k] = float("inf")
        # Exact 0 even when |x_j|^2 overflows (inf - inf = NaN), e.g. large float16 tokens.
        d.diagonal(dim1=1, dim2=2).zero_()
        self.matrix = d
        # Rows whose entries are all known: every non-medoid's.
        self.known = torch.arange(N, device=x.device).expand(B, N) >= k
        if reveal_all:
            if k > 1:
                self._fill(torch.arange(B, device=x.device), torch.arange(k, device=x.device).expand(B, k))
            self.known = torch.ones_like(self.known)

    def reveal(self, tokens: Tensor) -> None:
        """Compute the unknown entries in the rows of ``tokens [B, N]`` (bool mask).

        Reads which examples need rows, and how many at most, back to the host; then one
        batched product over those examples only.
        """
        need = tokens & ~self.known
        examples = need.any(dim=1).nonzero().squeeze(1)
        if examples.numel() == 0:
            return
        k = self.num_medoids
        need = need[examples, :k]
        count = int(need.sum(dim=1).max())
        # The needed rows first; an example that needs fewer fills other rows too: unknown
        # ones first (correct values, only earlier than necessary), else known ones
        # (whose entries are kept, see _fill).
        unknown = ~self.known[examples, :k]
        rows = (need.to(torch.uint8) * 2 + unknown.to(torch.uint8)).topk(count, dim=1).indices
        self._fill(examples, rows)
        self.known[examples[:, None], rows] = True

    def _fill(self, examples: Tensor, rows: Tensor) -> None:
        """Write rows and columns ``rows [E, n]`` (positions < K) of the medoid block of
        ``examples [E]``. Reads only those examples' medoids: on CPU the cost is memory."""
        E, n = rows.shape
        k = self.num_medoids
        x, sq = self.x, self.sq
        B, N, C = x.shape
        medoids = x[:, :k] if E == B else x[:, :k].index_select(0, examples)
        picked = x.reshape(B * N, C).index_select(0, (rows + examples[:, None] * N).flatten())
        g = torch.bmm(picked.view(E, n, C), medoids.transpose(1, 2))  # [E, n, K]
        sq = sq.index_select(0, examples)
        vals = (sq[:, None, :k] - g).add_(sq.gather(1, rows)[:, :, None] - g)
        ex = examples[:, None]
        # Entries shared with a row revealed earlier keep the value written then: every
        # distance is computed once, however the reveals are grouped.
        known = self.known.index_select(0, examples)
        earlier = known[:, None, :k] | known.gather(1, rows)[:, :, None]
        vals = torch.where(earlier, self.matrix[ex, rows, :k], vals)
        # Entries between two rows filled together were computed twice (g_ij and g_ji
        # from different product entries): keep one value for both, and 0 on the diagonal.
        between = rows[:, None, :].expand(E, n, n)
        sub = vals.gather(2, between)
        sub = torch.minimum(sub, sub.transpose(1, 2))
        sub.diagonal(dim1=1, dim2=2).zero_()
        vals.scatter_(2, between, sub)
        self.matrix[ex, rows, :k] = vals
        positions = torch.arange(k, device=x.device)
        self.matrix[ex[:, :, None], positions[None, :, None], rows[:, None, :]] = vals.transpose(1, 2)
