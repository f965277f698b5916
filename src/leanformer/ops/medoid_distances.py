"""Distances between K-Medoids' medoids and the other tokens.

A medoid belongs to its own cluster, so the assignment step only needs the distances
between the ``K`` medoids and the ``M = N - K`` other tokens: ``K x M`` of them, a quarter
of the ``N x N`` token pairs at ``K = N / 2`` and far fewer when a block removes a few
tokens. :class:`MedoidDistances` holds them as ``dists [B, K, M]``, column ``m`` for token
``others[:, m]``.

The batched plan computes the table afresh after every medoid update; the C++ iterations
(:mod:`leanformer.ops.kmedoids_native`) make the same table for the initial medoids
themselves (one BLAS product, the sums in this module's order) and then recompute only
what moved medoids change.

Shapes: centred tokens ``xc [B, N, C]``, their squared norms ``sq_norms [B, N]``,
``medoids [B, K]`` token indices, distinct per example, ``K < N``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from leanformer.ops.segment_sum import marked_first
from leanformer.ops.token_distances import pairwise_sq_dists
from leanformer.ops.token_selection import gather_tokens


class MedoidDistances(NamedTuple):
    """``others [B, M]``: the tokens that are not medoids (or all tokens: the assignment
    puts every medoid in its own cluster whatever its column holds); ``dists [B, K, M]``:
    squared distance from medoid ``j`` to token ``others[:, m]``."""

    others: Tensor
    dists: Tensor


def _between(xc: Tensor, sq_norms: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """Squared distances ``[B, R, S]`` between the tokens ``rows [B, R]`` and ``cols [B, S]``:
    both sets copied out of ``xc``, then one product. (Multiplying the smaller set against
    all tokens in place and picking the wanted columns saves the copy but measured 1.3-6.6x
    slower, where a block removes a few tokens or half of them: the pick is a gather.)"""
    return pairwise_sq_dists(
        gather_tokens(xc, rows),
        gather_tokens(xc, cols),
        x_sq_norms=sq_norms.gather(1, rows),
        y_sq_norms=sq_norms.gather(1, cols),
    )


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
