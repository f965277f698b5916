"""The method registry: every token-reduction method by name, and how its reducers are built.

Each module of :mod:`leanformer.pooling.methods` registers its family here with
:func:`register` when the package is imported; :func:`build_reducers` then builds one
reducer (or None) per block of a host for a method and a budget. Methods (``method=`` of
:func:`build_reducers` and :func:`leanformer.apply_token_pooling`, ``pool=`` of the DeiT
models), in the order :func:`list_methods` gives them:

==============  ===========================================================================
``kmeans``      K-Means, output = cluster means (paper eqs. 10-11)
``kmedoids``    K-Medoids on distances computed once, output = cluster means (eq. 12)
``wkmeans``     weighted K-Means, weights = significance scores (eqs. 14-15)
``wkmedoids``   weighted K-Medoids (eqs. 16-18), the paper's best method
``powerbert``   keep the top-K tokens by significance score (PoWER-BERT)
``random``      keep K tokens drawn uniformly without replacement
``importance``  draw K tokens without replacement, probability proportional to the score
``tome``        ToMe exactly as published: bipartite soft matching on the attention keys,
                class/prefix tokens protected, ``r`` per block
``merge``       ToMe-like bipartite soft matching on the block's output tokens, down to a
                count or ratio (size-weighted merges)
``stepmerge``   bipartite merging in rounds of at most a quarter of the tokens
``inputmerge``  ``merge`` at each block's input, before its attention (the first block's too)
``entrymerge``  ``merge``, and one more merge of the embedded patches before the first block
                when the budget is tight (:func:`leanformer.pooling.reducer.entry_count`)
``conv``        learned 2x2 stride-2 convolution on the token grid (appendix D)
``none``        no reduction
==============  ===========================================================================
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from leanformer.pooling.budgets import KeepLike, budget_to_count, parse_keep
from leanformer.pooling.reducer import REDUCE_POSITION_WORDS, ReducePosition


class NothingPlaced(ValueError):
    """A budget that asks for fewer tokens, with which a method would place no reducer at all
    (conv, where no block keeps half of its tokens or fewer): the model would stay unpooled."""


@dataclass(frozen=True)
class PoolingMethod:
    """A registry entry: how to build the reducers of a method for a budget.

    Most methods reduce each block on its own budget: ``make(keep=budget, carry=..., **opts)``
    builds one block's reducer, and blocks whose budget cannot bind get none. A method that
    decides its placement over the whole host (``conv``, ``none``) gives ``build`` instead,
    called as ``build(keep, depth=, num_tokens=, dim=, grid_size=, carry=, **opts)``.
    """

    name: str
    description: str
    make: Callable[..., nn.Module] | None
    options: tuple[str, ...] = ()
    build: Callable[..., list[nn.Module | None]] | None = None
    # Where the method's reducers sit when the method decides it (None: the caller's
    # ``reduce_at``, by default between attention and MLP).
    reduce_at: ReducePosition | None = None
    # Whether the method tracks token sizes whatever ``carry`` says (ToMe's merges are
    # size-weighted averages); ``carry`` then only decides the attention's log(size) bias.
    sizes_always: bool = False
    # Whether the method's counted cost depends on the images, not only on the token counts
    # (K-Medoids' C++ iterations stop at their fixed point; a FLOP counter sees every K-Means
    # iteration): a GFLOPs budget is then solved on several images rather than one.
    cost_depends_on_images: bool = False

    def __post_init__(self) -> None:
        if (self.make is None) == (self.build is None):
            raise ValueError(f"pooling method {self.name!r}: give exactly one of make and build")


# Filled by the modules of leanformer.pooling.methods as the package is imported.
METHODS: dict[str, PoolingMethod] = {}


def register(method: PoolingMethod) -> PoolingMethod:
    """Add ``method`` to the registry (a name taken twice raises: one implementation per name)."""
    if method.name in METHODS:
        raise ValueError(f"pooling method {method.name!r} is registered twice")
    METHODS[method.name] = method
    return method


def list_methods() -> list[str]:
    """Names accepted by ``method=`` / ``pool=``."""
    return list(METHODS)


def pooling_method(name: str) -> PoolingMethod:
    """The method registered as ``name`` (a ``ValueError`` naming close matches if none is)."""
    if name not in METHODS:
        close = difflib.get_close_matches(str(name), METHODS, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(f"unknown pooling method {name!r}; {hint}choose from: {', '.join(METHODS)}")
    return METHODS[name]


def method_reduce_at(method: str, reduce_at: ReducePosition | None) -> ReducePosition:
    """Where ``method``'s reducers sit: its own place if it has one, else ``reduce_at``
    (``None``: between attention and MLP). A place the method cannot use raises."""
    spec = pooling_method(method)
    if spec.reduce_at is None:
        return "attn" if reduce_at is None else reduce_at
    if reduce_at is not None and reduce_at != spec.reduce_at:
        raise ValueError(
            f"pooling method {method!r} reduces {REDUCE_POSITION_WORDS[spec.reduce_at]}; "
            f"reduce_at={reduce_at!r} does not apply to it (leave reduce_at unset)"
        )
    return spec.reduce_at


def build_reducers(
    *,
    method: str,
    keep: KeepLike | None,
    depth: int,
    num_tokens: int,
    dim: int,
    grid_size: tuple[int, int],
    carry: bool = False,
    **options: Any,
) -> list[nn.Module | None]:
    """One reducer (or None) per block for ``method`` under budget ``keep``.

    ``num_tokens`` is the number of patch tokens at the configured input size; a block
    whose count budget cannot bind there (``K_l >= tokens it receives``) gets no reducer,
    so it keeps the fused attention kernel. Count budgets are therefore tied to the
    configured resolution; use a ratio to scale with the input.

    ``conv`` places a conv layer at the blocks in ``layers=[...]`` (0-based), or else at
    each block where ``keep`` asks to drop at least half of the tokens it receives; it
    needs ``grid_size`` (the patch grid).

    Options: ``max_iters`` (default 5), ``init`` ("topk" | "random"), ``seed`` for the
    clustering methods; ``seed`` for ``random``/``importance``; ``layers`` for ``conv``.
    Unknown options raise ``ValueError``.
    """
    spec = pooling_method(method)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        valid = ", ".join(spec.options) if spec.options else "none"
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for pooling method {method!r} (valid: {valid})"
        )
    if "seed" in options and not _is_int(options["seed"]):
        raise ValueError(f"pooling option seed must be an integer, got {options['seed']!r}")
    if spec.build is not None:
        return spec.build(
            keep, depth=depth, num_tokens=num_tokens, dim=dim, grid_size=grid_size, carry=carry, **options
        )
    assert spec.make is not None
    budgets = parse_keep(keep).per_block(depth=depth, num_tokens=num_tokens)
    reducers: list[nn.Module | None] = []
    n = num_tokens
    for budget in budgets:
        k = budget_to_count(budget, n)
        binds = k < n if isinstance(budget, int) else budget < 1.0
        reducers.append(spec.make(keep=budget, carry=carry, **options) if binds else None)
        n = k
    return reducers


def _is_int(value: object) -> bool:
    """Whether ``value`` is an integer of any kind (numpy, 0-dim tensor), bools excluded."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True
