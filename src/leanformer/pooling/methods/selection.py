"""Selection methods: ``powerbert`` (top-K by significance score, PoWER-BERT), ``random``
and ``importance`` (drawn in proportion to the score). Each block keeps K of its tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from leanformer.ops.token_selection import gather_tokens, importance_indices, random_indices, topk_indices
from leanformer.pooling.budgets import Budget
from leanformer.pooling.reducer import Grid, ReducerBase, SeededDraws
from leanformer.pooling.registry import PoolingMethod, register


class TokenSelection(SeededDraws, ReducerBase):
    """Keep K of the tokens: ``"topk"`` by score (PoWER-BERT), ``"random"``, ``"importance"``.

    Kept tokens stay in their original order and keep their own sizes; sizes that come in
    as None (all ones) go out as None, with or without carry.
    """

    keeps_input_tokens = True

    def __init__(self, *, keep: Budget, mode: str = "topk", carry: bool = False, seed: int = 0) -> None:
        super().__init__(keep=keep, carry=carry)
        if mode not in ("topk", "random", "importance"):
            raise ValueError(f"mode must be 'topk', 'random' or 'importance', got {mode!r}")
        self.mode = mode
        self.seed = seed
        self._generators = {}
        self.needs_received = mode != "random"

    def _reduce(
        self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None, k: int, grid: Grid | None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        B, N, _ = tokens.shape
        if self.mode == "topk":
            assert received is not None
            idx = topk_indices(received, k)
        elif self.mode == "random":
            idx = random_indices(B, N, k, device=tokens.device, **self._randomness(tokens.device))
        else:
            assert received is not None
            idx = importance_indices(received, k, **self._randomness(tokens.device))
        out_sizes = None if sizes is None else sizes.gather(1, idx)
        assign = None
        if self.record:
            assign = torch.full((B, N), -1, dtype=torch.long, device=tokens.device)
            assign.scatter_(1, idx, torch.arange(k, device=tokens.device).expand(B, k))
        return gather_tokens(tokens, idx), out_sizes, assign  # type: ignore[return-value]

    def extra_repr(self) -> str:
        return f"{self.mode}, {super().extra_repr()}"


def _select(mode: str) -> Callable[..., nn.Module]:
    def make(*, keep: Budget, carry: bool, **opts: Any) -> nn.Module:
        return TokenSelection(keep=keep, mode=mode, carry=carry, **opts)

    return make


register(PoolingMethod("powerbert", "top-K by significance score (PoWER-BERT)", _select("topk")))
register(
    PoolingMethod("random", "K tokens uniformly at random, without replacement", _select("random"), ("seed",))
)
register(
    PoolingMethod(
        "importance", "K tokens sampled in proportion to significance", _select("importance"), ("seed",)
    )
)
