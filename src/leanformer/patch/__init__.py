"""Adapters that apply leanformer's methods to third-party models (timm, Hugging Face).

:mod:`leanformer.patch.api` holds the entry points (``apply_token_pooling``,
``remove_token_pooling``, ``is_patched``); :mod:`leanformer.patch.adapter` the adapter
interface; one module per host library implements it.
"""
