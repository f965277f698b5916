"""Hugging Face ``transformers`` models as hosts of leanformer's methods."""

from leanformer.patch.transformers.vit import adapt, supported_models

__all__ = ["adapt", "supported_models"]
