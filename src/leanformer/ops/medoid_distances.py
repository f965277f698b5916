"""Distances between K-Medoids' medoids and the other tokens, kept current as medoids move.

A medoid belongs to its own cluster, so the assignment step only needs the distances
between the ``K`` medoids and the ``M = N - K`` other tokens: ``K x M`` of them, a quarter
of the ``N x N`` token pairs at ``K = N / 2`` and far fewer when a block removes a few
tokens. :class:`MedoidDistances` holds them as ``dists [B, K, M]``, column ``m`` for token
``others[:, m]``.

After a medoid update, :func:`after_moves` recomputes only what changed. The new medoid
of a cluster is one of its members, so it was one of the other tokens; the old medoid
takes its column. For every medoid that moved, that column (distances from every
medoid) and the medoid's row (distances to every other token) are recomputed; few
medoids move once the tokens have settled into clusters (1-14% in the first update on
``deit_fashion``, fewer later). How many moved is read back to the host, so this is for
eager CPU; elsewhere :func:`medoid_distances` computes the table afresh.

Shapes: centred tokens ``xc [B, N, C]``, their squared norms ``sq_norms [B, N]``,
``medoids [B, K]`` token indices, distinct per example, ``K < N``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from leanformer.ops.segment_sum import flat_rows, marked_first
from leanformer.ops.token_distances import pairwise_sq_dists
from leanformer.ops.token_selection import gather_tokens


class MedoidDistances(NamedTuple):
    """``others [B, M]``: the tokens that are not medoids (or all tokens: the assignment
    puts every medoid in its own cluster whatever its column holds); ``dists [B, K, M]``:
    squared distance from medoid ``j`` to token ``others[:, m]``."""

    others: Tensor
    dists: Tensor


def _between(xc: Tensor, sq_norms: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """Squared distances ``[B, R, S]`` between the tokens ``rows [B, R]`` and ``cols [B, S]``.

    Both sets are copied out of ``xc`` for the product, unless one holds more than half of
    the tokens (the medoids, when a block removes a few) or the other very few (the
    medoids that moved): then the smaller set is multiplied against all tokens in place
    and the wanted columns are picked, which reads all tokens once instead of copying
    many of them.
    """
    R, S, N = rows.shape[1], cols.shape[1], xc.shape[1]
    if 2 * max(R, S) <= N and 8 * min(R, S) > N:
        return pairwise_sq_dists(
            gather_tokens(xc, rows),
            gather_tokens(xc, cols),
            x_sq_norms=sq_norms.gather(1, rows),
            y_sq_norms=sq_norms.gather(1, cols),
        )
    few, many = (rows, cols) if R <= S else (cols, rows)
    to_all = pairwise_sq_dists(
        gather_tokens(xc, few), xc, x_sq_norms=sq_norms.gather(1, few), y_sq_norms=sq_norms
    )
    picked = to_all.gather(2, many[:, None, :].expand(-1, few.shape[1], -1))
    return picked if R <= S else picked.transpose(1, 2)


def non_medoids(medoids: Tensor, num_tokens: int) -> Tensor:
    """The ``N - K`` tokens that are not in ``medoids [B, K]``, in token order -> ``[B, N - K]``."""
    B, k = medoids.shape
    other = torch.ones(B, num_tokens, dtype=torch.bool, device=medoids.device).scatter_(1, medoids, False)
    return marked_first(other, num_tokens - k)


def medoid_distances(xc: Tensor, sq_norms: Tensor, medoids: Tensor) -> MedoidDistances:
    """The table for ``medoids``, computed afresh: one ``K x (N - K)`` product per example."""
    others = non_medoids(medoids, xc.shape[1])
    return MedoidDistances(others, _between(xc, sq_norms, medoids, others).contiguous())


def nearest_medoids(table: MedoidDistances, medoids: Tensor, num_tokens: int) -> Tensor:
    """``assign [B, N]``: every token's nearest medoid, the first in medoid order on ties;
    a medoid is in its own cluster (eqs. 10/16)."""
    B, k, _ = table.dists.shape
    nearest = table.dists.min(dim=1).indices  # the first minimum
    assign = torch.empty(B, num_tokens, dtype=torch.long, device=medoids.device)
    assign.scatter_(1, table.others, nearest)
    return assign.scatter_(1, medoids, torch.arange(k, device=medoids.device).expand(B, k))


def after_moves(
    table: MedoidDistances, xc: Tensor, sq_norms: Tensor, old: Tensor, new: Tensor
) -> MedoidDistances:
    """The table of ``old [B, K]`` medoids -> that of ``new``, recomputing only what the moved
    medoids change (see the module doc). Updates ``table`` in place. Reads back how many
    medoids moved: eager CPU only."""
    B, k, m = table.dists.shape
    moved = new != old
    most = int(moved.sum(dim=1).max())
    if most == 0:
        return table
    # Each example's moved slots first. An example with fewer repeats its first write in
    # the remaining slots (or, with none, rewrites column 0 as it is): every write is
    # then needed or changes nothing, and writes to one place carry one value.
    slots = marked_first(moved, most)
    real = moved.gather(1, slots)
    any_moved = real[:, :1]
    column_of = torch.zeros(B, xc.shape[1], dtype=torch.long, device=old.device)
    column_of.scatter_(1, table.others, torch.arange(m, device=old.device).expand(B, m))
    column = column_of.gather(1, new.gather(1, slots))  # where each new medoid sat
    leaving = old.gather(1, slots)  # the token that takes that column
    column = torch.where(real, column, torch.where(any_moved, column[:, :1], 0))
    leaving = torch.where(real, leaving, torch.where(any_moved, leaving[:, :1], table.others[:, :1]))
    others = table.others.scatter_(1, column, leaving)
    dists = table.dists
    dists.scatter_(2, column[:, None, :].expand(B, k, most), _between(xc, sq_norms, new, leaving))
    fresh_rows = _between(xc, sq_norms, new.gather(1, slots), others).view(B * most, m)
    dists.view(B * k, m).index_copy_(0, flat_rows(slots, k), fresh_rows)
    return MedoidDistances(others, dists)
