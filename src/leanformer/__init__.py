"""leanformer: make transformers cheaper by processing fewer tokens.

The public API is what ``__all__`` lists; everything else is importable from its
subpackage but may change. Heavier entry points load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from leanformer.models.registry import create_model, list_models, model_info, register_model

__version__ = "0.1.0"

_LAZY = {
    "apply_token_pooling": "leanformer.patch.api",
    "remove_token_pooling": "leanformer.patch.api",
    "is_patched": "leanformer.patch.api",
    "build_dataset": "leanformer.data.registry",
    "list_datasets": "leanformer.data.registry",
    "load_model": "leanformer.engine.checkpoint",
    "EntropyClusteredAttention": "leanformer.layers.enact_attention",
    "count_gflops": "leanformer.bench.flops",
    "measure_throughput": "leanformer.bench.throughput",
}

__all__ = ["__version__", "create_model", "list_models", "model_info", "register_model", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'leanformer' has no attribute {name!r}")
