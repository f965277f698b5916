"""The tokens a clustering starts from: the initial medoids, or the seeds of K-Means' centres."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from leanformer.ops import cluster_regimes
from leanformer.ops.hashed_noise import uniform_noise

InitMode = Literal["topk", "random"]


def init_centers(
    scores: Tensor | None,
    k: int,
    *,
    num_tokens: int,
    batch: int,
    mode: InitMode = "topk",
    generator: torch.Generator | None = None,
    seed: int | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Indices ``[B, K]`` of the initial centres.

    ``"topk"`` (the paper's default): the K tokens with the highest ``scores [B, N]``
    (significance scores); ties go to the lower index. ``"random"``: K distinct tokens
    uniformly at random from ``generator``, or from counter-based noise when ``seed`` is
    given (appendix B's ablation; see :mod:`leanformer.ops.hashed_noise`).
    """
    if mode == "topk":
        if scores is None:
            raise ValueError("init='topk' needs scores (significance scores or weights)")
        return scores.topk(k, dim=1, sorted=True).indices
    if mode == "random":
        device = device if device is not None else (scores.device if scores is not None else None)
        noise = uniform_noise(batch, num_tokens, generator=generator, seed=seed, device=device)
        return noise.topk(k, dim=1).indices
    raise ValueError(f"unknown init mode {mode!r}; expected 'topk' or 'random'")


def starting_tokens(
    init: Tensor | None, weights: Tensor | None, k: int, num_tokens: int, batch: int, device: torch.device
) -> Tensor:
    """Given ``init [B, K]`` or, by default, the top-K by weight (the first K when unweighted),
    as int64 token indices.

    A given ``init`` must hold K distinct token indices per example. That is checked only
    where reading the verdict back is free (:func:`leanformer.ops.cluster_regimes.reads_back`).
    """
    if init is not None:
        if init.shape != (batch, k):
            raise ValueError(f"init must be [B, K] = {(batch, k)}, got {tuple(init.shape)}")
        if cluster_regimes.reads_back(init):
            low, high = torch.aminmax(init)
            if int(low) < 0 or int(high) >= num_tokens:
                raise ValueError(f"init must hold token indices in [0, N={num_tokens})")
            # K distinct indices mark K tokens; a repeated one marks fewer.
            marked = torch.zeros(batch, num_tokens, dtype=torch.uint8).scatter_(1, init, 1)
            if int(marked.sum()) != batch * k:
                raise ValueError("init must hold K distinct token indices per example")
        # A plan's medoids are int64 whatever integer type init came in (it may return them).
        return init.long()
    if weights is not None:
        return weights.topk(k, dim=1).indices
    return torch.arange(k, device=device).expand(batch, k)
