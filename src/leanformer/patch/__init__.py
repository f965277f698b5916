"""The host adapters: leanformer's token reduction applied to third-party models (timm,
Hugging Face), one module per host.

:mod:`leanformer.patch.api` holds the entry points (``apply_token_pooling``,
``remove_token_pooling``, ``apply_reducers``, ``is_patched``); :mod:`leanformer.patch.adapter`
the adapter interface and the shared step a patched block runs; :mod:`leanformer.patch.timm`
and :mod:`leanformer.patch.transformers` the hosts.
"""
