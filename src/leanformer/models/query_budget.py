"""Models with a query budget: a forward that can use only the first ``K`` latent queries.

The Visual Perceiver is one: ``model(x, num_queries=K)`` runs its cross-attention with the
first ``K`` of its ``num_queries`` queries (what Query Masking trains). Code that needs
such a model (Query Masking, ``--num-queries``, the Perceiver tables and attention maps)
asks :func:`query_budget` instead of testing attributes itself, and checks a requested
``K`` with :func:`check_query_count`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["QueryBudgetModel", "check_query_count", "has_query_budget", "query_budget"]


@runtime_checkable
class QueryBudgetModel(Protocol):
    """A model with ``num_queries`` latent queries whose forward takes ``num_queries=K``."""

    num_queries: int

    def __call__(self, x: Tensor, num_queries: int | None = None, *args: Any, **kwargs: Any) -> Tensor: ...


def has_query_budget(model: object) -> bool:
    """Whether ``model`` takes ``num_queries=K``: it is callable and has an int ``num_queries``."""
    return isinstance(model, QueryBudgetModel) and type(model.num_queries) is int


def query_budget(model: object, *, needed_by: str = "this") -> int:
    """The number of latent queries ``Q`` of ``model``; a ``ValueError`` if it has none."""
    if not has_query_budget(model):
        name = getattr(model, "leanformer_name", type(model).__name__)
        raise ValueError(
            f"{needed_by} needs a Visual Perceiver (a model with latent queries); {name} has none"
        )
    return model.num_queries  # type: ignore[attr-defined]


def check_query_count(k: Any, total: int, *, name: str = "num_queries") -> int:
    """``k`` if it is an int in ``[1, total]``; a ``ValueError`` naming ``name`` otherwise."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= total:
        raise ValueError(f"{name} must be an integer in [1, {total}], got {k!r}")
    return k
