"""ENACT in the encoder of Hugging Face DETR (``DetrModel``, ``DetrForObjectDetection``, Conditional DETR).

``apply_enact(model, sigma=3.0)`` replaces every encoder layer's ``self_attn`` by a
:class:`DetrEnactAttention` that runs on that layer's *own* ``q_proj``, ``k_proj``,
``v_proj`` and ``o_proj`` modules (so the state dict keys of the host stay valid; each
layer gains ``self_attn.entropy_proj``). Everything else in the layer is still the
host's code: position embeddings added to queries and keys but not values, dropout,
post-norm, the MLP. ``remove_enact(model)`` puts the original attention modules back.

The host's attention sees the flattened feature map but not its height and width, which
ENACT's 2-D entropy filters need. Two forward pre-hooks supply them without touching the
host's code: one on the model's ``position_embedding`` (called with the feature map's
shape) records ``(H, W)``; one on the encoder hands ``(H, W)`` and the padding mask it
receives (``[B, HW]``, 1 = real position) to every layer as keyword arguments, which
the host's encoder layers pass on to ``self_attn`` untouched.

What the patch relies on is checked (exact classes, module names, the attention scale),
and anything else is refused with an error naming the installed ``transformers``.
"""

from __future__ import annotations

from typing import Any

import transformers
from torch import Tensor, nn
from transformers.models.conditional_detr import modeling_conditional_detr as cdetr
from transformers.models.detr import modeling_detr as detr

from leanformer.layers.enact_attention import EntropyClusteredAttention, layer_cluster_ratios

__all__ = [
    "DetrEnactAttention",
    "apply_enact",
    "cluster_ratios",
    "enact_layers",
    "is_patched",
    "remove_enact",
]

_CDETR_LAYER, _CDETR_ATTN = cdetr.ConditionalDetrEncoderLayer, cdetr.ConditionalDetrSelfAttention
# Model class -> (whether the DETR core is the model itself or its ``.model``, encoder layer
# class, self-attention class). Conditional DETR's encoder is DETR's, line for line.
_HOSTS: dict[type, tuple[bool, type, type]] = {
    detr.DetrModel: (False, detr.DetrEncoderLayer, detr.DetrSelfAttention),
    detr.DetrForObjectDetection: (True, detr.DetrEncoderLayer, detr.DetrSelfAttention),
    cdetr.ConditionalDetrModel: (False, _CDETR_LAYER, _CDETR_ATTN),
    cdetr.ConditionalDetrForObjectDetection: (True, _CDETR_LAYER, _CDETR_ATTN),
}
_STATE = "_leanformer_enact"  # attribute on the DETR core while the patch is applied
_SHAPE_KW, _VALID_KW = "enact_spatial_shape", "enact_valid"


def _unsupported(msg: str) -> ValueError:
    return ValueError(f"ENACT cannot patch this model (transformers {transformers.__version__}): {msg}")


