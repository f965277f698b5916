"""``model.token_pooling``: the reducers a patch installs, and the budget, changeable at run time.

``model.token_pooling.keep = 0.5`` (or a per-block list, a preset name, ``{"r": 16}``, any
spelling :func:`leanformer.layers.budgets.parse_keep` reads) rebuilds the reducers for the
new budget: the value is validated against the host's depth and token count first, so a
bad budget raises and leaves the old one in place. Reading it gives the parsed
:class:`~leanformer.layers.budgets.KeepSchedule`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from leanformer.layers.budgets import KeepSchedule, parse_keep
from leanformer.layers.reducer import (
    REDUCE_POSITIONS,
    BudgetedReducer,
    Grid,
    ReducePosition,
    TokenReducer,
    count_after,
    entry_count,
    grid_after,
)
from leanformer.layers.token_pooling import build_reducers

__all__ = ["ReducePosition", "TokenPooling"]


class TokenPooling(nn.Module):
    """One reducer (or none) per host block, registered on the model as ``token_pooling``.

    Being a child of the model, its reducers are trained, saved, moved and switched
    between train and eval mode with the model. ``sizes`` holds the token sizes after the
    last block of the latest forward (``[B, N'] | None``), for a size-weighted final pool.
    """

    def __init__(
        self,
        reducers: Sequence[nn.Module | None],
        *,
        num_prefix: int,
        num_tokens: int,
        dim: int,
        grid_size: tuple[int, int],
        reduce_at: ReducePosition = "attn",
        method: str | None = None,
        keep: KeepSchedule | None = None,
        carry: bool = False,
        options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(carry, bool):  # "no" would be truthy: sizes tracked after all
            raise ValueError(f"carry must be True or False, got {carry!r}")
        if reduce_at not in REDUCE_POSITIONS:
            raise ValueError(f"reduce_at must be one of {', '.join(REDUCE_POSITIONS)}, got {reduce_at!r}")
        self.depth = len(reducers)
        self.num_prefix = num_prefix
        self.num_tokens = num_tokens
        self.dim = dim
        self.grid_size = grid_size
        self.reduce_at: ReducePosition = reduce_at
        self.method = method
        self.carry = carry
        self.options = dict(options or {})
        self._keep = keep
        self.reducers = self._as_module_dict(reducers)
        # The sizes live in a dict entry, not an attribute: torch.compile (2.14) loses an
        # attribute stored before a later torch.cond, which the clusterings use compiled
        # (benchmarks/repro_dynamo_cond_attribute.py).
        # "handed": the sizes one block hands to the next, read once.
        self._carried: dict[str, Tensor | None] = {"sizes": None, "handed": None}
        # The patch grid of the latest embedded image (rows, cols), recorded where the host
        # embeds it and read by the first block; then the grid one block hands to the
        # next, for reducers that read it (conv). Dict entries, as for the sizes.
        self._grids: dict[str, Grid | None] = {"embedded": None, "handed": None}
        # (module, attribute, what it was before: None when the class's applied)
        self.overrides: list[tuple[nn.Module, str, Any]] = []
        # Follows the model's device, so reducers rebuilt for a new budget land there too.
        self.register_buffer("_device_anchor", torch.empty(0), persistent=False)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Models pickled before the grids were tracked: no grid state, and overrides
        # recorded without what they replaced (nothing but the class's then).
        super().__setstate__(state)
        self.__dict__.setdefault("_grids", {"embedded": None, "handed": None})
        self._carried.setdefault("handed", None)
        self.overrides = [o if len(o) == 3 else (o[0], o[1], None) for o in self.overrides]

    @staticmethod
    def _as_module_dict(reducers: Sequence[nn.Module | None]) -> nn.ModuleDict:
        for i, r in enumerate(reducers):
            if r is not None and not isinstance(r, TokenReducer):
                raise TypeError(f"reducer for block {i} ({type(r).__name__}) is not a TokenReducer")
        # ModuleDict keys must be strings; blocks without a reducer have no entry.
        return nn.ModuleDict({str(i): r for i, r in enumerate(reducers) if r is not None})

    def reducer(self, index: int) -> TokenReducer | None:
        key = str(index)
        # Every entry passed the TokenReducer check in _as_module_dict.
        return cast(TokenReducer, self.reducers[key]) if key in self.reducers else None

    def entry_count(self, n: int, grid: Grid | None = None) -> int:
        """Patch tokens the ``entry`` step keeps of ``n`` (:func:`~leanformer.layers.reducer.entry_count`),
        from what the blocks' reducers keep without it (``grid``: the patches' raster, when known)."""
        counts = [n]  # tokens after each block (a block without a reducer keeps them all)
        for i in range(self.depth):
            reducer = self.reducer(i)
            before = counts[-1]
            if reducer is None:
                counts.append(before)
                continue
            after = count_after(cast(BudgetedReducer, reducer), before, grid)
            grid = grid_after(reducer, grid, before, after)
            counts.append(after)
        return entry_count(n, first=counts[1], last=counts[-1])

    @property
    def sizes(self) -> Tensor | None:
        """Token sizes after the last block of the latest forward (``[B, N'] | None``)."""
        return self._carried["sizes"]

    @sizes.setter
    def sizes(self, value: Tensor | None) -> None:
        self._carried["sizes"] = value

    @property
    def embedded_grid(self) -> Grid | None:
        """The patch grid the host embedded last (rows, cols), not yet read by the first block."""
        return self._grids["embedded"]

    @embedded_grid.setter
    def embedded_grid(self, value: Grid | None) -> None:
        self._grids["embedded"] = value

    def receive(self, index: int) -> tuple[Tensor | None, Grid | None]:
        """The sizes and grid block ``index`` starts from. Each is read once, and the last
        block hands none on: a block run later on tokens of its own (no image embedded, or
        after a forward that failed) starts from nothing stale, and conv reads the count."""
        if index == 0:
            grid, self._grids["embedded"] = self._grids["embedded"], None
            self._carried["handed"] = self._grids["handed"] = None
            return None, grid
        sizes, self._carried["handed"] = self._carried["handed"], None
        grid, self._grids["handed"] = self._grids["handed"], None
        return sizes, grid

    def hand_on(self, index: int, sizes: Tensor | None, grid: Grid | None) -> None:
        """What block ``index`` leaves: ``sizes`` (kept as :attr:`sizes` for the final pool)
        and, unless it is the last block, both for the next block."""
        self.sizes = sizes
        if index + 1 < self.depth:
            self._carried["handed"], self._grids["handed"] = sizes, grid

    @property
    def keep(self) -> KeepSchedule | None:
        """The budget the reducers were built for (None: installed by hand or ``conv`` by layers)."""
        return self._keep

    @keep.setter
    def keep(self, value: Any) -> None:
        if self.method is None:
            raise ValueError(
                "these reducers were installed by hand (apply_reducers): re-patch to change them"
            )
        if self.method == "conv":
            raise ValueError("conv layers are learned: re-patch to place them for another budget")
        schedule = parse_keep(value)
        reducers = build_reducers(  # raises on a bad budget before anything changes
            method=self.method,
            keep=schedule,
            depth=self.depth,
            num_tokens=self.num_tokens,
            dim=self.dim,
            grid_size=self.grid_size,
            carry=self.carry,
            **self.options,
        )
        fresh = self._as_module_dict(reducers).to(self.get_buffer("_device_anchor").device)
        fresh.train(self.training)
        self.reducers = fresh
        self._keep = schedule

    @property
    def config(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "keep": self._keep,
            "carry": self.carry,
            "reduce_at": self.reduce_at,
            **self.options,
        }

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())
