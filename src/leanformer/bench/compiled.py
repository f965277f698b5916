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

# Dynamo keeps at most ``recompile_limit`` (default 8) compiled versions of each Python
# function, and with ``fullgraph=True`` the next one is a hard error. Every model compiled
# in a process adds versions of the forwards it shares with the models compiled before
# it (another method, budget or input shape is another graph), so a sweep of compiled
# models failed at about its ninth. Each compiled model raises the limits by the versions
# one model may need: a full batch, a last partial batch and spare.
_VERSIONS_PER_MODEL = 8
_models_compiled = 0


def _make_room_for_one_more_model() -> None:
    global _models_compiled
    _models_compiled += 1
    config = torch._dynamo.config
    needed = _VERSIONS_PER_MODEL * _models_compiled
    config.recompile_limit = max(config.recompile_limit, needed)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * needed)


def _graph_break(module: nn.Module) -> str | None:
    """Why ``module`` splits a compiled graph, or None."""
    if isinstance(module, nn.RNNBase):
        return "dynamo does not trace PyTorch's fused recurrent modules (nn.RNN, nn.GRU, nn.LSTM)"
    reason = getattr(type(module), "graph_break", None)
    return reason if isinstance(reason, str) else None


def compile_model(model: nn.Module, *, backend: str = "inductor") -> nn.Module:
    """``model`` compiled with ``fullgraph=True`` (the result is an ``nn.Module`` sharing its
    weights). Any number of models may be compiled in one process (see above).

    A model holding a layer that splits the graph is refused with the reason, before
    dynamo fails on it mid-trace with its own message: PyTorch's fused recurrent
    modules, and layers that declare a ``graph_break`` (a class attribute naming the
    host read that splits theirs).
    """
    for name, module in model.named_modules():
        reason = _graph_break(module)
        if reason is not None:
            where = f"{name} ({type(module).__name__})" if name else type(module).__name__
            raise ValueError(
                f"{where} cannot be compiled into one graph "
                f"(torch.compile(fullgraph=True)): {reason}; measure it without compiling"
            )
    _make_room_for_one_more_model()
    return torch.compile(model, fullgraph=True, backend=backend)  # type: ignore[return-value]


def check_compilable_call(forward_kwargs: dict[str, Any] | None) -> None:
    """Refuse call options whose output shapes depend on the data: dynamic query
    selection keeps a per-input number of queries, which no single graph holds."""
    if forward_kwargs and forward_kwargs.get("dqs_threshold") is not None:
        raise ValueError(
            "--compile cannot run dynamic query selection: the number of queries it keeps "
            "depends on the data, so the graph's shapes do"
        )


def compile_for_inference(
    model: nn.Module, inputs: tuple[Any, ...], *, forward_kwargs: dict[str, Any] | None = None
) -> tuple[nn.Module, float]:
    """Compile ``model`` in eval mode for ``inputs``; returns it and the compile seconds (first call)."""
    check_compilable_call(forward_kwargs)
    model.eval()
    compiled = compile_model(model)
    start = time.perf_counter()
    with torch.inference_mode():
        compiled(*inputs, **(forward_kwargs or {}))
    return compiled, time.perf_counter() - start
