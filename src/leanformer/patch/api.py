"""``apply_token_pooling`` / ``remove_token_pooling`` / ``is_patched`` for any supported host.

The host is recognised from the model's class: a timm ``VisionTransformer``
(:mod:`leanformer.patch.timm`) or a Hugging Face ``transformers`` vision model
(:mod:`leanformer.patch.transformers`). Anything else raises naming both libraries'
installed versions.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from typing import Any

from timm.models.vision_transformer import VisionTransformer
from torch import nn

from leanformer.patch.adapter import (
    HostAdapter,
    UnsupportedHostError,
    install,
    install_reducers,
    unpatch_host,
)
from leanformer.patch.timm import adapt as adapt_timm
from leanformer.pooling.budgets import KeepLike, parse_r
from leanformer.pooling.reducer import ReducePosition
from leanformer.pooling.state import TokenPooling

__all__ = ["adapt", "apply_reducers", "apply_token_pooling", "is_patched", "remove_token_pooling"]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def adapt(model: nn.Module) -> HostAdapter:
    """The host adapter for ``model``, chosen by the library its class comes from."""
    module = type(model).__module__
    if module.startswith("transformers."):
        # Only here: transformers is an optional extra, and a model of its classes means it is installed.
        from leanformer.patch.transformers import adapt as adapt_transformers

        return adapt_transformers(model)
    if isinstance(model, VisionTransformer) or module.startswith("timm."):
        return adapt_timm(model)
    raise UnsupportedHostError(
        f"token pooling cannot patch a {type(model).__name__} (from {module}): supported hosts are "
        f"timm VisionTransformer (timm {_version('timm')}) and Hugging Face ViT, DeiT, Dinov2, "
        f"CLIP and SigLIP vision models (transformers {_version('transformers')})"
    )


def apply_token_pooling(
    model: nn.Module,
    *,
    keep: KeepLike | None = None,
    method: str = "wkmedoids",
    carry: bool = True,
    reduce_at: ReducePosition | None = None,
    r: int | list[int] | tuple[int, float] | None = None,
    unpool: bool = False,
    **options: Any,
) -> nn.Module:
    """Insert a token reduction into a timm or Hugging Face vision transformer, in place.

    ``keep``: per-block budgets (an int is a token count, a float a keep ratio in (0, 1]),
    one keep ratio for every block (a float: ``1.0`` keeps all, a bare int is refused), a
    named schedule (e.g. ``"deit_s_level3"``), ToMe's ``{"r": 16}`` (remove 16 tokens per
    block), a fraction of the unpooled model's GFLOPs (``"0.5x"``, solved for the method
    on this model) or a :class:`leanformer.pooling.budgets.KeepSchedule`: anything
    :func:`leanformer.pooling.budgets.parse_keep` reads; change it later with
    ``model.token_pooling.keep = ...``. ``r``: ToMe's spelling instead of ``keep`` (an
    int, one per block, or ToMe's ``(r, inflection)`` schedule), as in
    ``apply_token_pooling(model, method="tome", r=16)``. ``method``: any name of
    :func:`leanformer.pooling.registry.list_methods`. ``carry``: track token sizes
    and weigh keys (and an average or attention pool) by them. ``reduce_at``: where each
    block reduces, ``"attn"`` (between attention and MLP, the default), ``"mlp"`` (after
    the MLP), ``"input"`` (before the attention) or ``"entry"`` (as ``"attn"``, with one
    more step before the first attention when the budget is tight, sized by
    :func:`leanformer.pooling.reducer.entry_count`); ``inputmerge`` always
    reduces at ``"input"`` and ``entrymerge`` at ``"entry"``. Prefix tokens (class,
    distillation, registers) are never pooled. ``unpool``: the last block hands the host
    every token position again (``forward_features`` / ``last_hidden_state`` of shape
    ``[B, P + N, C]`` as unpatched), each showing the output of the token it was merged or
    clustered into, for dense heads (:meth:`TokenPooling.unpool`); switch it at run time
    with ``model.token_pooling.unpool_output``. Returns the model.
    """
    if r is not None:
        if keep is not None:
            raise ValueError("give keep= or ToMe's r=, not both")
        keep = parse_r(r)
    return install(
        adapt(model), keep=keep, method=method, carry=carry, reduce_at=reduce_at, unpool=unpool, **options
    )


def apply_reducers(
    model: nn.Module,
    reducers: Sequence[nn.Module | None],
    *,
    reduce_at: ReducePosition = "attn",
) -> nn.Module:
    """Install one reducer (or None) per block of a supported host, in place; returns the model.

    The low-level form of :func:`apply_token_pooling` for reducers built by hand (any
    object following :class:`leanformer.pooling.reducer.TokenReducer`); their budget
    cannot be changed through ``model.token_pooling.keep``.
    """
    return install_reducers(adapt(model), reducers, reduce_at=reduce_at)


def remove_token_pooling(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_token_pooling`: the host computes exactly what it did before."""
    return unpatch_host(adapt(model))


def is_patched(model: nn.Module) -> bool:
    return isinstance(getattr(model, "token_pooling", None), TokenPooling)
