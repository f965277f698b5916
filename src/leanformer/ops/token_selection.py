"""Score-based token selection: top-K (PoWER-BERT), random, importance sampling.

Each selector returns the indices ``[B, K]`` of the kept tokens in their original
order (sorted), computed without gradient; :func:`gather_tokens` applies them, so the
gradient flows to the kept tokens. Shapes: ``x [B, N, C]``, ``scores [B, N]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from leanformer.ops.hashed_noise import uniform_noise
from leanformer.ops.segment_sum import flat_rows, row_table


def _check_k(k: int, n: int) -> None:
    if not 0 <= k <= n:
        raise ValueError(f"number of kept tokens must be in [0, N={n}], got {k}")


@torch.no_grad()
def topk_indices(scores: Tensor, k: int) -> Tensor:
    """PoWER-BERT: the K tokens with the highest significance ``scores [B, N]`` -> ``[B, K]``."""
    _check_k(k, scores.shape[1])
    return scores.topk(k, dim=1).indices.sort(dim=1).values


@torch.no_grad()
def random_indices(
    batch: int,
    num_tokens: int,
    k: int,
    *,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    device=None,
) -> Tensor:
    """K distinct tokens uniformly at random per example -> ``[B, K]``.

    The draw comes from ``generator``, or from counter-based noise when ``seed`` is given
    (deterministic and compilable, see :mod:`leanformer.ops.hashed_noise`).
    """
    _check_k(k, num_tokens)
    noise = uniform_noise(batch, num_tokens, generator=generator, seed=seed, device=device)
    return noise.topk(k, dim=1).indices.sort(dim=1).values


@torch.no_grad()
def importance_indices(
    scores: Tensor, k: int, *, generator: torch.Generator | None = None, seed: int | None = None
) -> Tensor:
    """Draw K tokens without replacement with probability proportional to ``scores [B, N]``.

    Gumbel-top-K: the K largest ``log p_i + Gumbel_i`` are distributed exactly as K
    successive categorical draws without replacement, batched in one ``topk``. Tokens
    with score 0 (``log 0 = -inf``) come last, so K may exceed the number of positive
    scores without error (unlike ``torch.multinomial``). Scores must be non-negative
    (attention received is); not checked here, as that would sync the device. The noise
    comes from ``generator``, or is counter-based from ``seed`` (as in :func:`random_indices`).
    """
    _check_k(k, scores.shape[1])
    B, N = scores.shape
    u = uniform_noise(B, N, generator=generator, seed=seed, device=scores.device, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
    keys = scores.to(torch.float64).log() + gumbel
    return keys.topk(k, dim=1).indices.sort(dim=1).values


def gather_tokens(x: Tensor, idx: Tensor) -> Tensor:
    """``x [B, N, C]`` at ``idx [B, K]`` -> ``[B, K, C]`` (differentiable in ``x``).

    Copies whole rows (``index_select``), reading a class-token-stripped view in place:
    see :func:`leanformer.ops.segment_sum.row_table`.
    """
    table, step = row_table(x)
    return table.index_select(0, flat_rows(idx, step)).view(*idx.shape, x.shape[2])
