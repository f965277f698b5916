"""timm as a host: its ``VisionTransformer`` adapted for token reductions, without copying
timm's code (leanformer's own DeiT family is one), and its models built offline.

Supported: timm's ``VisionTransformer`` in its pre-norm forms: class token or none
(``class_token=False``), ``global_pool`` ``'token'``, ``'avg'``, ``'avgmax'``, ``'max'``
or ``''``, a MAP head (``global_pool='map'``, ``attn_pool``), register and
distillation tokens, ``dynamic_img_size``, LayerScale, q/k norm and the scaled-norm
attention. Each block runs from its own submodules (``norm1``, ``attn.qkv``,
``attn.q_norm``/``k_norm``, ``attn.norm``, ``attn.proj``, ``ls1``, ``drop_path1``,
``norm2``, ``mlp``, ``ls2``, ``drop_path2``) through
:mod:`leanformer.patch.adapter`; the attention goes through
:func:`leanformer.ops.attention.attention` with the ``log(size)`` key bias. With sizes
tracked (``carry=True``), an average pool weighs every token by its size, and the MAP
head's attention gets the same ``log(size)`` bias, so both still summarise the
original tokens. Parallel blocks, post-norm blocks, RoPE and Eva models are refused
with an error naming the installed timm version.
"""

from __future__ import annotations

import difflib
from typing import Any

import timm
from timm.layers.attention import Attention as TimmAttention
from timm.models import get_pretrained_cfg_value
from timm.models.vision_transformer import Block as TimmBlock
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from leanformer.ops.attention import attention, size_bias
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

__all__ = ["LIBRARY", "adapt", "block_parts", "create_timm_model", "timm_input_size", "weighted_token_mean"]

