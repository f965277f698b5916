"""Token Pooling for pretrained timm ViT / DeiT models, without copying timm's code.

``apply_token_pooling(model, keep=..., method=...)`` swaps ``model.blocks`` (an
``nn.Sequential``) for a :class:`PooledBlocks` container holding the *same* block
modules, so the state dict keys, the weights and timm's own ``forward_features``
(patch embedding, position embedding, class/distillation/register tokens, final norm)
are untouched. Each block is run from its own submodules — ``norm1``, ``attn.qkv``,
``attn.q_norm``/``k_norm``, ``attn.norm``, ``attn.proj``, ``ls1``, ``drop_path1``,
``norm2``, ``mlp``, ``ls2``, ``drop_path2`` — with two additions: the attention takes
the token sizes (``log(size)`` logit bias through the fused SDPA kernel) and can report
the attention each token received, and a reducer sits between the attention and the
MLP. ``remove_token_pooling(model)`` restores a plain ``nn.Sequential``.

The patch checks what it relies on (class types whose ``forward`` it knows, attribute
names, class-token pooling) and refuses anything else with an error naming the
installed timm version, instead of silently computing something different.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import timm
from timm.layers.attention import Attention as TimmAttention
from timm.models.vision_transformer import Block as TimmBlock
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from leanformer.layers.block import ReducePosition
from leanformer.layers.reducer import TokenReducer, reduce_tokens
from leanformer.ops.attention import attention

__all__ = [
    "PooledBlocks",
    "TimmTokenPooling",
    "apply_reducers",
    "apply_token_pooling",
    "is_patched",
    "remove_token_pooling",
]

_BLOCK_PARTS = ("norm1", "attn", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2")
_ATTN_PARTS = ("qkv", "q_norm", "k_norm", "attn_drop", "norm", "proj", "proj_drop", "num_heads", "head_dim")


def _unsupported(msg: str) -> ValueError:
    return ValueError(f"token pooling cannot patch this model (timm {timm.__version__}): {msg}")


class TimmTokenPooling(nn.Module):
    """What the patch adds to a timm model: one reducer (or none) per block.

    Registered on the model as ``model.token_pooling`` so parametric reducers (``conv``)
    are trained, saved and moved with the model.
    """

    def __init__(
        self,
        reducers: Sequence[nn.Module | None],
        *,
        num_prefix: int,
        reduce_at: ReducePosition = "attn",
        config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if reduce_at not in ("attn", "mlp"):
            raise ValueError(f"reduce_at must be 'attn' or 'mlp', got {reduce_at!r}")
        for i, r in enumerate(reducers):
            if r is not None and not isinstance(r, TokenReducer):
                raise TypeError(f"reducer for block {i} ({type(r).__name__}) is not a TokenReducer")
        # ModuleDict keys must be strings; blocks without a reducer have no entry.
        self.reducers = nn.ModuleDict({str(i): r for i, r in enumerate(reducers) if r is not None})
        self.depth = len(reducers)
        self.num_prefix = num_prefix
        self.reduce_at: ReducePosition = reduce_at
        self.config = dict(config or {})

    def reducer(self, index: int) -> nn.Module | None:
        key = str(index)
        if key not in self.reducers:
            return None
        return self.reducers[key]

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())


def _attention_forward(
    attn: nn.Module, x: Tensor, sizes: Tensor | None, need_received: bool
) -> tuple[Tensor, Tensor | None]:
    """timm ``Attention`` from its own submodules, with sizes and received scores.

    ``x [B, N, C]``, ``sizes [B, N] | None`` -> ``(out [B, N, C], received [B, N] | None)``.
    """
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
        return_received=need_received,
        scale=attn.scale,
    )
    out = attn.norm(out.transpose(1, 2).reshape(B, N, heads * head_dim))
    if gate is not None:
        out = out * gate
    return attn.proj_drop(attn.proj(out)), received


def _block_forward(
    blk: nn.Module,
    x: Tensor,
    sizes: Tensor | None,
    reducer: nn.Module | None,
    num_prefix: int,
    reduce_at: ReducePosition,
) -> tuple[Tensor, Tensor | None]:
    """timm ``Block`` (pre-norm, LayerScale, drop-path) with a reducer after its attention.

    ``x [B, N, C]`` -> ``(x [B, N', C], sizes [B, N'] | None)``.
    """
    need_received = reducer is not None and bool(getattr(reducer, "needs_received", False))
    attn_out, received = _attention_forward(blk.attn, blk.norm1(x), sizes, need_received)
    x = x + blk.drop_path1(blk.ls1(attn_out))
    if reducer is not None and reduce_at == "attn":
        x, sizes = reduce_tokens(reducer, x, sizes, received, num_prefix)
    x = x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
    if reducer is not None and reduce_at == "mlp":
        x, sizes = reduce_tokens(reducer, x, sizes, received, num_prefix)
    return x, sizes


class PooledBlocks(nn.Sequential):
    """Drop-in replacement for ``model.blocks``: same children (same state-dict keys).

    ``forward(x [B, N, C]) -> [B, N', C]`` threads the token sizes from block to block,
    which a plain ``nn.Sequential`` of timm blocks cannot do.
    """

    def __init__(self, blocks: nn.Sequential, pooling: TimmTokenPooling) -> None:
        super().__init__(*blocks)
        # Not a child module: the pooling state is registered on the model itself, and
        # registering it here too would make it show up as an extra "block".
        self.__dict__["_pooling"] = pooling

    @property
    def pooling(self) -> TimmTokenPooling:
        return self.__dict__["_pooling"]

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        pooling = self.pooling
        sizes: Tensor | None = None
        for i, blk in enumerate(self):
            x, sizes = _block_forward(
                blk, x, sizes, pooling.reducer(i), pooling.num_prefix, pooling.reduce_at
            )
        return x


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
    from timm.models import get_pretrained_cfg_value

    try:
        size = get_pretrained_cfg_value(name, "input_size")
    except RuntimeError:  # not a timm model name: create_timm_model says so
        return None
    return int(size[-1]) if size else None


def _check_supported(model: nn.Module) -> None:
    """Raise a ValueError naming the timm version for anything the patch does not know."""
    if isinstance(getattr(model, "blocks", None), PooledBlocks) or hasattr(model, "token_pooling"):
        raise ValueError(
            f"token pooling is already applied to this model (timm {timm.__version__}); "
            "call remove_token_pooling(model) before patching it again"
        )
    if not isinstance(model, VisionTransformer):
        raise _unsupported(
            f"{type(model).__name__} is not a timm VisionTransformer (ViT / DeiT / distilled DeiT)"
        )
    if type(model.blocks) is not nn.Sequential:
        raise _unsupported(f"model.blocks is a {type(model.blocks).__name__}, expected nn.Sequential")
    if model.cls_token is None or model.global_pool != "token" or model.attn_pool is not None:
        raise _unsupported(
            f"only class-token models are supported (global_pool={model.global_pool!r}); pooled tokens "
            "would be averaged without their sizes"
        )
    if getattr(model, "grad_checkpointing", False):
        raise _unsupported("gradient checkpointing runs the blocks one by one; disable it before patching")
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


def apply_reducers(
    model: nn.Module,
    reducers: Sequence[nn.Module | None],
    *,
    reduce_at: ReducePosition = "attn",
    config: dict[str, Any] | None = None,
) -> nn.Module:
    """Install one reducer (or None) per block of a timm ViT, in place; returns the model.

    The low-level form of :func:`apply_token_pooling` for reducers built by hand (any
    object following :class:`leanformer.layers.reducer.TokenReducer`).
    """
    _check_supported(model)
    depth = len(model.blocks)
    if len(reducers) != depth:
        raise ValueError(f"got {len(reducers)} reducers for a model with {depth} blocks")
    pooling = TimmTokenPooling(
        reducers, num_prefix=int(model.num_prefix_tokens), reduce_at=reduce_at, config=config
    )
    ref = next(model.parameters(), None)
    if ref is not None:
        pooling.to(device=ref.device)
    model.token_pooling = pooling
    model.blocks = PooledBlocks(model.blocks, pooling)
    return model


def apply_token_pooling(
    model: nn.Module,
    *,
    keep: Any,
    method: str = "wkmedoids",
    carry: bool = True,
    reduce_at: ReducePosition = "attn",
    **options: Any,
) -> nn.Module:
    """Insert Token Pooling into a timm ViT / DeiT in place (no training needed); returns it.

    ``keep``: per-layer maxima (a list of one int per block), a keep ratio, or a named
    schedule (e.g. ``"deit_s_level3"``), as in :func:`leanformer.layers.token_pooling.build_reducers`.
    ``carry``: track token sizes and weigh keys by them in later attention.
    Class, distillation and register tokens (timm's ``num_prefix_tokens``) are never pooled.
    """
    _check_supported(model)
    from leanformer.layers.token_pooling import build_reducers

    grid = tuple(int(g) for g in model.patch_embed.grid_size)
    reducers = build_reducers(
        method=method,
        keep=keep,
        depth=len(model.blocks),
        num_tokens=int(model.patch_embed.num_patches),
        dim=int(model.embed_dim),
        grid_size=(grid[0], grid[1]),
        carry=carry,
        **options,
    )
    config = {"method": method, "keep": keep, "carry": carry, "reduce_at": reduce_at, **options}
    return apply_reducers(model, reducers, reduce_at=reduce_at, config=config)


def remove_token_pooling(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_token_pooling`: plain ``nn.Sequential`` blocks, no reducers."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, PooledBlocks):
        raise ValueError(f"this model has no token pooling to remove (timm {timm.__version__})")
    model.blocks = nn.Sequential(*blocks)
    del model.token_pooling
    return model


def is_patched(model: nn.Module) -> bool:
    return isinstance(getattr(model, "blocks", None), PooledBlocks)
