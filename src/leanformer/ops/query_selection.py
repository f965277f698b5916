"""Dynamic Query Selection (DQS): which latent queries an input needs.

Given the cross-attention outputs ``Y [B, K, C]`` of ``K`` ordered candidate queries,
query ``i`` is dropped when its output is too similar to the output of an earlier
query: ``cos(y_i, y_j) > t`` for some ``j < i``. Two rules are offered:

* ``"any"`` (the paper, section 3.4 and figure 10): ``j`` ranges over *all* previous
  queries, dropped or not. A query can therefore be dropped because it resembles a
  query that was itself dropped.
* ``"kept"`` (greedy): ``j`` ranges over previous *kept* queries only, so every
  dropped query has a kept representative above the threshold; it keeps at least
  as many queries as ``"any"``.

The first candidate is always kept. Similarities are clamped to ``[-1, 1]``, so here any
``t >= 1`` keeps every query and ``t < -1`` keeps only the first. A user's threshold outside
``[-1, 1]`` is nearly always a slip (a percentage, a count): the model and the command line
refuse it (:func:`check_dqs_threshold`); these functions still take any real number.

Everything here is a selection *plan* (no gradients), computed once per batch; the
model then runs only the kept queries, packed, with attention in buckets of similar
kept count (:func:`bucket_counts`).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

DQSRule = Literal["any", "kept"]
DQS_RULES: tuple[str, ...] = ("any", "kept")


def check_dqs_threshold(value: object, name: str = "dqs_threshold") -> float:
    """``value`` as a float if it is a cosine threshold in [-1, 1]; a ValueError otherwise."""
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    if not -1.0 <= number <= 1.0:
        raise ValueError(f"{name} must be a number in [-1, 1] (a cosine similarity), got {value!r}")
    return float(number)


def cosine_similarities(y: Tensor, eps: float = 1e-8) -> Tensor:
    """Pairwise cosine similarities ``[B, K, C] -> [B, K, K]``, clamped to ``[-1, 1]``."""
    yn = y / y.norm(dim=-1, keepdim=True).clamp_min(eps)
    return (yn @ yn.transpose(-2, -1)).clamp(-1.0, 1.0)


def _check(y: Tensor, threshold: float, rule: str) -> None:
    if y.ndim != 3:
        raise ValueError(f"expected cross-attention outputs [B, K, C], got shape {tuple(y.shape)}")
    if y.shape[1] < 1:
        raise ValueError("DQS needs at least one candidate query")
    if rule not in DQS_RULES:
        raise ValueError(f"unknown DQS rule {rule!r}; choose one of {', '.join(DQS_RULES)}")
    check_threshold(threshold)


def check_threshold(threshold: object) -> None:
    """A DQS threshold must be a real number (not NaN); any value is meaningful (see the module)."""
    if not isinstance(threshold, int | float) or threshold != threshold:
        raise ValueError(f"DQS threshold must be a real number, got {threshold!r}")


@torch.no_grad()
def select_queries(y: Tensor, threshold: float, *, rule: DQSRule = "any") -> Tensor:
    """Keep mask ``[B, K]`` (bool) for cross-attention outputs ``y [B, K, C]``.

    ``"any"``: keep ``i`` iff ``max_{j<i} cos(y_i, y_j) <= t``. ``"kept"``: keep ``i``
    iff ``cos(y_i, y_j) <= t`` for every *kept* ``j < i``.
    """
    _check(y, threshold, rule)
    K = y.shape[1]
    # too_close[b, i, j]: j is an earlier query whose output is above the threshold.
    earlier = torch.ones(K, K, dtype=torch.bool, device=y.device).tril(-1)
    too_close = (cosine_similarities(y.float()) > threshold) & earlier
    keep = ~too_close.any(dim=-1)
    if rule == "any":
        return keep
    # The greedy rule is the unique fixed point of keep[i] = not any_j(too_close[i, j] & keep[j]):
    # entry i depends only on entries < i, so after n iterations the first n entries are
    # final, whatever the start. Starting from the "any" answer (a subset of the greedy
    # one) it usually settles in a few batched steps instead of K sequential ones.
    too_close_f = too_close.to(y.dtype if y.is_floating_point() else torch.float32)
    for _ in range(K):
        new = (too_close_f @ keep.to(too_close_f.dtype)[..., None]).squeeze(-1) == 0
        if torch.equal(new, keep):
            break
        keep = new
    return keep


def kept_positions(keep: Tensor) -> tuple[Tensor, Tensor]:
    """Candidate positions with the kept ones first, in order, and the kept counts.

    ``keep [B, K]`` -> ``(positions [B, K] long, counts [B] long)``; row ``b``'s first
    ``counts[b]`` positions are its kept queries in increasing order.
    """
    # A stable sort on "dropped" moves kept entries to the front without reordering them.
    positions = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices
    return positions, keep.sum(dim=1)


def group_by_count(counts: Tensor, *, max_padding: float = 0.0) -> list[tuple[int, Tensor]]:
    """Split a batch by kept count: ``[(count, batch_indices [b_c]), ...]``, counts ascending.

    ``count`` is the group's largest count; see :func:`bucket_counts`.
    """
    return [(largest, idx) for _, largest, idx in bucket_counts(counts, max_padding=max_padding)]


def bucket_counts(counts: Tensor, *, max_padding: float = 0.0) -> list[tuple[int, int, Tensor]]:
    """Group a batch by kept count: ``[(smallest, largest, batch_indices [b]), ...]``, ascending.

    ``max_padding = 0``: one group per distinct count. ``max_padding = p > 0``: consecutive
    counts share a group while its largest count is at most ``(1 + p)`` times its
    smallest; its shorter members are then padded (and masked) up to the largest in
    attention. Fewer, larger groups trade at most a fraction ``p`` of padded attention
    for fewer, larger attention calls (:class:`leanformer.ops.ragged.RaggedBatch`).

    This is a host synchronisation of DQS: the group sizes decide tensor shapes.
    """
    if max_padding < 0:
        raise ValueError(f"max_padding must be >= 0, got {max_padding}")
    order = torch.sort(counts, stable=True)
    values, sizes = torch.unique_consecutive(order.values, return_counts=True)
    buckets: list[list[int]] = []  # [smallest count, largest count, members]
    for value, size in zip(values.tolist(), sizes.tolist(), strict=True):
        if buckets and value <= (1.0 + max_padding) * buckets[-1][0]:
            buckets[-1][1] = value
            buckets[-1][2] += size
        else:
            buckets.append([value, value, size])
    groups = order.indices.split([b[2] for b in buckets])
    return [(b[0], b[1], g) for b, g in zip(buckets, groups, strict=True)]


def reference_select_queries(y: Tensor, threshold: float, *, rule: DQSRule = "any") -> Tensor:
    """Slow, obviously-correct loops over inputs and queries (for tests)."""
    B, K, _ = y.shape
    keep = torch.zeros(B, K, dtype=torch.bool)
    for b in range(B):
        for i in range(K):
            drop = False
            for j in range(i):
                if rule == "kept" and not keep[b, j]:
                    continue
                s = torch.nn.functional.cosine_similarity(y[b, i].double(), y[b, j].double(), dim=0)
                if float(s) > threshold:
                    drop = True
            keep[b, i] = not drop
    return keep


__all__ = [
    "DQS_RULES",
    "DQSRule",
    "bucket_counts",
    "cosine_similarities",
    "group_by_count",
    "kept_positions",
    "reference_select_queries",
    "select_queries",
]