LIBRARY = f"timm {timm.__version__}"
_BLOCK_PARTS = ("norm1", "attn", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2")
_ATTN_PARTS = ("qkv", "q_norm", "k_norm", "attn_drop", "norm", "proj", "proj_drop", "num_heads", "head_dim")
_POOLS = ("token", "avg", "avgmax", "max", "", "map")


def _unsupported(msg: str) -> UnsupportedHostError:
    return UnsupportedHostError(f"token pooling cannot patch this model ({LIBRARY}): {msg}")


class _Attention:
    """timm ``Attention`` from its own submodules, with sizes and received scores.

    ``x [B, N, C]``, ``sizes [B, N] | None`` -> ``(out [B, N, C], received [B, N] | None)``.
    An object holding ``attn``, not a closure over it: ``copy.deepcopy`` of a patched model
    then runs the copy's weights, and the model pickles.
    """

    def __init__(self, attn: Any) -> None:
        self.attn = attn

    def __call__(
        self, x: Tensor, sizes: Tensor | None, reads: ScoreKind = None
    ) -> tuple[Tensor, Tensor | None]:
        """``reads``: what to return beside the output: the attention each token received
        ``[B, N]``, the keys averaged over heads ``[B, N, D]`` (ToMe's similarity) or None."""
        attn = self.attn
        B, N, _ = x.shape
        heads, head_dim = attn.num_heads, attn.head_dim
        gate = attn.gate(x).sigmoid() if getattr(attn, "gate", None) is not None else None
        qkv = attn.qkv(x).reshape(B, N, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = attn.q_norm(q), attn.k_norm(k)
        out, received = attention(
            q,
            k,
            v,
            sizes=sizes,
            dropout_p=attn.attn_drop.p if attn.training else 0.0,
            return_received=reads == "received",
            scale=attn.scale,
        )
        out = attn.norm(out.transpose(1, 2).reshape(B, N, heads * head_dim))
        if gate is not None:
            out = out * gate
        if reads == "keys":
            received = k.mean(dim=1)  # the keys the attention used, q/k norm included
        return attn.proj_drop(attn.proj(out)), received


def block_parts(blk: Any) -> BlockParts:
    return BlockParts(
        norm1=blk.norm1,
        attention=_Attention(blk.attn),
        attn_post=(blk.ls1, blk.drop_path1),
        norm2=blk.norm2,
        mlp=blk.mlp,
        mlp_post=(blk.ls2, blk.drop_path2),
    )


def _check_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    mask = args[0] if args else kwargs.get("attn_mask")
    causal = args[1] if len(args) > 1 else kwargs.get("is_causal", False)
    if mask is not None or causal:
        raise ValueError(
            f"a token-pooled model cannot take an attention mask or causal attention ({LIBRARY}): "
            "the mask would no longer match the pooled tokens"
        )


def weighted_token_mean(tokens: Tensor, sizes: Tensor) -> Tensor:
    """``tokens [B, N, C]``, ``sizes [B, N]`` -> ``[B, C]``: each token counted ``size`` times."""
    w = sizes.to(tokens.dtype)[..., None]
    return (tokens * w).sum(1) / w.sum(1)


class _SizedPool:
    """``model.pool`` of a patched timm ViT: timm's pooling, with tokens weighed by size.

    Without tracked sizes (``carry=False``) or for class-token pooling it is timm's own.
    """

    def __init__(self, model: VisionTransformer, pooling: TokenPooling) -> None:
        self.model = model
        self.pooling = pooling

    def __call__(self, x: Tensor, pool_type: str | None = None) -> Tensor:
        model, sizes = self.model, self.pooling.sizes
        pool_type = model.global_pool if pool_type is None else pool_type
        start = 0 if model.pool_include_prefix else model.num_prefix_tokens
        if x.shape[1] <= start and (model.attn_pool is not None or pool_type in ("avg", "avgmax", "max")):
            head = "the MAP head" if model.attn_pool is not None else f"global_pool={pool_type!r}"
            raise nothing_to_pool(head, LIBRARY)
        sized = model.attn_pool is not None or pool_type in ("avg", "avgmax")
        if sizes is None or not sized:
            return VisionTransformer.pool(model, x, pool_type)
        if sizes.shape != x.shape[:2]:
            raise ValueError(
                f"pooled features {tuple(x.shape)} do not come from the latest forward "
                f"(sizes {tuple(sizes.shape)}): run forward_features and forward_head together"
            )
        tokens, sizes = x[:, start:], sizes[:, start:]
        if model.attn_pool is not None:
            # The MAP head's attention counts a key of size s as s identical keys.
            return model.attn_pool(tokens, attn_mask=size_bias(sizes, tokens.dtype))
        mean = weighted_token_mean(tokens, sizes)
        return mean if pool_type == "avg" else 0.5 * (tokens.amax(dim=1) + mean)


def _pool_overrides(model: VisionTransformer) -> Any:
    def overrides(pooling: TokenPooling) -> list[Override]:
        return [(model, "pool", _SizedPool(model, pooling))]

    return overrides


def _check_supported(model: nn.Module) -> None:
    """Raise naming the timm version for anything the adapter does not know."""
    if not isinstance(model, VisionTransformer):
        raise _unsupported(
            f"{type(model).__name__} is not a timm VisionTransformer (ViT / DeiT / distilled DeiT)"
        )
    if type(model).pool is not VisionTransformer.pool:
        raise _unsupported(f"{type(model).__name__} overrides VisionTransformer.pool")
    if model.global_pool not in _POOLS:
        raise _unsupported(f"global_pool={model.global_pool!r} is not one of {', '.join(map(repr, _POOLS))}")
    if getattr(model, "grad_checkpointing", False):
        raise _unsupported("gradient checkpointing re-runs blocks out of order; disable it before patching")
    if not isinstance(model.blocks, nn.Sequential):
        raise _unsupported(f"model.blocks is a {type(model.blocks).__name__}, expected nn.Sequential")
    for i, blk in enumerate(model.blocks):
        # Compare forward functions, not classes: a subclass that keeps timm's forward
        # computes the same thing, one that overrides it may not.
        if not isinstance(blk, TimmBlock) or type(blk).forward is not TimmBlock.forward:
            raise _unsupported(f"block {i} is a {type(blk).__name__}, expected timm's pre-norm Block")
        missing = [p for p in _BLOCK_PARTS if not hasattr(blk, p)]
        if missing:
            raise _unsupported(f"block {i} lacks {', '.join(missing)}")
        attn = blk.attn
        if not isinstance(attn, TimmAttention) or type(attn).forward is not TimmAttention.forward:
            raise _unsupported(f"block {i} attention is a {type(attn).__name__}, expected timm's Attention")
        missing = [p for p in _ATTN_PARTS if not hasattr(attn, p)]
        if missing:
            raise _unsupported(f"block {i} attention lacks {', '.join(missing)}")


def _takes_one_image_size(patch_embed: nn.Module) -> bool:
    """Whether the patch embedding refuses every image size but its own."""
    return bool(getattr(patch_embed, "strict_img_size", False)) and not getattr(
        patch_embed, "dynamic_img_size", False
    )


def adapt(model: nn.Module) -> HostAdapter:
    """The host adapter of a timm ``VisionTransformer`` (raises for anything else)."""
    _check_supported(model)
    assert isinstance(model, VisionTransformer)
    grid = tuple(int(g) for g in model.patch_embed.grid_size)
    return HostAdapter(
        library=LIBRARY,
        owner=model,
        blocks=list(model.blocks),
        parts=block_parts,
        num_prefix=int(model.num_prefix_tokens),
        num_tokens=int(model.patch_embed.num_patches),
        grid_size=(grid[0], grid[1]),
        dim=int(model.embed_dim),
        check_call=_check_call,
        pool_overrides=_pool_overrides(model),
        # timm's projection: its conv, or the one conv of a wrapper of it (not a hybrid
        # embedding's backbone, whose first conv is no patch grid).
        patch_projection=single_conv(getattr(model.patch_embed, "proj", None)),
        fixed_grid=_takes_one_image_size(model.patch_embed),
        example_shape=_example_shape(model),
    )


def _example_shape(model: VisionTransformer) -> tuple[int, int, int] | None:
    embed: Any = model.patch_embed
    size, projection = getattr(embed, "img_size", None), single_conv(getattr(embed, "proj", None))
    if size is None or not isinstance(projection, nn.Conv2d):
        return None
    return int(projection.in_channels), int(size[0]), int(size[1])


def create_timm_model(name: str, **kwargs: Any) -> nn.Module:
    """``timm.create_model(name, pretrained=False, **kwargs)`` with clear errors; never downloads.

    An unknown name raises a ValueError with close matches. Pretrained weights are read
    only from a local file (``pretrained=True, pretrained_cfg_overlay={"file": PATH}``):
    a plain ``pretrained=True`` would try the network, which leanformer never uses.
    """
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown timm model {name!r} (timm {timm.__version__}){hint}")
    kwargs.setdefault("pretrained", False)
    overlay = kwargs.get("pretrained_cfg_overlay") or {}
    if kwargs["pretrained"] and "file" not in overlay:
        raise ValueError(
            "pretrained timm weights are read only from a local file: pass "
            "pretrained_cfg_overlay={'file': PATH} (nothing is downloaded)"
        )
    try:
        return timm.create_model(name, **kwargs)
    except TypeError as exc:  # an option this architecture's constructor does not take
        raise ValueError(f"timm model {name!r} does not take the options given: {exc}") from None
    except AssertionError as exc:  # timm asserts on inconsistent options (e.g. heads vs width)
        raise ValueError(f"timm model {name!r} rejects the options given: {exc}") from None


def timm_input_size(name: str) -> int | None:
    """The input side a timm model was designed for (e.g. 224), or None if timm does not say."""
    try:
        size = get_pretrained_cfg_value(name, "input_size")
    except RuntimeError:  # not a timm model name: create_timm_model says so
        return None
    return int(size[-1]) if size else None
