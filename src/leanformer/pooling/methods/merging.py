"""Merging methods: ``tome`` (ToMe exactly as published, :mod:`leanformer.ops.tome`), and
``merge``, ``stepmerge``, ``inputmerge``, ``entrymerge`` (ToMe-like bipartite soft matching
down to a count or ratio, :mod:`leanformer.ops.merging`). Merged tokens are size-weighted
means of the tokens they stand for.

``tome``: unlike the other reducers, a :class:`ToMeMerging` sees the whole token sequence of
its block, prefix tokens included (ToMe's alternate split counts the class token as the first
A token), and reads the block's attention keys averaged over heads (``needs_keys``). It
sits where ToMe merges, between the block's attention and its MLP, and always tracks token
sizes (ToMe's merges are size-weighted averages); ``carry`` decides only whether later
attention adds ``log(size)`` to the logits (ToMe's proportional attention, on by default in
:func:`leanformer.apply_token_pooling`). Its budget is ToMe's ``r`` (tokens removed by this
block, capped at half of the tokens that are not prefix tokens), or a token count or keep
ratio that removes at most that half.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from leanformer.ops.cluster_plan import weighted_segment_mean
from leanformer.ops.merging import bipartite_merge_plan, round_ratio
from leanformer.ops.tome import tome_merge_plan, tome_removals
from leanformer.pooling.budgets import Budget, budget_to_count, parse_keep
from leanformer.pooling.reducer import Grid, ReducerBase
from leanformer.pooling.registry import PoolingMethod, register


def check_tome_budget(budget: Budget, n: int, block: int) -> None:
    """Refuse a count or ratio that asks one block to remove more than ToMe's matching can
    (half of the ``n`` tokens it receives), naming what it can keep."""
    k = budget_to_count(budget, n)
    if n - k > n // 2:
        raise ValueError(
            f"tome removes at most half of a block's tokens: block {block} receives {n} and cannot "
            f"keep only {k} (keep={budget!r}); keep at least {n - n // 2} there (a ratio of 0.5 or more)"
        )


class ToMeMerging(nn.Module):
    """One block's ToMe step: ``x [B, N, C]`` (prefix tokens first), ``sizes [B, N] | None``,
    ``keys [B, N, D]`` (the block's attention keys averaged over heads) -> the merged
    ``x [B, N', C]`` and ``sizes [B, N']``.

    Give ``remove`` (ToMe's r) or ``keep`` (a count or ratio of the patch tokens).
    ``record = True`` keeps ``last_assign [B, N]``: for every input token, prefix included,
    the output token it went into.
    """

    needs_received = False
    needs_keys = True
    sees_prefix = True
    reads_grid = False
    keeps_input_tokens = False

    def __init__(self, *, remove: int | None = None, keep: Budget | None = None, carry: bool = True) -> None:
        super().__init__()
        if (remove is None) == (keep is None):
            raise ValueError("ToMeMerging takes remove= (ToMe's r) or keep=, exactly one")
        if remove is not None and (isinstance(remove, bool) or not isinstance(remove, int) or remove < 0):
            raise ValueError(f"ToMe's r must be an int >= 0, got {remove!r}")
        self.remove = remove
        self.keep = keep
        self.carry = carry
        self.record = False
        self.last_assign: Tensor | None = None

    @property
    def keep(self) -> Budget | None:
        """A token count or keep ratio of the patch tokens (None: ToMe's ``remove``)."""
        return self._budget

    @keep.setter
    def keep(self, value: Budget | None) -> None:
        self._budget = value
        # torch.compile reads a float attribute that differs between models of one code
        # (two patched models at 0.9 and 0.8) as a symbolic float, and traces every shape
        # that follows from it symbolically, minutes for a tiny model; a string is a
        # constant it guards on, so the ratio is read back from its text (as ReducerBase does).
        self._ratio_text = repr(value) if isinstance(value, float) else None

    def output_count(self, n: int, grid: Grid | None = None) -> int:
        """Patch tokens left of ``n``."""
        if self.remove is not None:
            return n - min(self.remove, n // 2)
        budget = self._budget if self._ratio_text is None else float(self._ratio_text)
        assert budget is not None
        check_tome_budget(budget, n, block=-1)
        return budget_to_count(budget, n)

    def forward(
        self,
        x: Tensor,
        sizes: Tensor | None,
        keys: Tensor | None,
        count: int | None = None,
        grid: Grid | None = None,
        *,
        num_prefix: int,
    ) -> tuple[Tensor, Tensor | None]:
        if keys is None:
            raise ValueError("tome needs the attention keys of its block (keys averaged over heads)")
        B, N, _ = x.shape
        patches = N - num_prefix
        k = self.output_count(patches) if count is None else min(count, patches)
        r = tome_removals(N, num_prefix, patches - k)
        if sizes is None:
            sizes = x.new_ones(B, N)
        if r == 0:
            if self.record:
                self.last_assign = _identity(x)
            return x, sizes
        assign = tome_merge_plan(keys, r, num_prefix)
        merged, merged_sizes = weighted_segment_mean(x, sizes.to(x.dtype), assign, N - r)
        if self.record:
            self.last_assign = assign
        return merged, merged_sizes

    def extra_repr(self) -> str:
        budget = f"r={self.remove}" if self.remove is not None else f"keep={self.keep}"
        return f"{budget}, carry={self.carry}"


def _identity(x: Tensor) -> Tensor:
    return torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)


def build_tome(
    keep: Any,
    *,
    depth: int,
    num_tokens: int,
    carry: bool,
    **_: Any,
) -> list[nn.Module | None]:
    """``tome``'s reducers: one per block that removes tokens. ToMe's form (``r``) gives each
    block its r; counts and ratios are checked against ToMe's cap at half a block's tokens."""
    schedule = parse_keep(keep)
    reducers: list[nn.Module | None] = []
    if schedule.remove is not None:
        n = num_tokens
        for r in schedule.removals(depth):
            reducers.append(ToMeMerging(remove=r, carry=carry) if r > 0 else None)
            n -= min(r, n // 2)
        return reducers
    n = num_tokens
    for block, budget in enumerate(schedule.per_block(depth=depth, num_tokens=num_tokens)):
        check_tome_budget(budget, n, block)
        k = budget_to_count(budget, n)
        binds = k < n if isinstance(budget, int) else budget < 1.0
        reducers.append(ToMeMerging(keep=budget, carry=carry) if binds else None)
        n = k
    return reducers


class TokenMerging(ReducerBase):
    """ToMe-style bipartite soft matching down to K tokens; merged features and sizes
    are size-weighted means and sums. ``round_fraction``: the most one matching round may
    remove (ToMe: 0.5; see :mod:`leanformer.ops.merging`)."""

    needs_received = False

    def __init__(self, *, keep: Budget, carry: bool = False, round_fraction: float = 0.5) -> None:
        super().__init__(keep=keep, carry=carry)
        self.round_fraction = round_fraction
        self.round_ratio = round_ratio(round_fraction)  # what forward reads: ints (see round_ratio)

    def _reduce(
        self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None, k: int, grid: Grid | None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        assign = bipartite_merge_plan(tokens, k, sizes=sizes, round_fraction=self.round_ratio)
        w = sizes if sizes is not None else tokens.new_ones(tokens.shape[:2])
        out, out_sizes = weighted_segment_mean(tokens, w.to(tokens.dtype), assign, k)
        return out, (out_sizes if sizes is not None else None), assign

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, round_fraction={self.round_fraction}"


def _merge(round_fraction: float) -> Callable[..., nn.Module]:
    def make(*, keep: Budget, carry: bool) -> nn.Module:
        return TokenMerging(keep=keep, carry=carry, round_fraction=round_fraction)

    return make


register(
    PoolingMethod(
        "tome",
        "ToMe exactly: bipartite soft matching on the attention keys, r tokens per block",
        None,
        build=build_tome,
        reduce_at="attn",
        sizes_always=True,
    )
)
register(PoolingMethod("merge", "ToMe-like bipartite soft matching on the tokens", _merge(0.5)))
register(
    PoolingMethod("stepmerge", "bipartite merging in rounds of at most a quarter of the tokens", _merge(0.25))
)
register(
    PoolingMethod(
        "inputmerge",
        "ToMe bipartite soft matching at each block's input, before its attention",
        _merge(0.5),
        reduce_at="input",
    )
)
register(
    PoolingMethod(
        "entrymerge",
        "ToMe bipartite soft matching after each attention, and once before the first block "
        "when the budget is tight",
        _merge(0.5),
        reduce_at="entry",
    )
)
