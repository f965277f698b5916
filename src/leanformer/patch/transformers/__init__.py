"""Adapters for Hugging Face ``transformers`` models.

``transformers`` is an optional extra: ``pip install 'leanformer[transformers]'``.
"""

from __future__ import annotations

try:
    import transformers as _transformers  # noqa: F401  (only to fail early with a clear message)
except ImportError as err:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "leanformer.patch.transformers needs Hugging Face transformers: "
        "pip install 'leanformer[transformers]'"
    ) from err

from leanformer.patch.transformers.detr import apply_enact, remove_enact

__all__ = ["apply_enact", "remove_enact"]
