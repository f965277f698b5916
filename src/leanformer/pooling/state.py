"""``model.token_pooling``: the reducers a patch installs, and the budget, changeable at run time.

``model.token_pooling.keep = 0.5`` (or a per-block list, a preset name, ``{"r": 16}``, a
fraction of the GFLOPs ``"0.5x"``, any spelling :func:`leanformer.pooling.budgets.parse_keep`
reads) rebuilds the reducers for the new budget: the value is validated against the host's
depth and token count first (a GFLOPs fraction is solved on the model), so a bad budget
raises and leaves the old one in place. Reading it gives the parsed
:class:`~leanformer.pooling.budgets.KeepSchedule` as asked; :attr:`TokenPooling.schedule`
gives the per-block budgets it was solved into. ``model.token_pooling.r = 8`` is ToMe's
spelling of the same (``keep={"r": 8}``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from leanformer.ops.flop_count import count_gflops
from leanformer.pooling.budgets import KeepSchedule, parse_keep, parse_r
from leanformer.pooling.dropped_fill import fill_from_nearest_position
from leanformer.pooling.gflops import solve_gflops
from leanformer.pooling.reducer import (
    REDUCE_POSITIONS,
    BudgetedReducer,
    Grid,
    ReducePosition,
    TokenReducer,
    compose_assignments,
    count_after,
    entry_count,
    grid_after,
    reduce_tokens,
    sees_prefix,
)
from leanformer.pooling.registry import NothingPlaced, build_reducers, pooling_method

__all__ = ["ReducePosition", "TokenPooling"]

# Images a GFLOPs fraction is solved on, for a method whose cost depends on them. K-Medoids
# iterates until its last image converges, so its cost per image depends on the batch: on
# one image it stopped early where batches of a few rarely did, and the solved budget missed
# them by 3%. Other methods cost the same per image on any image: one.
SOLVE_IMAGES = 4


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
        size_bias: bool = True,
        schedule: KeepSchedule | None = None,
    ) -> None:
        super().__init__()
        yes_or_no("carry", carry)  # "no" would be truthy: sizes tracked after all
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
        # Whether attention adds log(size) to the logits of pooled keys (tome with
        # carry=False tracks sizes for its averages, without ToMe's proportional attention).
        self.size_bias = size_bias
        self._keep = keep
        self._schedule = schedule if schedule is not None else keep
        self._trace_source = False
        self._unpool_output = False
        # The model this pools and one input image's shape, set by the patch: a GFLOPs
        # budget is solved by counting the model's forward. A plain attribute, not a
        # submodule (the model holds this module), so a deep copy maps it to the copy.
        self.__dict__["_owner"] = None
        self.example_shape: tuple[int, int, int] | None = None
        self.reducers = self._as_module_dict(reducers)
        # The sizes live in a dict entry, not an attribute: torch.compile (2.14) loses an
        # attribute stored before a later torch.cond, which the clusterings use compiled
        # (benchmarks/repro_dynamo_cond_attribute.py).
        # "handed": the sizes one block hands to the next, read once.
        # "entry": where the entry step sent each patch, while its record waits for the
        # first block's own (reduce_at="entry" with trace_source).
        self._carried: dict[str, Tensor | None] = {"sizes": None, "handed": None, "entry": None}
        # Tokens (prefix included) the latest forward's last block left, for unpool's check
        # of the tensor it is given: a shape, never a value read back.
        self._counts: dict[str, int | None] = {"left": None}
        # The patch grid of the latest embedded image (rows, cols), recorded where the host
        # embeds it and read by the first block; then the grid one block hands to the
        # next, for reducers that read it (conv). Dict entries, as for the sizes.
        # "first": the grid the latest forward's first block received, where unpooling
        # looks for the patch nearest to a dropped one.
        self._grids: dict[str, Grid | None] = {"embedded": None, "handed": None, "first": None}
        # (module, attribute, what it was before: None when the class's applied)
        self.overrides: list[tuple[nn.Module, str, Any]] = []
        # Follows the model's device, so reducers rebuilt for a new budget land there too.
        self.register_buffer("_device_anchor", torch.empty(0), persistent=False)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Models pickled before the grids were tracked: no grid state, and overrides
        # recorded without what they replaced (nothing but the class's then).
        super().__setstate__(state)
        for name, default in (
            ("size_bias", True),
            ("_trace_source", False),
            ("_unpool_output", False),
            ("_owner", None),
            ("example_shape", None),
            ("_schedule", self.__dict__.get("_keep")),
        ):
            self.__dict__.setdefault(name, default)
        self.__dict__.setdefault("_grids", {"embedded": None, "handed": None})
        self._grids.setdefault("first", None)
        self.__dict__.setdefault("_counts", {"left": None})
        self._carried.setdefault("handed", None)
        self._carried.setdefault("entry", None)
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

    def counts_after_blocks(self, n: int, grid: Grid | None = None) -> list[int]:
        """Patch tokens after each block for ``n`` entering the first, as the reducers keep
        them (``grid``: the patches' raster, when known; conv's windows round odd sides up,
        which a keep ratio does not say)."""
        counts = []
        for i in range(self.depth):
            reducer = self.reducer(i)
            if reducer is not None:
                after = count_after(cast(BudgetedReducer, reducer), n, grid)
                grid, n = grid_after(reducer, grid, n, after), after
            counts.append(n)
        return counts

    def entry_count(self, n: int, grid: Grid | None = None) -> int:
        """Patch tokens the ``entry`` step keeps of ``n`` (:func:`~leanformer.pooling.reducer.entry_count`),
        from what the blocks' reducers keep without it (``grid``: the patches' raster, when known)."""
        counts = self.counts_after_blocks(n, grid)
        return entry_count(n, first=counts[0], last=counts[-1])

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
            self._grids["first"] = grid
            self._carried["handed"] = self._grids["handed"] = self._carried["entry"] = None
            return None, grid
        sizes, self._carried["handed"] = self._carried["handed"], None
        grid, self._grids["handed"] = self._grids["handed"], None
        return sizes, grid

    def enter(
        self, x: Tensor, sizes: Tensor | None, grid: Grid | None
    ) -> tuple[Tensor, Tensor | None, Grid | None]:
        """The ``entry`` step (``reduce_at="entry"``), before the first block's attention:
        the embedded patches ``x [B, N, C]`` reduced once by the first block's reducer to
        :meth:`entry_count` of them, when the budget is tight; as they came otherwise."""
        reducer, patches = self.reducer(0), x.shape[1] - self.num_prefix
        if reducer is None or (count := self.entry_count(patches, grid)) >= patches:
            return x, sizes, grid
        x, sizes, grid = reduce_tokens(reducer, x, sizes, None, self.num_prefix, count=count, grid=grid)
        if getattr(reducer, "record", False):
            self._carried["entry"] = reducer.last_assign  # type: ignore[attr-defined]
        return x, sizes, grid

    def hand_on(self, index: int, sizes: Tensor | None, grid: Grid | None) -> None:
        """What block ``index`` leaves: ``sizes`` (kept as :attr:`sizes` for the final pool)
        and, unless it is the last block, both for the next block."""
        entry, self._carried["entry"] = self._carried["entry"], None
        if entry is not None:
            # The first block's reducer ran twice; its record maps each patch through both.
            reducer: Any = self.reducer(index)
            reducer.last_assign = compose_assignments(entry, reducer.last_assign)
        self.sizes = sizes
        if index + 1 < self.depth:
            self._carried["handed"], self._grids["handed"] = sizes, grid

    def leave(self, x: Tensor, *, reduced: bool = True) -> Tensor:
        """What the last block hands the host: ``x [B, M, C]`` as it is, or with
        :attr:`unpool_output` back on every token position (:meth:`unpool`; sizes all ones
        then, so a final pool counts each position once). ``reduced=False``: the forward ran
        no reducer (an empty batch), so ``x`` is already on every position."""
        self._counts["left"] = x.shape[1]
        if not (self._unpool_output and reduced):
            return x
        self.sizes = None
        return self.unpool(x)

    @property
    def keep(self) -> KeepSchedule | None:
        """The budget asked for (None: installed by hand or ``conv`` by layers)."""
        return self._keep

    @keep.setter
    def keep(self, value: Any) -> None:
        if self.method is None:
            raise ValueError(
                "these reducers were installed by hand (apply_reducers): re-patch to change them"
            )
        if self.method == "conv":
            raise ValueError("conv layers are learned: re-patch to place them for another budget")
        self.set_budget(parse_keep(value))

    @property
    def schedule(self) -> KeepSchedule | None:
        """The per-block budgets the reducers were built for: :attr:`keep`, or what a GFLOPs
        fraction was solved into (ToMe's r for ``tome``, per-block keep ratios otherwise)."""
        return self._schedule

    @property
    def r(self) -> int | list[int] | tuple[int, float] | None:
        """ToMe's ``r`` of the budget (an int, a list per block or ``(r, inflection)``), or
        None for a budget of another form. Setting it is ``keep = {"r": value}``."""
        schedule = self._schedule
        if schedule is None or schedule.remove is None:
            return None
        if isinstance(schedule.remove, tuple):
            return list(schedule.remove)
        return schedule.remove if schedule.inflection == 0.0 else (schedule.remove, schedule.inflection)

    @r.setter
    def r(self, value: Any) -> None:
        self.keep = parse_r(value)

    def set_budget(self, schedule: KeepSchedule) -> None:
        """Rebuild the reducers for ``schedule`` (a GFLOPs fraction is solved first); the
        ``keep`` setter without its refusal of learned layers (a patch places conv's)."""
        assert self.method is not None
        solved = self.solve(schedule) if schedule.gflops is not None else schedule
        self.reducers = self._built(solved)  # raises on a bad budget before anything changes
        self._keep, self._schedule = schedule, solved

    def _built(self, schedule: KeepSchedule) -> nn.ModuleDict:
        reducers = build_reducers(
            method=self.method,  # type: ignore[arg-type]
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
        self._set_recording(fresh)
        return fresh

    def _set_recording(self, reducers: nn.ModuleDict) -> None:
        """Make ``reducers`` record their assignments when :attr:`trace_source` or
        :attr:`unpool_output` asks."""
        for reducer in reducers.values():
            setattr(reducer, "record", self._trace_source or self._unpool_output)  # noqa: B010 (an nn.Module attribute mypy cannot type)

    def attach(self, owner: nn.Module, example_shape: tuple[int, int, int] | None) -> None:
        """Record the model this pools and one input image's ``(channels, rows, cols)``."""
        self.__dict__["_owner"] = owner
        self.example_shape = example_shape

    def solve(self, schedule: KeepSchedule) -> KeepSchedule:
        """The per-block budgets with which this model spends ``schedule.gflops`` of its
        unpooled GFLOPs (:func:`leanformer.pooling.gflops.solve_gflops`), counted on
        ``SOLVE_IMAGES`` seeded random images at the configured size (one, for a method whose
        cost the images do not change). Leaves the reducers as they were."""
        owner, shape = self.__dict__.get("_owner"), self.example_shape
        if owner is None or shape is None:
            raise ValueError(
                f"keep={schedule}: a GFLOPs fraction is solved on the model's forward at its "
                "configured image size, which this model does not say (give per-block budgets)"
            )
        anchor = self.get_buffer("_device_anchor")
        reference = next((p for p in owner.parameters() if p.is_floating_point()), anchor)
        images = SOLVE_IMAGES if self.method and pooling_method(self.method).cost_depends_on_images else 1
        example = torch.randn((images, *shape), generator=torch.Generator().manual_seed(0))
        example = example.to(device=anchor.device, dtype=reference.dtype)
        saved = self.reducers
        try:
            self.reducers = nn.ModuleDict()
            unpooled = count_gflops(owner, (example,))

            def cost(candidate: KeepSchedule) -> float:
                try:
                    self.reducers = self._built(candidate)
                except NothingPlaced:  # no reducer at all: the unpooled model
                    return 1.0
                return count_gflops(owner, (example,)) / unpooled

            solved = solve_gflops(
                schedule, method=self.method or "", depth=self.depth, num_tokens=self.num_tokens, cost=cost
            )
        finally:
            self.reducers = saved
        return solved.schedule

    @property
    def trace_source(self) -> bool:
        """Whether the reducers record where each token went, for :attr:`source` (ToMe's
        ``trace_source``)."""
        return self._trace_source

    @trace_source.setter
    def trace_source(self, value: bool) -> None:
        self._trace_source = yes_or_no("trace_source", value)
        self._set_recording(self.reducers)

    @property
    def unpool_output(self) -> bool:
        """Whether the last block hands on every original token position (``[B, P + N, C]``,
        prefix first, as the unpatched host), each showing the output of the token it went
        into (:meth:`unpool`): ``unpool=True`` of :func:`leanformer.apply_token_pooling`."""
        return self._unpool_output

    @unpool_output.setter
    def unpool_output(self, value: bool) -> None:
        self._unpool_output = yes_or_no("unpool", value)
        self._set_recording(self.reducers)

    @property
    def tokens_left(self) -> int | None:
        """Tokens (prefix included) the latest forward's last block left, before any
        unpooling; None before a forward."""
        return self._counts["left"]

    def assignment(self, *, fill: bool) -> Tensor | None:
        """Where every token of the latest forward's first block (prefix included, in the
        model's order) went: ``[B, P + N]``, the index of the token it ended in after the
        last block. Dropped tokens are -1, or with ``fill`` the output token nearest to them
        on the patch grid (:func:`~leanformer.pooling.dropped_fill.fill_from_nearest_position`;
        -1 still where every patch token was dropped). None when no block reduced."""
        assign: Tensor | None = None
        for i in range(self.depth):
            reducer = self.reducer(i)
            step = None if reducer is None else getattr(reducer, "last_assign", None)
            if step is None:
                continue
            if not sees_prefix(reducer):
                prefix = torch.arange(self.num_prefix, device=step.device).expand(step.shape[0], -1)
                step = torch.cat([prefix, torch.where(step >= 0, step + self.num_prefix, step)], dim=1)
            assign = step if assign is None else compose_assignments(assign, step)
        left = self._counts["left"]
        # Only a selection drops tokens (a static property: nothing read back to the host).
        drops = any(getattr(r, "keeps_input_tokens", False) for r in self.reducers.values())
        if fill and drops and assign is not None and left is not None:
            # The grid recorded from the image, else the host's configured one (used only
            # where it holds the forward's patch count).
            grid = self._grids["first"] or self.grid_size
            assign = fill_from_nearest_position(assign, num_prefix=self.num_prefix, outputs=left, grid=grid)
        return assign

    def unpool(self, x: Tensor) -> Tensor:
        """``x [B, M, C]``, what the latest forward's last block left (prefix first), back on
        every token position the first block received: ``[B, P + N, C]``, each position
        showing the token it went into; a dropped patch shows the token the nearest surviving
        patch went into, and where every patch token was dropped, the first prefix (class)
        token. Identity when no block reduced. Needs :attr:`trace_source` or
        :attr:`unpool_output` on during that forward, and any per-token map of those tokens
        (a final norm, a user's head) may run before or after."""
        if not (self._trace_source or self._unpool_output):
            raise ValueError(
                "unpool needs the assignments of the forward that made these tokens: set "
                "model.token_pooling.trace_source = True (or unpool_output = True) before it"
            )
        left = self._counts["left"]
        if x.dim() != 3 or left is None or x.shape[1] != left:
            raise ValueError(
                f"unpool takes the tokens the latest forward's last block left, [B, {left}, C]; "
                f"got {tuple(x.shape)}"
            )
        assign = self.assignment(fill=True)
        if assign is None:
            return x
        if assign.shape[0] != x.shape[0]:
            raise ValueError(
                f"unpool got a batch of {x.shape[0]}; the latest forward's was {assign.shape[0]}"
            )
        if self.num_prefix == 0 and x.shape[1] == 0:
            raise ValueError("the budget left no token at all, so there is nothing to unpool from")
        # Positions no kept token stands for (a block dropped them all) show the class token.
        # Rows of the flattened batch: index_select copies whole rows, where a gather would
        # read an index for every element.
        B, M, C = x.shape
        rows = assign.clamp(min=0) + torch.arange(B, device=x.device)[:, None] * M
        return x.reshape(B * M, C).index_select(0, rows.flatten()).view(B, -1, C)

    @property
    def source(self) -> Tensor | None:
        """ToMe's source map of the latest forward: ``[B, N', N]``, 1 where output token i
        (prefix tokens included, in the model's order) stands for input token j. Needs
        ``trace_source = True`` before that forward; None when no block reduced."""
        if not self._trace_source:
            raise ValueError(
                "set model.token_pooling.trace_source = True before the forward to trace sources"
            )
        assign = self.assignment(fill=False)
        if assign is None:
            return None
        outputs = int(assign.max()) + 1
        one_hot = torch.nn.functional.one_hot(assign.clamp(min=0), outputs) * (assign >= 0)[..., None]
        return one_hot.transpose(1, 2).float()

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


def yes_or_no(name: str, value: object) -> bool:
    """``value`` if it is a bool; a ValueError naming ``name`` otherwise (a string such as
    "no" would be truthy)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def resolve_gflops_budget(model: nn.Module) -> None:
    """Solve ``model``'s GFLOPs budget (``keep="0.5x"``) again, on the weights it has now.

    A model built with one is solved on its initial weights; K-Medoids stops at its fixed
    point, so its cost can move once trained weights are loaded. Other methods cost the
    same on any weights and are left as solved. Learned layers (``conv``) keep their
    placement: moving them would drop their weights.
    """
    pooling = getattr(model, "token_pooling", None)
    if not isinstance(pooling, TokenPooling) or pooling.method in (None, "conv"):
        return
    if not pooling_method(pooling.method).cost_depends_on_images:
        return
    keep = pooling.keep
    if keep is not None and keep.gflops is not None:
        pooling.set_budget(keep)
