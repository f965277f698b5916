"""timm models for leanformer: building them offline, and token pooling on timm ViTs.

The adapter itself is :mod:`leanformer.layers.timm_host`; the entry points here are the
timm-only forms of :mod:`leanformer.patch.api` (which also takes Hugging Face models).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import timm
from timm.models import get_pretrained_cfg_value
from torch import nn

from leanformer.layers.host_adapter import install_reducers
from leanformer.layers.reducer import ReducePosition
from leanformer.layers.timm_host import adapt

# The entry points take any supported host; here for the timm-first imports that use them.
from leanformer.patch.api import apply_token_pooling, is_patched, remove_token_pooling

__all__ = [
    "adapt",
    "apply_reducers",
    "apply_token_pooling",
    "create_timm_model",
    "is_patched",
    "remove_token_pooling",
    "timm_input_size",
]


def create_timm_model(name: str, **kwargs: Any) -> nn.Module:
    """``timm.create_model(name, pretrained=False, **kwargs)`` with clear errors; never downloads.

    An unknown name raises a ValueError with close matches. Pretrained weights are read
    only from a local file (``pretrained=True, pretrained_cfg_overlay={"file": PATH}``):
    a plain ``pretrained=True`` would try the network, which leanformer never uses.
    """
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown timm model {name!r} (timm {timm.__version__}){hint}")
    kwargs.setdefault("pretrained", False)
    overlay = kwargs.get("pretrained_cfg_overlay") or {}
    if kwargs["pretrained"] and "file" not in overlay:
        raise ValueError(
            "pretrained timm weights are read only from a local file: pass "
            "pretrained_cfg_overlay={'file': PATH} (nothing is downloaded)"
        )
    try:
        return timm.create_model(name, **kwargs)
    except TypeError as exc:  # an option this architecture's constructor does not take
        raise ValueError(f"timm model {name!r} does not take the options given: {exc}") from None
    except AssertionError as exc:  # timm asserts on inconsistent options (e.g. heads vs width)
        raise ValueError(f"timm model {name!r} rejects the options given: {exc}") from None


def timm_input_size(name: str) -> int | None:
    """The input side a timm model was designed for (e.g. 224), or None if timm does not say."""
    try:
        size = get_pretrained_cfg_value(name, "input_size")
    except RuntimeError:  # not a timm model name: create_timm_model says so
        return None
    return int(size[-1]) if size else None


def apply_reducers(
    model: nn.Module,
    reducers: Sequence[nn.Module | None],
    *,
    reduce_at: ReducePosition = "attn",
) -> nn.Module:
    """Install one reducer (or None) per block of a timm ViT, in place; returns the model.

    The low-level form of :func:`apply_token_pooling` for reducers built by hand (any
    object following :class:`leanformer.layers.reducer.TokenReducer`); their budget
    cannot be changed through ``model.token_pooling.keep``.
    """
    return install_reducers(adapt(model), reducers, reduce_at=reduce_at)
