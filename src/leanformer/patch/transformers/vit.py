"""Hugging Face ``transformers`` vision transformers as hosts of token reductions.

Supported (transformers 5.x): ``ViTModel`` / ``ViTForImageClassification``,
``DeiTModel`` / ``DeiTForImageClassification`` / ``DeiTForImageClassificationWithTeacher``
(class + distillation token), ``Dinov2Model``, ``Dinov2WithRegistersModel`` (class +
register tokens), ``CLIPVisionModel`` and ``SiglipVisionModel`` (no class token; its
attention-pooling head gets the ``log(size)`` key bias when sizes are tracked).

Each encoder layer is run from its own submodules (pre-norm, ``q_proj``/``k_proj``/
``v_proj``, ``o_proj``/``out_proj``, LayerScale, drop-path, MLP) by
:mod:`leanformer.patch.adapter`; the attention goes through
:func:`leanformer.ops.attention.attention`. Nothing of the host's forward code is
copied, and a layer whose class ``forward`` differs from the one known here is refused.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import transformers
from torch import Tensor, nn

from leanformer.ops.attention import attention
from leanformer.patch.adapter import (
    BlockParts,
    HostAdapter,
    Override,
    UnsupportedHostError,
    nothing_to_pool,
    single_conv,
)
from leanformer.pooling.reducer import ScoreKind
from leanformer.pooling.state import TokenPooling

__all__ = ["adapt", "supported_models"]

LIBRARY = f"transformers {transformers.__version__}"


def _unsupported(msg: str) -> UnsupportedHostError:
    return UnsupportedHostError(f"token pooling cannot patch this model ({LIBRARY}): {msg}")


@dataclass(frozen=True)
class _Layout:
    """Where one layer class keeps its parts (attribute names on the layer)."""

    norm1: str
    attention: str
    attn_post: tuple[str, ...]
    norm2: str
    mlp_post: tuple[str, ...]


_VIT = _Layout("layernorm_before", "attention", ("dropout",), "layernorm_after", ("dropout",))
_DINOV2 = _Layout("norm1", "attention", ("layer_scale1", "drop_path"), "norm2", ("layer_scale2", "drop_path"))
_CLIP = _Layout("layer_norm1", "self_attn", (), "layer_norm2", ())


@dataclass(frozen=True)
class _Family:
    """One supported vision model: where its base model, layers and prefix tokens are."""

    base: str | None  # attribute holding the base model (None: the model is the base)
    layers: str  # dotted path of the layer list on the base model
    layer_class: str
    layout: _Layout
    num_prefix: Callable[[Any], int]  # config -> class/distillation/register tokens


def _one(config: Any) -> int:
    return 1


_FAMILIES: dict[str, _Family] = {
    "ViTModel": _Family(None, "layers", "ViTLayer", _VIT, _one),
    "ViTForImageClassification": _Family("vit", "layers", "ViTLayer", _VIT, _one),
    "DeiTModel": _Family(None, "layers", "DeiTLayer", _VIT, lambda c: 2),
    "DeiTForImageClassification": _Family("deit", "layers", "DeiTLayer", _VIT, lambda c: 2),
    "DeiTForImageClassificationWithTeacher": _Family("deit", "layers", "DeiTLayer", _VIT, lambda c: 2),
    "Dinov2Model": _Family(None, "encoder.layer", "Dinov2Layer", _DINOV2, _one),
    "Dinov2WithRegistersModel": _Family(
        None, "encoder.layer", "Dinov2WithRegistersLayer", _DINOV2, lambda c: 1 + int(c.num_register_tokens)
    ),
    "CLIPVisionModel": _Family(None, "encoder.layers", "CLIPEncoderLayer", _CLIP, _one),
    "SiglipVisionModel": _Family(None, "encoder.layers", "SiglipEncoderLayer", _CLIP, lambda c: 0),
}


def supported_models() -> list[str]:
    """The ``transformers`` class names :func:`adapt` accepts."""
    return list(_FAMILIES)


class _Attention:
    """A ``transformers`` self-attention (separate q/k/v projections) from its own parts.

    An object holding ``attn``, not a closure over it: ``copy.deepcopy`` of a patched model
    then runs the copy's weights, and the model pickles.
    """

    def __init__(self, attn: Any) -> None:
        self.attn = attn
        self.head_dim = int(attn.head_dim)
        self.heads = attn.q_proj.out_features // self.head_dim
        self.scale = float(attn.scaling if hasattr(attn, "scaling") else attn.scale)
        self.dropout = float(attn.attention_dropout if hasattr(attn, "attention_dropout") else attn.dropout)
        # A submodule of attn: a deep copy maps it to the copy's, as it maps attn.
        self.out_proj = attn.o_proj if hasattr(attn, "o_proj") else attn.out_proj

    def __call__(
        self, x: Tensor, sizes: Tensor | None, reads: ScoreKind = None
    ) -> tuple[Tensor, Tensor | None]:
        """``reads``: what to return beside the output: the attention each token received
        ``[B, N]``, the keys averaged over heads ``[B, N, D]`` (ToMe's similarity) or None."""
        attn, heads, head_dim, out_proj = self.attn, self.heads, self.head_dim, self.out_proj
        B, N, _ = x.shape
        q, k, v = (
            proj(x).view(B, N, heads, head_dim).transpose(1, 2)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        out, received = attention(
            q,
            k,
            v,
            sizes=sizes,
            dropout_p=self.dropout if attn.training else 0.0,
            return_received=reads == "received",
            scale=self.scale,
        )
        if reads == "keys":
            received = k.mean(dim=1)
        return out_proj(out.transpose(1, 2).reshape(B, N, heads * head_dim)), received


def _parts(layout: _Layout) -> Callable[[nn.Module], BlockParts]:
    def parts(layer: Any) -> BlockParts:
        return BlockParts(
            norm1=getattr(layer, layout.norm1),
            attention=_Attention(getattr(layer, layout.attention)),
            attn_post=tuple(getattr(layer, n) for n in layout.attn_post),
            norm2=getattr(layer, layout.norm2),
            mlp=layer.mlp,
            mlp_post=tuple(getattr(layer, n) for n in layout.mlp_post),
        )

    return parts


class _CallCheck:
    """Refuses the call arguments a pooled layer cannot honour. Holds the model's config:
    ``config.output_attentions = True`` asks for maps without any call argument."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mask = args[0] if args else kwargs.get("attention_mask")
        if mask is not None:
            raise ValueError(
                f"a token-pooled model cannot take an attention mask ({LIBRARY}): "
                "the mask would no longer match the pooled tokens"
            )
        if kwargs.get("output_attentions") or getattr(self.config, "output_attentions", False):
            raise ValueError(
                f"a token-pooled model cannot return attention maps ({LIBRARY}): its blocks run the "
                "attention on the pooled tokens themselves, so the host's maps would be empty; call "
                "it without output_attentions, with config.output_attentions off (or "
                "remove_token_pooling first)"
            )


class _SizedMultiheadAttention:
    """``forward`` of SigLIP's pooling-head ``nn.MultiheadAttention`` with a ``log(size)`` key bias."""

    def __init__(self, mha: nn.MultiheadAttention, pooling: TokenPooling) -> None:
        self.mha = mha
        self.pooling = pooling

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> Any:
        if key.shape[1] == 0:
            raise nothing_to_pool("the attention-pooling head", LIBRARY)
        sizes = self.pooling.sizes
        if sizes is not None:
            if sizes.shape != key.shape[:2] or kwargs.get("attn_mask") is not None:
                raise ValueError(
                    f"the pooling head got keys {tuple(key.shape)} that are not the latest forward's "
                    f"pooled tokens (sizes {tuple(sizes.shape)}) ({LIBRARY})"
                )
            # nn.MultiheadAttention adds a float [B * heads, Lq, Nk] mask to its logits.
            bias = sizes.to(query.dtype).log()[:, None, :].expand(-1, query.shape[1], -1)
            kwargs["attn_mask"] = bias.repeat_interleave(self.mha.num_heads, dim=0)
        return nn.MultiheadAttention.forward(self.mha, query, key, value, **kwargs)


def _pool_overrides(base: nn.Module) -> Callable[[TokenPooling], list[Override]]:
    head = getattr(base, "head", None) if getattr(base, "use_head", False) else None

    def overrides(pooling: TokenPooling) -> list[Override]:
        if head is None:
            return []  # class-token pooling: the first token is never pooled
        return [(head.attention, "forward", _SizedMultiheadAttention(head.attention, pooling))]

    return overrides


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, list | tuple) else (int(v), int(v))


def adapt(model: nn.Module) -> HostAdapter:
    """The host adapter of a supported ``transformers`` vision model (raises otherwise)."""
    name = type(model).__name__
    family = _FAMILIES.get(name)
    if family is None or not type(model).__module__.startswith("transformers."):
        raise _unsupported(f"{name} is not one of the supported models: {', '.join(_FAMILIES)}")
    base = model if family.base is None else getattr(model, family.base)
    flag = "is_activation_checkpointing" if hasattr(type(base), "is_activation_checkpointing") else ""
    if flag and getattr(base, flag):
        raise _unsupported("gradient checkpointing re-runs layers out of order; disable it before patching")
    layers: Any = base
    for attr in family.layers.split("."):
        layers = getattr(layers, attr)
    for i, layer in enumerate(layers):
        known = _known_forward(family.layer_class)
        if type(layer).__name__ != family.layer_class or type(layer).forward is not known:
            raise _unsupported(f"layer {i} is a {type(layer).__name__}, expected {family.layer_class}")
        attn = getattr(layer, family.layout.attention)
        missing = [p for p in ("q_proj", "k_proj", "v_proj", "head_dim") if not hasattr(attn, p)]
        if missing:
            raise _unsupported(f"layer {i} attention lacks {', '.join(missing)}")
    config: Any = base.config
    grid_h, grid_w = (i // p for i, p in zip(_pair(config.image_size), _pair(config.patch_size), strict=True))
    return HostAdapter(
        library=LIBRARY,
        owner=model,
        blocks=list(layers),
        parts=_parts(family.layout),
        num_prefix=family.num_prefix(config),
        num_tokens=grid_h * grid_w,
        grid_size=(grid_h, grid_w),
        dim=int(config.hidden_size),
        check_call=_CallCheck(config),
        pool_overrides=_pool_overrides(base),
        patch_projection=single_conv(getattr(base, "embeddings", None)),  # the patch conv
        example_shape=(int(getattr(config, "num_channels", 3)), *_pair(config.image_size)),
    )


def _known_forward(layer_class: str) -> Any:
    """The ``forward`` of ``transformers``' own ``layer_class`` (the one whose parts we use)."""
    module = {
        "ViTLayer": "vit.modeling_vit",
        "DeiTLayer": "deit.modeling_deit",
        "Dinov2Layer": "dinov2.modeling_dinov2",
        "Dinov2WithRegistersLayer": "dinov2_with_registers.modeling_dinov2_with_registers",
        "CLIPEncoderLayer": "clip.modeling_clip",
        "SiglipEncoderLayer": "siglip.modeling_siglip",
    }[layer_class]
    return getattr(importlib.import_module(f"transformers.models.{module}"), layer_class).forward