class DetrEnactAttention(EntropyClusteredAttention):
    """ENACT self-attention on a Hugging Face DETR encoder layer's own projections.

    Called like the host's ``DetrSelfAttention``: ``(hidden_states [B, HW, C],
    attention_mask, position_embeddings [B, HW, C], **kwargs) -> (output, None)``, plus
    ``enact_spatial_shape=(H, W)`` and ``enact_valid [B, HW]`` (1/True = real position),
    which :func:`apply_enact`'s encoder hook adds. The host's 4-D ``attention_mask`` is
    not needed: ``enact_valid`` carries the same padding. Attention weights are not
    returned (they are over clusters, not positions).
    """

    def __init__(
        self,
        host: Any,  # the DETR attention it wraps: q/k/v/o_proj, attention_dropout
        *,
        num_heads: int,
        sigma: float = 3.0,
        cluster_inputs: bool = True,
        regions: str = "curvature",
        matrix: str = "fused",
    ) -> None:
        d_model = host.q_proj.in_features
        super().__init__(
            d_model,
            num_heads,
            dropout=float(host.attention_dropout),
            sigma=sigma,
            bias=host.q_proj.bias is not None,
            cluster_inputs=cluster_inputs,
            regions=regions,
            matrix=matrix,
        )
        # The host's modules, shared: training them trains the host, and its checkpoint keys hold.
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            host.q_proj,
            host.k_proj,
            host.v_proj,
            host.o_proj,
        )
        self.entropy_proj.to(device=host.q_proj.weight.device, dtype=host.q_proj.weight.dtype)
        # Kept for remove_enact, but not as a submodule: its parameters are already ours.
        self.__dict__["host"] = host
        self.train(host.training)

    def _init_projections(self, d_model: int, bias: bool) -> None:
        """No parameters of our own: the host's projections are attached in ``__init__``."""

    def _proj(self, x: Tensor, which: int) -> Tensor:
        projection: nn.Module = (self.q_proj, self.k_proj, self.v_proj)[which]
        return projection(x)

    def _out(self, x: Tensor) -> Tensor:
        out: nn.Module = self.o_proj
        return out(x)

    def forward(  # type: ignore[override]  # the host's calling convention, not DenseSelfAttention's
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        position_embeddings: Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        shape = kwargs.get(_SHAPE_KW)
        if shape is None:
            raise ValueError(
                "ENACT needs the feature map's (H, W): call the patched DETR model, or pass "
                f"{_SHAPE_KW}=(H, W) to its encoder"
            )
        valid = kwargs.get(_VALID_KW)
        if valid is not None and valid.dim() != 2:
            raise ValueError(
                f"the encoder's attention_mask must be [B, HW] (1 = real), got {tuple(valid.shape)}"
            )
        padding = ~valid.bool() if valid is not None else None
        return super().forward(hidden_states, position_embeddings, tuple(shape), padding), None


class _EnactHooks:
    """The two forward pre-hooks of :func:`apply_enact` and the feature-map shape between them."""

    def __init__(self) -> None:
        self.shape: tuple[int, int] | None = None
        self.handles: list[Any] = []

    def record_shape(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        # DETR calls position_embedding(shape=feature_map.shape, device, dtype, mask): [B, C, H, W].
        shape = kwargs["shape"] if "shape" in kwargs else args[0]
        self.shape = (int(shape[-2]), int(shape[-1]))

    def forget_shape(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        # After every whole forward, even one that skipped the encoder (encoder_outputs
        # given) or failed in between: the shape it recorded belongs to that call only.
        self.shape = None

    def pass_to_layers(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if _SHAPE_KW not in kwargs and self.shape is not None:
            kwargs[_SHAPE_KW] = self.shape
        self.shape = None  # used once, so a later direct encoder call cannot pick up a stale shape
        # encoder(inputs_embeds, attention_mask, spatial_position_embeddings): [B, HW], 1 = real.
        positional = args[1] if len(args) > 1 else None
        kwargs[_VALID_KW] = kwargs.get("attention_mask", positional)
        return args, kwargs


def _detr_core(model: nn.Module) -> tuple[Any, type, type]:
    """The ``DetrModel``-like module holding backbone, position embedding and encoder
    (typed ``Any``: its structure is checked here and in :func:`_check_layer`)."""
    entry = _HOSTS.get(type(model))
    if entry is None:
        names = ", ".join(sorted(cls.__name__ for cls in _HOSTS))
        raise _unsupported(f"{type(model).__name__} is not one of {names}")
    wrapped, layer_cls, attn_cls = entry
    core = model.model if wrapped else model
    for name in ("position_embedding", "encoder"):
        if not isinstance(getattr(core, name, None), nn.Module):
            raise _unsupported(f"{type(core).__name__} has no {name} module")
    return core, layer_cls, attn_cls


def _check_layer(i: int, layer: nn.Module, layer_cls: type, attn_cls: type[Any]) -> int:
    """Check one encoder layer is the structure the patch knows; returns its head count."""
    if type(layer) is not layer_cls:
        raise _unsupported(f"encoder layer {i} is {type(layer).__name__}, expected {layer_cls.__name__}")
    attn: Any = getattr(layer, "self_attn", None)
    if type(attn) is not attn_cls:
        raise _unsupported(
            f"encoder layer {i}'s self_attn is {type(attn).__name__}, expected {attn_cls.__name__}"
        )
    projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears = [p for p in projections if isinstance(p, nn.Linear)]
    if len(linears) != len(projections):
        raise _unsupported(f"encoder layer {i}'s self_attn lacks nn.Linear q_proj/k_proj/v_proj/o_proj")
    d_model = linears[0].in_features
    if any(p.in_features != d_model or p.out_features != d_model for p in linears):
        raise _unsupported(f"encoder layer {i}'s projections are not all {d_model} -> {d_model}")
    head_dim = int(attn.head_dim)
    if d_model % head_dim != 0 or abs(float(attn.scaling) - head_dim**-0.5) > 1e-12:
        # Our fused attention scales by 1/sqrt(head_dim), as DETR does.
        raise _unsupported(f"encoder layer {i}: head_dim {head_dim} / scaling {attn.scaling} not DETR's")
    return d_model // head_dim


def apply_enact(
    model: nn.Module,
    *,
    sigma: float = 3.0,
    cluster_inputs: bool = True,
    regions: str = "curvature",
    matrix: str | None = None,
) -> nn.Module:
    """Make every encoder self-attention of a Hugging Face DETR use ENACT; returns ``model``.

    ``sigma``: Gaussian smoothing of the entropy map before its curvature sign (0 = none).
    ``matrix``: ``"fused"`` or ``"explicit"`` attention probabilities (see
    :class:`~leanformer.layers.enact_attention.DenseSelfAttention`); by default as the host
    holds them (``attn_implementation="eager"`` is explicit, anything else fused).
    ``regions="single"`` makes every position its own region, which reproduces the dense
    encoder exactly (a check of the wrapping). New parameters (``entropy_proj`` per layer)
    are created on the model's device and dtype: build the optimiser after this call.
    """
    core, layer_cls, attn_cls = _detr_core(model)
    if hasattr(core, _STATE):
        raise ValueError("ENACT is already applied to this model; remove_enact(model) first")
    layers = list(core.encoder.layers)
    heads = [_check_layer(i, layer, layer_cls, attn_cls) for i, layer in enumerate(layers)]
    # Build every wrapper before changing anything, so a bad option leaves the model as it was.
    if matrix is None:
        host_matrix = getattr(getattr(model, "config", None), "_attn_implementation", None)
        matrix = "explicit" if host_matrix == "eager" else "fused"
    wrappers = [
        DetrEnactAttention(
            layer.self_attn,
            num_heads=h,
            sigma=sigma,
            cluster_inputs=cluster_inputs,
            regions=regions,
            matrix=matrix,
        )
        for layer, h in zip(layers, heads, strict=True)
    ]
    hooks = _EnactHooks()
    hooks.handles = [
        core.position_embedding.register_forward_pre_hook(hooks.record_shape, with_kwargs=True),
        core.encoder.register_forward_pre_hook(hooks.pass_to_layers, with_kwargs=True),
        core.register_forward_hook(hooks.forget_shape, with_kwargs=True, always_call=True),
    ]
    for layer, wrapper in zip(layers, wrappers, strict=True):
        layer.self_attn = wrapper
    setattr(core, _STATE, hooks)
    return model


def remove_enact(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_enact`: the original attention modules and no hooks; returns ``model``."""
    core, _, _ = _detr_core(model)
    hooks = getattr(core, _STATE, None)
    if hooks is None:
        raise ValueError("ENACT is not applied to this model")
    for layer in core.encoder.layers:
        wrapper = layer.self_attn
        host = wrapper.host
        host.train(wrapper.training)
        layer.self_attn = host
    for handle in hooks.handles:
        handle.remove()
    delattr(core, _STATE)
    return model


def enact_layers(model: nn.Module) -> list[DetrEnactAttention]:
    """The ENACT attention modules of a patched model, in encoder order (empty if not patched)."""
    core, _, _ = _detr_core(model)
    return [
        layer.self_attn for layer in core.encoder.layers if isinstance(layer.self_attn, DetrEnactAttention)
    ]


def cluster_ratios(model: nn.Module) -> list[float]:
    """Per ENACT layer, the mean over maps of clusters / valid positions in the last forward."""
    return layer_cluster_ratios(enact_layers(model))


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`apply_enact` is in effect on ``model``."""
    core, _, _ = _detr_core(model)
    return hasattr(core, _STATE)
