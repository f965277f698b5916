"""Compiling a model for inference, with the compile time measured on its own.

``torch.compile(model, fullgraph=True)``: the whole forward must trace into one graph
(no host synchronisation, no data-dependent shapes); anything that cannot raises rather
than falling back to eager code silently. Compilation happens on the first call, so
:func:`compile_for_inference` makes that call itself and reports its duration apart
from the steady-state timings.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn


def compile_model(model: nn.Module) -> nn.Module:
    """``model`` compiled with ``fullgraph=True`` (the result is an ``nn.Module`` sharing its weights)."""
    return torch.compile(model, fullgraph=True)  # type: ignore[return-value]


def compile_for_inference(
    model: nn.Module, inputs: tuple[Any, ...], *, forward_kwargs: dict[str, Any] | None = None
) -> tuple[nn.Module, float]:
    """Compile ``model`` in eval mode for ``inputs``; returns it and the compile seconds (first call)."""
    model.eval()
    compiled = compile_model(model)
    start = time.perf_counter()
    with torch.inference_mode():
        compiled(*inputs, **(forward_kwargs or {}))
    return compiled, time.perf_counter() - start
