"""ToMe-style bipartite soft matching (Bolya et al., 2023) as a token-merging plan.

One round splits the tokens alternately into sets A (even positions) and B (odd),
links every A token to its most similar B token (cosine similarity), and merges the
``r`` best-linked A tokens into their B partners. Rounds repeat until ``K`` tokens are
left (one round removes at most ``N // 2``), so any budget can be reached.

``round_fraction`` caps what one round may remove (ToMe: one half). Near the cap a round
must merge almost every A token, however poorly it matches; a smaller cap (``stepmerge``:
a quarter) merges only the best-matching A tokens per round and re-splits the rest for
the next round, where tokens that sat together in B can meet. Each extra round costs one
more ``[N/2, N/2]`` similarity product.

The plan is an assignment ``[B, N] -> [0, K)`` computed without gradient; merged
features are the size-weighted means of their members (ToMe's weighted average), which
:func:`leanformer.ops.cluster_plan.weighted_segment_mean` applies with gradient.
Similarities use the tokens themselves (ToMe uses the attention keys, which a generic
reducer does not see).
"""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import Tensor

from leanformer.ops.cluster_plan import weighted_segment_mean


def _bipartite_round(x: Tensor, r: int) -> Tensor:
    """One matching round on ``x [B, N, C]`` removing ``r <= N // 2`` tokens -> assign ``[B, N]``.

    Output order: the unmerged A tokens (in their original order), then all B tokens.
    """
    B, N, _ = x.shape
    xn = F.normalize(x, dim=-1)
    a, b = xn[:, ::2], xn[:, 1::2]
    na, nb = a.shape[1], b.shape[1]
    best, partner = (a @ b.transpose(1, 2)).max(dim=2)  # [B, Na]
    order = best.argsort(dim=1, descending=True, stable=True)
    src = order[:, :r]  # A tokens merged into B
    unmerged = order[:, r:].sort(dim=1).values
    n_unm = na - r
    slot_a = torch.empty(B, na, dtype=torch.long, device=x.device)
    slot_a.scatter_(1, unmerged, torch.arange(n_unm, device=x.device).expand(B, n_unm))
    slot_a.scatter_(1, src, n_unm + partner.gather(1, src))
    assign = torch.empty(B, N, dtype=torch.long, device=x.device)
    assign[:, ::2] = slot_a
    assign[:, 1::2] = n_unm + torch.arange(nb, device=x.device)
    return assign


def check_round_fraction(round_fraction: float) -> None:
    """The most one round may remove: a fraction in (0, 0.5] (a round cannot remove more than set A)."""
    if not 0.0 < round_fraction <= 0.5:
        raise ValueError(f"round_fraction must be in (0, 0.5], got {round_fraction!r}")


def round_ratio(round_fraction: float | tuple[int, int]) -> tuple[int, int]:
    """``round_fraction`` as ``(numerator, denominator)``, checked: 0.25 -> (1, 4).

    Rounds are sized in integers: a float on a module would be traced by ``torch.compile``
    as a symbolic value once two models sharing the host's code hold different ones, and
    the floor of it restarted the trace (an extra graph); ints on a module stay constants.
    """
    if isinstance(round_fraction, tuple):
        numerator, denominator = round_fraction
        check_round_fraction(numerator / denominator)
        return numerator, denominator
    check_round_fraction(round_fraction)
    exact = Fraction(round_fraction).limit_denominator(1 << 20)
    return exact.numerator, exact.denominator


@torch.no_grad()
def bipartite_merge_plan(
    x: Tensor, k: int, *, sizes: Tensor | None = None, round_fraction: float | tuple[int, int] = 0.5
) -> Tensor:
    """Assignment ``[B, N]`` of every token to one of ``min(k, N)`` merged tokens (``k >= 1``).

    ``sizes [B, N]`` weight the means between rounds (ones when None). ``k >= N`` merges
    nothing: the identity assignment. One round removes at most ``round_fraction`` of the
    tokens it sees (at least one), ``0 < round_fraction <= 0.5``, given as a float or as
    ``(numerator, denominator)`` (:func:`round_ratio`).
    """
    B, N, _ = x.shape
    if k < 1:
        raise ValueError(f"number of merged tokens must be at least 1, got {k}")
    numerator, denominator = round_ratio(round_fraction)
    x = x.detach()
    w = torch.ones(B, N, dtype=x.dtype, device=x.device) if sizes is None else sizes.detach().to(x.dtype)
    assign = torch.arange(N, device=x.device).expand(B, N)
    n = N
    cur, cur_w = x, w
    while n > k:
        # Shapes only (no data): the number of rounds is fixed, so this compiles unrolled.
        r = min(n - k, max(1, n * numerator // denominator))
        step = _bipartite_round(cur, r)
        assign = step.gather(1, assign)
        n -= r
        if n > k:  # the next round matches the merged tokens; after the last, only the plan counts
            cur, cur_w = weighted_segment_mean(cur, cur_w, step, n)
    return assign
