"""Hugging Face ``transformers`` models as hosts of leanformer's methods: token pooling on
the ViT family (``vit``) and ENACT on DETR's encoder (``detr``).

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
from leanformer.patch.transformers.vit import adapt, supported_models

__all__ = ["adapt", "apply_enact", "remove_enact", "supported_models"]
