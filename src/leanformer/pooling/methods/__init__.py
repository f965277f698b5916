"""The token-reduction methods, one module per family; each registers its methods in
:mod:`leanformer.pooling.registry` when imported. Imported here in the order
:func:`~leanformer.pooling.registry.list_methods` gives them; ``none`` comes last."""

from __future__ import annotations

from typing import Any

from torch import nn

from leanformer.pooling.budgets import KeepLike
from leanformer.pooling.registry import PoolingMethod, register

# isort: off
# Importing a family registers its methods: the order here is list_methods()'s.
from leanformer.pooling.methods import clustering, selection, merging, conv  # noqa: F401
# isort: on


def _no_reducers(keep: KeepLike | None, *, depth: int, **_: Any) -> list[nn.Module | None]:
    """``none``: every block keeps all of its tokens, whatever the budget says."""
    return [None] * depth


register(PoolingMethod("none", "no reduction", None, build=_no_reducers))
