"""The interface between a transformer block and a token reducer.

A reducer sees only the tokens it may touch: the block splits off the prefix
(class, distillation and register tokens), calls the reducer on the rest, and puts
the prefix back in front. Shapes: ``tokens [B, N, C]``, ``sizes [B, N]`` (or None:
every token has size 1, because sizes are not tracked or no reduction has changed
them yet), ``received [B, N]`` (attention received, or None when the reducer does not
ask for it).

Carry (Token Pooling, appendix E): with ``carry=True`` (or whenever sizes come in) every
output token has a size, the sum of the sizes of the input tokens it stands for (selected
tokens keep their own size); attention in later blocks adds ``log(size)`` to that key's
logits. Sizes of None stand for all ones: a selection keeps them None (every kept token
still has size 1), so later blocks skip a bias that would add 0 to every logit.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal, Protocol, cast, runtime_checkable

import torch
from torch import Tensor, nn

from leanformer.pooling.budgets import Budget, budget_to_count

# Where a block's reducer sits: between its attention and its MLP (PoWER-BERT, Token
# Pooling: the MLP already runs on fewer tokens), after its MLP, or at its input, before
# its attention (``inputmerge``: the first block's attention already runs on fewer
# tokens; the block's own attention scores do not exist yet there). ``entry`` is
# between attention and MLP with one more step at the first block's input, when the
# budget is tight (``entrymerge``: the patch embeddings are merged once before any
# attention; see :func:`entry_count`).
ReducePosition = Literal["attn", "mlp", "input", "entry"]
# The ``rows x cols`` raster of patch tokens (row-major), for reducers that read it (conv).
Grid = tuple[int, int]
# The tokens came from a grid, but a reduction that does not keep rasters (a clustering,
# a selection, a merge) left them off it.
OFF_GRID: Grid = (0, 0)
REDUCE_POSITIONS: tuple[ReducePosition, ...] = ("attn", "mlp", "input", "entry")
# Positions where a reducer runs before an attention, so no attention scores exist yet.
BEFORE_ATTENTION: tuple[ReducePosition, ...] = ("input", "entry")
# Which attention scores a reducer reads from its block: none, the attention each token
# received (significance scores, [B, N]), or the attention keys averaged over heads
# ([B, N, D], ToMe's similarity).
ScoreKind = Literal["received", "keys"] | None
# Each position in words, for error messages.
REDUCE_POSITION_WORDS: dict[ReducePosition, str] = {
    "attn": "between each block's attention and MLP",
    "mlp": "after each block's MLP",
    "input": "at each block's input",
    "entry": "after each block's attention and, when the budget is tight, once before the first block",
}


@runtime_checkable
class TokenReducer(Protocol):
    """Anything that maps ``(tokens, sizes, received) -> (tokens', sizes')``."""

    needs_received: bool

    def __call__(
        self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None
    ) -> tuple[Tensor, Tensor | None]: ...


@runtime_checkable
class BudgetedReducer(TokenReducer, Protocol):
    """A reducer whose output count is known ahead (``output_count(n)``) and can be set
    per call (``count=``): what the ``entry`` step needs. Every built-in reducer is one."""

    def output_count(self, n: int) -> int: ...

    def __call__(
        self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None, count: int | None = None
    ) -> tuple[Tensor, Tensor | None]: ...


def takes_a_count(reducer: object) -> bool:
    """Whether ``reducer`` is a :class:`BudgetedReducer` whose call accepts ``count=``.
    ``isinstance`` against a runtime Protocol checks only that the attributes exist, so
    a reducer with ``output_count`` but a three-argument forward would pass it and fail
    at the first tight budget."""
    if not isinstance(reducer, BudgetedReducer):
        return False
    # An nn.Module's __call__ takes (*args, **kwargs); its forward has the real signature.
    call = getattr(reducer, "forward", reducer)
    try:
        parameters = inspect.signature(call).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): the call will tell
        return True
    return any(p.name == "count" or p.kind is p.VAR_KEYWORD for p in parameters)


# The entry step merges the embedded patches before any attention has mixed them. On the
# shipped Fashion-MNIST DeiT that pays where the blocks' budgets leave few tokens and
# costs a little where they leave many (0.25 points at 0.7x of the GFLOPs), so it runs
# in full when the blocks alone would leave at most ENTRY_FULL_AT of the patch tokens
# after the last block, not at all from ENTRY_NONE_AT, and fades in between. Both were
# chosen on the validation split (docs/BENCHMARKS.md, "entrymerge").
ENTRY_FULL_AT = 0.38
ENTRY_NONE_AT = 0.46


def entry_count(n: int, first: int, last: int) -> int:
    """Patch tokens the entry step keeps of ``n``, when the blocks' own budgets (without
    the entry step) keep ``first`` after the first block and ``last`` after the last.

    ``first`` (the first block's budget, applied once more before it) where ``last / n
    <= ENTRY_FULL_AT``; ``n`` (no entry step) where it is ``>= ENTRY_NONE_AT``; in
    between, linearly from one to the other.
    """
    left = last / n if n > 0 else 1.0
    if left <= ENTRY_FULL_AT:
        return first
    if left >= ENTRY_NONE_AT:
        return n
    fade = (left - ENTRY_FULL_AT) / (ENTRY_NONE_AT - ENTRY_FULL_AT)
    return min(n, int(first + fade * (n - first) + 0.5))


def halved_grid(h: int, w: int) -> Grid:
    """The grid a 2x2 stride-2 window leaves of ``h x w`` (odd sides padded, so rounded up)."""
    return -(-h // 2), -(-w // 2)


def scores_read(reducer: object) -> ScoreKind:
    """The attention scores ``reducer`` reads (:data:`ScoreKind`): its ``needs_keys`` or
    ``needs_received``, read here once for the block that computes them."""
    if getattr(reducer, "needs_keys", False):
        return "keys"
    return "received" if getattr(reducer, "needs_received", False) else None


def reads_grid(reducer: object) -> bool:
    """Whether ``reducer`` takes the patch tokens' grid (``grid=``): conv's 2x2 windows
    need the real raster, which the count alone does not tell (2x8 and 4x4 are both 16)."""
    return bool(getattr(reducer, "reads_grid", False))


def sees_prefix(reducer: object) -> bool:
    """Whether ``reducer`` takes the whole token sequence, prefix tokens included
    (``num_prefix=``): ToMe's alternate split counts the class token as a token of set A."""
    return bool(getattr(reducer, "sees_prefix", False))


def count_after(reducer: BudgetedReducer, n: int, grid: Grid | None) -> int:
    """Tokens ``reducer`` keeps of ``n`` on ``grid`` (a grid reader's count depends on the raster)."""
    if grid is not None and reads_grid(reducer):
        return cast(Any, reducer).output_count(n, grid)
    return reducer.output_count(n)


def grid_after(reducer: object, grid: Grid | None, before: int, after: int) -> Grid | None:
    """The raster of the tokens ``reducer`` left (``before`` -> ``after`` patch tokens): a
    grid reader's 2x2 windows halve it, any other reduction leaves the tokens
    :data:`OFF_GRID`, and a reducer that kept every token leaves it as it was (None, not
    known, stays None)."""
    if after == before or grid is None:
        return grid
    if reads_grid(reducer) and grid != OFF_GRID:
        return halved_grid(*grid)
    return OFF_GRID


def reduce_tokens(
    reducer: TokenReducer,
    x: Tensor,
    sizes: Tensor | None,
    received: Tensor | None,
    num_prefix: int,
    count: int | None = None,
    grid: Grid | None = None,
) -> tuple[Tensor, Tensor | None, Grid | None]:
    """Apply ``reducer`` to ``x[:, num_prefix:]`` and keep the prefix tokens untouched;
    returns the tokens, their sizes and the grid they are left on (:func:`grid_after`).
    ``count``: the tokens it keeps in place of its own budget (a :class:`BudgetedReducer`).
    ``grid``: the patch tokens' raster, passed on to a reducer that reads it (:func:`reads_grid`).
    A reducer that :func:`sees_prefix` (ToMe's) gets the whole sequence and ``num_prefix=``,
    and keeps the prefix tokens in front itself."""
    before = x.shape[1]
    x, sizes = _reduce_patches(reducer, x, sizes, received, num_prefix, count, grid)
    return x, sizes, grid_after(reducer, grid, before, x.shape[1])


def _reduce_patches(
    reducer: TokenReducer,
    x: Tensor,
    sizes: Tensor | None,
    received: Tensor | None,
    num_prefix: int,
    count: int | None,
    grid: Grid | None,
) -> tuple[Tensor, Tensor | None]:
    if sees_prefix(reducer):
        return cast(Any, reducer)(x, sizes, received, count, grid, num_prefix=num_prefix)
    prefix, tokens = x[:, :num_prefix], x[:, num_prefix:]
    tok_sizes = None if sizes is None else sizes[:, num_prefix:]
    tok_received = None if received is None else received[:, num_prefix:]
    extra: dict[str, Any] = {}
    if count is not None:
        extra["count"] = count
    if grid is not None and reads_grid(reducer):
        extra["grid"] = grid
    if extra:
        tokens, tok_sizes = cast(BudgetedReducer, reducer)(tokens, tok_sizes, tok_received, **extra)
    else:
        tokens, tok_sizes = reducer(tokens, tok_sizes, tok_received)
    x = torch.cat([prefix, tokens], dim=1)
    if tok_sizes is None:
        return x, None
    prefix_sizes = (
        torch.ones(x.shape[0], num_prefix, dtype=tok_sizes.dtype, device=x.device)
        if sizes is None
        else sizes[:, :num_prefix]
    )
    return x, torch.cat([prefix_sizes, tok_sizes], dim=1)


def compose_assignments(first: Tensor, second: Tensor) -> Tensor:
    """Where each token went through two reductions in a row: ``first [B, N0]`` maps into the
    ``N1`` tokens that ``second [B, N1]`` maps on; -1 (dropped) in either stays -1."""
    if second.shape[1] == 0:  # the first step kept nothing: every token was dropped
        return torch.full_like(first, -1)
    through = second.gather(1, first.clamp(min=0))
    return through.masked_fill(first < 0, -1)


class ReducerBase(nn.Module):
    """What the built-in reducers share: budget, carry, recording. Subclasses implement :meth:`_reduce`.

    ``record = True`` keeps ``last_assign [B, N]``: for every input token, the output
    token it went into (-1 when dropped), for visualisation and unpooling.
    """

    needs_received: bool = False
    # Whether the reducer reads the patch tokens' grid (``grid=``, when the host knows it).
    reads_grid: bool = False
    # Whether every output token is one input token (a selection): all-ones sizes in, all
    # ones out, so implicit sizes (None) can stay implicit.
    keeps_input_tokens: bool = False

    def __init__(self, *, keep: Budget, carry: bool = False) -> None:
        super().__init__()
        self.keep = keep
        self.carry = carry
        self.record = False
        self.last_assign: Tensor | None = None

    @property
    def keep(self) -> Budget:
        """This block's budget: a token count (int) or a keep ratio (float)."""
        return self._budget

    @keep.setter
    def keep(self, value: Budget) -> None:
        self._budget = value
        # torch.compile(dynamic=True) reads a float attribute as a symbolic float, and a
        # count derived from one cannot enter the clusterings' torch.cond loops; a string
        # is a constant it guards on, so the ratio is read back from its text.
        self._ratio_text = repr(value) if isinstance(value, float) else None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Reducers pickled when the budget was a plain attribute.
        budget = state.pop("keep", None)
        super().__setstate__(state)
        if budget is not None:
            self.keep = budget

    def forward(
        self,
        tokens: Tensor,
        sizes: Tensor | None,
        received: Tensor | None,
        count: int | None = None,
        grid: Grid | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``count``: tokens to keep in place of the budget's (the ``entry`` step's own).
        ``grid``: the ``rows x cols`` raster the tokens lie on, when the host knows it."""
        B, N, _ = tokens.shape
        track = self.carry or sizes is not None
        if track and sizes is None and not self.keeps_input_tokens:
            sizes = tokens.new_ones(B, N)
        if self.needs_received and received is None:
            raise ValueError(f"{type(self).__name__} needs the attention received (significance scores)")
        k = self.output_count(N, grid) if count is None else min(count, N)
        if k >= N:
            if self.record:
                self.last_assign = torch.arange(N, device=tokens.device).expand(B, N)
            return tokens, sizes
        if k == 0:
            # Budget 0: only the prefix (class) tokens remain.
            if self.record:
                self.last_assign = torch.full((B, N), -1, dtype=torch.long, device=tokens.device)
            return tokens[:, :0], (sizes[:, :0] if sizes is not None else None)
        out, out_sizes, assign = self._reduce(tokens, sizes, received, k, grid)
        if self.record:
            self.last_assign = assign
        return out, (out_sizes if track else None)

    def output_count(self, n: int, grid: Grid | None = None) -> int:
        """Tokens this reducer outputs when it receives ``n`` (on ``grid``, when known):
        ``min(K, n)`` (or the ratio of ``n``)."""
        ratio_text = self._ratio_text
        return budget_to_count(self.keep if ratio_text is None else float(ratio_text), n)

    def _reduce(
        self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None, k: int, grid: Grid | None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"keep={self.keep}, carry={self.carry}"


class SeededDraws:
    """Seeded randomness: a persistent stream while training, the same draw on every call in eval.

    Eval draws counter-based noise from the seed (:mod:`leanformer.ops.hashed_noise`), so
    inference is deterministic (the same input always gives the same output) and compiles
    (no generator is created in the forward); training advances one generator per device.
    """

    seed: int
    training: bool
    _generators: dict[str, torch.Generator]

    def _randomness(self, device: torch.device) -> dict[str, Any]:
        """Keyword arguments for the ops' draws: ``seed=`` in eval, ``generator=`` in training."""
        if not self.training:
            return {"seed": self.seed}
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return {"generator": self._generators[key]}
