"""ToMe's bipartite soft matching (Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023),
as published: one merge step of ``r`` tokens on the whole token sequence of a block.

- the similarity of two tokens is the cosine of their attention keys averaged over heads
  (``metric [B, N, D]``, computed by the block's attention);
- tokens are split alternately over the whole sequence, prefix tokens included: set A is
  positions 0, 2, 4, ..., set B positions 1, 3, 5, ...;
- the class/distillation/register tokens (the first ``num_prefix``) are protected: an A
  prefix token links to nothing (its row of scores is -inf) and no A token links to a B
  prefix token (its column is -inf);
- each A token links to its most similar B token; the ``r`` best-scoring links merge
  (the A token into its B partner), at most ``(N - num_prefix) // 2``;
- the output order is the unmerged A tokens, then the B tokens. With prefix tokens the
  unmerged A tokens keep their original order (ToMe sorts them so the class token stays
  first) and the B prefix tokens move in front of the other A tokens (ToMe's distilled
  layout: class, distillation, the rest of A, the rest of B); without any, the unmerged A
  tokens come in the order of their link scores, best first, as ToMe leaves them.

The plan is an assignment ``[B, N] -> [0, N - r)`` computed without gradient; the merged
tokens are the size-weighted means of their members (ToMe's weighted average), which
:func:`leanformer.ops.cluster_plan.weighted_segment_mean` applies with gradient. Ties
between equal link scores go to the earlier A token (a stable sort; ToMe's own sort is
not stable, so it leaves them to the kernel).
"""

from __future__ import annotations

import torch
from torch import Tensor


def tome_removals(num_tokens: int, num_prefix: int, r: int) -> int:
    """Tokens one matching step removes of ``num_tokens`` (prefix included) when asked for
    ``r``: ToMe caps it at half of the tokens that are not protected."""
    return max(0, min(r, (num_tokens - num_prefix) // 2))


@torch.no_grad()
def tome_merge_plan(metric: Tensor, r: int, num_prefix: int) -> Tensor:
    """Where each token goes: ``metric [B, N, D]`` (keys averaged over heads) -> ``[B, N]``
    indices into the ``N - r`` merged tokens, for ``1 <= r <= (N - num_prefix) // 2``."""
    B, N, _ = metric.shape
    if not 1 <= r <= (N - num_prefix) // 2:
        raise ValueError(f"ToMe merges 1 to {(N - num_prefix) // 2} of these {N} tokens, got r={r}")
    device = metric.device
    unit = metric / metric.norm(dim=-1, keepdim=True)
    a, b = unit[:, ::2], unit[:, 1::2]
    na, nb = a.shape[1], b.shape[1]
    prefix_a, prefix_b = (num_prefix + 1) // 2, num_prefix // 2  # prefix tokens in A and in B
    scores = a @ b.transpose(1, 2)  # [B, Na, Nb]
    protected = (torch.arange(na, device=device) < prefix_a)[:, None] | (
        torch.arange(nb, device=device) < prefix_b
    )[None, :]
    scores = scores.masked_fill(protected, float("-inf"))
    best, partner = scores.max(dim=2)  # [B, Na]
    order = best.argsort(dim=1, descending=True, stable=True)
    merged, unmerged = order[:, :r], order[:, r:]
    if num_prefix > 0:
        unmerged = unmerged.sort(dim=1).values
    kept_a = na - r
    # Output slots: A prefix, B prefix, the other unmerged A tokens, the other B tokens.
    rank = torch.arange(kept_a, device=device)
    slot_of_rank = rank + prefix_b * (rank >= prefix_a)
    d = torch.arange(nb, device=device)
    slot_of_b = torch.where(d < prefix_b, prefix_a + d, kept_a + d)
    slot_a = torch.empty(B, na, dtype=torch.long, device=device)
    slot_a.scatter_(1, unmerged, slot_of_rank.expand(B, kept_a))
    slot_a.scatter_(1, merged, slot_of_b[partner.gather(1, merged)])
    assign = torch.empty(B, N, dtype=torch.long, device=device)
    assign[:, ::2] = slot_a
    assign[:, 1::2] = slot_of_b.expand(B, nb)
    return assign
