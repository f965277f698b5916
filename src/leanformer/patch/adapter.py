"""The host adapter: what a token reduction needs from a third-party vision transformer.

A reduction needs five things from a host, and nothing else:

1. per block, the pre-norm attention half run from the host's own submodules, with
   token sizes (``log(size)`` key bias) and, when asked, the attention each token
   received (:class:`BlockParts`);
2. where the MLP half of the block starts (the reducer sits between the two halves);
3. how many prefix tokens (class, distillation, register) precede the patch tokens;
4. how the final representation is pooled, so an average or an attention pool over
   pooled tokens can weigh each token by its size (``HostAdapter.pool_overrides``);
5. the patch projection, whose output shows the grid of the image at hand, for reducers
   that read the raster (``conv``).

One :class:`HostAdapter` per host family (``leanformer.patch.timm``,
``leanformer.patch.transformers``) answers those; :func:`patch_host` then installs one
reducer per block by overriding each block's ``forward`` on the instance. The blocks,
their classes and the state-dict keys stay the host's own, and
:func:`unpatch_host` puts back what each override replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FunctionType, MethodType
from typing import Any

from torch import Tensor, nn

from leanformer.pooling.budgets import KeepLike, KeepSchedule, parse_keep
from leanformer.pooling.reducer import (
    BEFORE_ATTENTION,
    Grid,
    ScoreKind,
    TokenReducer,
    reads_grid,
    reduce_tokens,
    scores_read,
    takes_a_count,
)
from leanformer.pooling.registry import build_reducers, method_reduce_at, pooling_method
from leanformer.pooling.state import ReducePosition, TokenPooling, yes_or_no

Override = tuple[nn.Module, str, Any]  # set on the instance; what it replaced is put back to undo

# attention(normed x [B, N, C], sizes [B, N] | None, reads: ScoreKind)
#   -> (out [B, N, C], the scores the reducer reads: the attention received [B, N], the keys
#       averaged over heads [B, N, D] (ToMe's similarity), or None when it reads none)
AttentionFn = Callable[[Tensor, Tensor | None, ScoreKind], tuple[Tensor, Tensor | None]]


class UnsupportedHostError(ValueError):
    """The model is not one the adapters know how to patch (the message names the library)."""


@dataclass(frozen=True)
class BlockParts:
    """A pre-norm block ``x + attn_post(attn(norm1(x)))``, then ``x + mlp_post(mlp(norm2(x)))``.

    Every field is the host's own submodule (or a function over them, for the attention).
    """

    norm1: nn.Module
    attention: AttentionFn
    attn_post: tuple[nn.Module, ...]  # e.g. LayerScale then drop-path, in call order
    norm2: nn.Module
    mlp: nn.Module
    mlp_post: tuple[nn.Module, ...]


def nothing_to_pool(head: str, library: str) -> ValueError:
    """The error for a head that pools the patch tokens when the budget left none: its
    mean (or attention) over zero tokens would be NaN."""
    return ValueError(
        f"the budget left no patch token after the last block, and this model's head ({head}) "
        f"pools the patch tokens ({library}): keep at least one, e.g. a count of 1 or more "
        "for the last block"
    )


def _chain(x: Tensor, modules: Sequence[nn.Module]) -> Tensor:
    for m in modules:
        x = m(x)
    return x


def pooled_block_forward(
    parts: BlockParts,
    x: Tensor,
    sizes: Tensor | None,
    reducer: TokenReducer | None,
    num_prefix: int,
    reduce_at: ReducePosition,
    grid: Grid | None = None,
    size_bias: bool = True,
) -> tuple[Tensor, Tensor | None, Grid | None]:
    """The shared step: one host block, from its parts, with its reducer between the
    attention and the MLP (``reduce_at="attn"``), after the MLP (``"mlp"``) or at its
    input (``"input"``). The host's attention runs once and the reducer once.

    ``x [B, N, C]``, ``sizes [B, N] | None`` -> ``(x [B, N', C], sizes [B, N'] | None,
    grid)``; ``grid``: the raster of the patch tokens, for a reducer that reads it (conv),
    and the one the reduction leaves; ``size_bias``: whether the attention adds
    ``log(size)`` to the logits of its keys.
    """
    # At its input no attention has run yet: a reducer there reads no scores (installing
    # one that needs them is refused).
    reads = scores_read(reducer) if reduce_at in ("attn", "mlp") else None
    if reducer is not None and reduce_at == "input":
        x, sizes, grid = reduce_tokens(reducer, x, sizes, None, num_prefix, grid=grid)
    attn_out, scores = parts.attention(parts.norm1(x), sizes if size_bias else None, reads)
    x = x + _chain(attn_out, parts.attn_post)
    # Freed before the MLP, as in the host's own block: its peak is the MLP's hidden layer.
    del attn_out
    if reducer is not None and reduce_at == "attn":
        x, sizes, grid = reduce_tokens(reducer, x, sizes, scores, num_prefix, grid=grid)
    x = x + _chain(parts.mlp(parts.norm2(x)), parts.mlp_post)
    if reducer is not None and reduce_at == "mlp":
        # Scores still come from this block's attention: the token set is unchanged.
        x, sizes, grid = reduce_tokens(reducer, x, sizes, scores, num_prefix, grid=grid)
    return x, sizes, grid


def _no_extra_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    return None


@dataclass
class HostAdapter:
    """What one host model offers a reduction (built by a library's ``adapt`` function).

    ``owner`` is the module that registers ``token_pooling`` (the model the user passed,
    so ``.train()``/``.eval()``/``.to()`` reach the reducers); ``blocks`` are the
    transformer blocks in order; ``parts(block)`` describes one block;
    ``check_call(args, kwargs)`` refuses extra block arguments (masks) the pooled block
    cannot honour; ``pool_overrides`` make the final pooling weigh tokens by size.
    """

    library: str  # "timm 1.0.31", "transformers 5.23.0": named in every error
    owner: nn.Module
    blocks: list[nn.Module]
    parts: Callable[[nn.Module], BlockParts]
    num_prefix: int
    num_tokens: int
    grid_size: tuple[int, int]
    dim: int
    check_call: Callable[[tuple[Any, ...], dict[str, Any]], None] = _no_extra_arguments
    # Size-aware final pooling: (module, attribute, replacement) given the pooling state.
    pool_overrides: Callable[[TokenPooling], list[Override]] = lambda pooling: []
    # The module that embeds the patches as [B, C, rows, cols] (a conv): its output tells
    # the first block the grid of the image at hand, which the count alone does not (an
    # 8x32 image and a 16x16 one both give 16 patches of 4x4). Recorded only for
    # reducers that read the grid (conv), which a host without one refuses unless
    # ``fixed_grid`` (it takes one image size only, so the grid is ``grid_size``).
    patch_projection: nn.Module | None = None
    fixed_grid: bool = False
    # One input image ``(channels, rows, cols)`` at the configured size: GFLOPs budgets
    # (``keep="0.5x"``) are solved by counting a forward on it.
    example_shape: tuple[int, int, int] | None = None

    def error(self, msg: str) -> UnsupportedHostError:
        return UnsupportedHostError(f"token pooling cannot patch this model ({self.library}): {msg}")


class _PooledForward:
    """The ``forward`` a patched block gets: the generic pooled block over the host's parts.

    Sizes and the grid pass from block to block through ``pooling`` (the host's own loop
    over its blocks only hands on the hidden states): :meth:`TokenPooling.receive` and
    :meth:`TokenPooling.hand_on`. The first block starts without sizes, on the grid the
    patch projection recorded.
    """

    def __init__(self, block: nn.Module, index: int, pooling: TokenPooling, adapter: HostAdapter) -> None:
        self.block = block
        self.index = index
        self.pooling = pooling
        self.parts = adapter.parts(block)
        self.check_call = adapter.check_call

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        pooling, index = self.pooling, self.index
        sizes, grid = pooling.receive(index)  # read once, even by a call refused below
        self.check_call(args, kwargs)
        if x.shape[0] == 0 or len(pooling.reducers) == 0:
            # An empty batch has nothing to pool (and a clustering no tokens to seed from),
            # and a budget that keeps every token places no reducer: the host's own block
            # gives exactly the output the unpatched model gives.
            pooling.hand_on(index, None, None)
            x = type(self.block).forward(self.block, x, *args, **kwargs)
            last = index == pooling.depth - 1 and isinstance(x, Tensor)
            return pooling.leave(x, reduced=False) if last else x
        reduce_at = pooling.reduce_at
        if reduce_at == "entry":
            # A step of its own before the first block; then every block reduces after its attention.
            if index == 0:
                x, sizes, grid = pooling.enter(x, sizes, grid)
            reduce_at = "attn"
        x, sizes, grid = pooled_block_forward(
            self.parts,
            x,
            sizes,
            pooling.reducer(index),
            pooling.num_prefix,
            reduce_at,
            grid,
            pooling.size_bias,
        )
        pooling.hand_on(index, sizes, grid)
        return pooling.leave(x) if index == pooling.depth - 1 else x


def single_conv(module: object) -> nn.Module | None:
    """The one ``nn.Conv2d`` in ``module`` (itself, or inside it: a wrapper such as a
    low-rank adapter), or None when there is none or more than one: several convs (a
    hybrid backbone) do not say which one's output is the patch grid."""
    if not isinstance(module, nn.Module):
        return None
    convs = [m for m in module.modules() if isinstance(m, nn.Conv2d)]
    return convs[0] if len(convs) == 1 else None


def _grid_recorder(projection: nn.Module | None) -> _RecordGrid | None:
    """The grid recorder another patched model installed on ``projection``, if any."""
    recorder = None if projection is None else installed(projection.__dict__.get("forward"))
    return recorder if isinstance(recorder, _RecordGrid) else None


class _RecordGrid:
    """The ``forward`` a patch projection gets: the one it had (an instance ``forward``
    another library installed, else its class's), recording the grid it made."""

    def __init__(self, projection: nn.Module, pooling: TokenPooling) -> None:
        self.projection = projection
        self.pooling = pooling
        self.previous = projection.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            out = self.previous(*args, **kwargs)
        else:
            out = type(self.projection).forward(self.projection, *args, **kwargs)
        if isinstance(out, Tensor) and out.dim() == 4:
            self.pooling.embedded_grid = (out.shape[-2], out.shape[-1])
        return out


class _ModelForward:
    """The ``forward`` a patched model gets: the one it had (an instance ``forward`` another
    library installed, else its class's), under a code object of this model's own.

    torch.compile keeps the graphs it compiled per code object and allows
    ``recompile_limit`` (8) of them before it gives up (a hard error with
    ``fullgraph=True``). Every patched model of one host class would share the host's
    ``forward`` code, so the ninth model patched with another method or budget counted as
    a ninth recompile of the first. With a code object per patched model, each model's
    graphs are its own: a budget changed at run time is one recompile of that model.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.previous = model.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    def bound(self) -> MethodType:
        """``__call__`` bound to this object, from a fresh copy of its code. A copied
        function keeps the name ``__call__``, so pickle restores the class's own."""
        call = _ModelForward.__call__
        code = call.__code__.replace(co_name=call.__code__.co_name)
        function = FunctionType(code, call.__globals__, call.__name__, call.__defaults__, call.__closure__)
        function.__qualname__ = call.__qualname__
        # inspect.signature(model.forward) then reads the host's own (Hugging Face models do).
        function.__wrapped__ = type(self.model).forward  # type: ignore[attr-defined]
        return MethodType(function, self)


def _bound(override: object) -> object:
    """``override``'s ``__call__`` as a bound method: torch.compile guards on the identity
    of a callable object in a module's ``__dict__`` (each model's would differ, a recompile
    per model), but on the function of a bound method, which every model shares."""
    if isinstance(override, _ModelForward):
        return override.bound()
    return MethodType(type(override).__call__, override)


def installed(value: object) -> object:
    """The object behind an installed override (the bound method's ``self``)."""
    return value.__self__ if isinstance(value, MethodType) else value


def is_host_patched(adapter: HostAdapter) -> bool:
    return isinstance(getattr(adapter.owner, "token_pooling", None), TokenPooling) or any(
        isinstance(installed(b.__dict__.get("forward")), _PooledForward) for b in adapter.blocks
    )


def check_unpatched(adapter: HostAdapter) -> None:
    if is_host_patched(adapter):
        raise UnsupportedHostError(
            f"token pooling is already applied to this model ({adapter.library}); "
            "call remove_token_pooling(model) before patching it again"
        )


def _check_grid_source(adapter: HostAdapter) -> None:
    """Refuse reducers that read the grid (conv) where no image's grid can be recorded."""
    projection = adapter.patch_projection
    if projection is None and not adapter.fixed_grid:
        raise adapter.error(
            "conv reads the patch grid of each image from the conv that embeds the patches, and "
            "this model takes other image sizes without one to read it from: give it a fixed "
            "image size, or use a method that does not need the grid"
        )
    recorder = _grid_recorder(projection)
    if recorder is not None and any(reads_grid(r) for r in recorder.pooling.reducers.values()):
        # Another patched model's conv reads the grids this projection records: one of the
        # two would read the other's. (A recorder for another model's unpooling alone is
        # wrapped: both record.)
        raise adapter.error(
            "its patch projection already records image grids for another model's conv pooling "
            "(the two share it): give this model its own patch embedding, or remove the other's pooling"
        )


def patch_host(adapter: HostAdapter, pooling: TokenPooling) -> nn.Module:
    """Install ``pooling`` on the host described by ``adapter``; returns the owner model.

    Everything installed is an instance attribute (a block's ``forward``, a pooling
    function) recorded in ``pooling.overrides`` with what it replaced, so removing it
    puts that back, and a deep copy of a patched model carries its own record.
    """
    check_unpatched(adapter)
    reads_grids = any(reads_grid(r) for r in pooling.reducers.values())
    if reads_grids:
        _check_grid_source(adapter)
    owner = adapter.owner
    ref = next((p for p in owner.parameters() if p.is_floating_point()), None)
    if ref is not None:
        # The host's dtype too (a model cast to bfloat16 before patching): conv's weights
        # must match the tokens they downsample.
        pooling.to(device=ref.device, dtype=ref.dtype)
    pooling.train(owner.training)  # modes follow the host from the start
    overrides: list[Override] = [
        (block, "forward", _PooledForward(block, i, pooling, adapter))
        for i, block in enumerate(adapter.blocks)
    ]
    overrides += adapter.pool_overrides(pooling)
    projection = adapter.patch_projection
    if projection is not None and (reads_grids or _grid_recorder(projection) is None):
        # The grid is read by conv's windows, and by unpooling (where a dropped patch's
        # nearest survivor lies; a projection another model records from is left alone,
        # and unpooling takes the host's configured grid).
        overrides.append((projection, "forward", _RecordGrid(projection, pooling)))
    overrides.append((owner, "forward", _ModelForward(owner)))
    pooling.overrides = [(module, name, module.__dict__.get(name)) for module, name, _ in overrides]
    for module, name, value in overrides:
        module.__dict__[name] = _bound(value)
    owner.token_pooling = pooling
    pooling.attach(owner, adapter.example_shape)
    return owner


def unpatch_host(adapter: HostAdapter) -> nn.Module:
    """Undo :func:`patch_host`: what each overridden attribute was applies again (the
    host's class methods, or an instance attribute another library had set)."""
    owner = adapter.owner
    pooling = getattr(owner, "token_pooling", None)
    if not isinstance(pooling, TokenPooling):
        raise ValueError(f"this model has no token pooling to remove ({adapter.library})")
    for module, name, previous in pooling.overrides:
        if previous is None:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = previous
    del owner.token_pooling
    return owner


def install_reducers(
    host: HostAdapter,
    reducers: Sequence[nn.Module | None],
    *,
    reduce_at: ReducePosition = "attn",
    method: str | None = None,
    keep: KeepSchedule | None = None,
    carry: bool = False,
    options: dict[str, Any] | None = None,
    size_bias: bool = True,
) -> nn.Module:
    """Patch ``host`` with one reducer (or None) per block; ``method``/``keep``/``carry``/
    ``options`` record how they were built (``method=None``: by hand, budget fixed)."""
    check_unpatched(host)
    if len(reducers) != len(host.blocks):
        raise ValueError(f"got {len(reducers)} reducers for a model with {len(host.blocks)} blocks")
    # Objects that are no TokenReducer at all are left to TokenPooling's own error.
    uncountable = [i for i, r in enumerate(reducers) if isinstance(r, TokenReducer) and not takes_a_count(r)]
    if reduce_at == "entry" and uncountable:
        raise ValueError(
            "reduce_at='entry' sizes its step before the first block from what every block's "
            "reducer keeps: it needs reducers with output_count(n) and a count= argument "
            f"(the built-in ones), which the reducers of blocks {uncountable} lack; use another "
            "reduce_at for these"
        )
    if reduce_at in BEFORE_ATTENTION and any(getattr(r, "needs_received", False) for r in reducers):
        raise ValueError(
            f"reduce_at={reduce_at!r} places reducers before an attention, where no attention "
            "scores exist yet: methods that need them (weighted clusterings, top-K initial "
            "centres, powerbert, importance) cannot reduce there"
        )
    pooling = TokenPooling(
        reducers,
        num_prefix=host.num_prefix,
        num_tokens=host.num_tokens,
        dim=host.dim,
        grid_size=host.grid_size,
        reduce_at=reduce_at,
        method=method,
        keep=keep,
        carry=carry,
        options=options,
        size_bias=size_bias,
    )
    return patch_host(host, pooling)


def install(
    host: HostAdapter,
    *,
    keep: KeepLike | None,
    method: str,
    carry: bool,
    reduce_at: ReducePosition | None,
    unpool: bool = False,
    **options: Any,
) -> nn.Module:
    """Build ``method``'s reducers for ``host`` under ``keep`` and patch it (``reduce_at``
    None: the method's own place, else between attention and MLP; ``unpool``:
    :attr:`TokenPooling.unpool_output`)."""
    yes_or_no("unpool", unpool)
    reduce_at = method_reduce_at(method, reduce_at)
    spec = pooling_method(method)
    # Parsed here, once: the reducers and model.token_pooling.keep get the same schedule.
    keep = None if keep is None else parse_keep(keep)
    gflops = keep is not None and keep.gflops is not None
    # A GFLOPs fraction is solved on the patched model: it is patched first with a budget
    # that places every reducer the method may use (so the checks below see them).
    first = (
        (KeepSchedule(remove=host.num_tokens // 2) if method == "tome" else KeepSchedule(ratio=0.25))
        if gflops
        else keep
    )
    reducers = build_reducers(
        method=method,
        keep=first,
        depth=len(host.blocks),
        num_tokens=host.num_tokens,
        dim=host.dim,
        grid_size=host.grid_size,
        carry=carry,
        **options,
    )
    model = install_reducers(
        host,
        reducers,
        reduce_at=reduce_at,
        method=method,
        keep=keep,
        carry=carry,
        options=options,
        size_bias=carry or not spec.sizes_always,
    )
    pooling: TokenPooling = model.token_pooling  # type: ignore[assignment]
    if gflops:
        try:
            pooling.set_budget(keep)  # type: ignore[arg-type]
        except ValueError:
            unpatch_host(host)
            raise
    pooling.unpool_output = unpool
    return model
