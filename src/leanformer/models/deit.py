"""DeiT / ViT family: timm ``VisionTransformer`` configurations, token-pooled by the host adapter.

Shapes follow DeiT (Touvron et al., 2021): patch 16 at 224x224 gives 196 tokens plus
a class token (and a distillation token for the distilled variants). Small-image
presets use patch 4 at 32x32 (64 tokens + class token) for the bundled data.

A model here *is* a timm ``VisionTransformer`` (``VisionTransformerDistilled`` when
``distilled=True``): the same blocks, state-dict keys and ``forward_features`` /
``forward_head``. ``pool``/``keep``/``carry`` install token pooling through
:mod:`leanformer.patch.timm`, exactly as :func:`leanformer.apply_token_pooling`
does on any timm ViT, so ``model.token_pooling.keep`` changes the budget at run time.
Importing this module also registers every preset in timm's registry
(``timm.create_model("deit_small")``), each with a ``pretrained_cfg``.
"""

from __future__ import annotations

import re
from typing import Any, cast

import timm
from timm.models import register_model
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from leanformer.layers.checks import (
    check_positive,
    check_positive_number,
    check_rates,
    head_dim,
    hidden_width,
)
from leanformer.layers.classifier import classifier
from leanformer.layers.init import init_vit_weights
from leanformer.layers.patch_embed import check_image_sides, to_2tuple
from leanformer.models.registry import create_model, register
from leanformer.patch.adapter import install
from leanformer.patch.timm import adapt
from leanformer.pooling.budgets import KeepLike
from leanformer.pooling.reducer import ReducePosition

# Token pooling from before the DeiT family was a timm configuration kept a reducer
# per block ("blocks.3.reducer.conv.weight"); it now lives in model.token_pooling.
_OLD_REDUCER_KEY = re.compile(r"^blocks\.(\d+)\.reducer\.")


class DeiT(VisionTransformer):
    """Vision transformer with class (+ optional distillation) token.

    ``pool``/``keep``/``carry`` apply token pooling (see
    :mod:`leanformer.pooling.registry`); ``pool="none"`` is the plain model. ``unpool``:
    ``forward_features`` gives every token position back (:func:`leanformer.apply_token_pooling`). Any
    input size works (``dynamic_img_size``: position embeddings are resampled).
    """

    def __new__(cls, *args: Any, distilled: bool = False, **kwargs: Any) -> DeiT:
        # One registry class for both: the distilled form is timm's distilled ViT.
        if distilled and not issubclass(cls, VisionTransformerDistilled):
            cls = DistilledDeiT
        return super().__new__(cls)

    def __init__(
        self,
        *,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 192,
        depth: int = 12,
        num_heads: int = 3,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        init_values: float | None = None,
        distilled: bool = False,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        pool: str = "none",
        keep: KeepLike | None = None,
        carry: bool = False,
        reduce_at: ReducePosition | None = None,
        pool_options: dict[str, Any] | None = None,
        unpool: bool = False,
    ) -> None:
        check_positive(patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim, num_heads=num_heads)
        check_positive(minimum=0, depth=depth)
        check_rates(drop_rate=drop_rate, attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate)
        hidden_width(embed_dim, mlp_ratio)  # timm's blocks would read a width of 0 as full width
        # LayerScale's init_values: 0 or None for none.
        check_positive_number(zero_ok=True, optional=True, init_values=init_values)
        classifier(embed_dim, num_classes)  # validates num_classes before timm builds anything
        if pool_options is not None and not isinstance(pool_options, dict):
            raise ValueError(f"pool_options must be a mapping of option names, got {pool_options!r}")
        if pool == "none" and (keep is not None or carry or unpool):
            raise ValueError(
                "keep=, carry= and unpool= need a pooling method: pass pool=... (e.g. pool='wkmedoids')"
            )
        size = to_2tuple(img_size)
        if min(size) < patch_size:
            raise ValueError(f"img_size {size} is smaller than one patch ({patch_size})")
        if size[0] % patch_size or size[1] % patch_size:
            raise ValueError(f"img_size {size} is not a multiple of the patch size {patch_size}")
        head_dim(embed_dim, num_heads)
        super().__init__(
            img_size=size,
            patch_size=patch_size,
            in_chans=in_chans,
            num_classes=num_classes,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            init_values=init_values or None,
            drop_rate=drop_rate,
            pos_drop_rate=drop_rate,
            proj_drop_rate=drop_rate,
            attn_drop_rate=attn_drop_rate,
            drop_path_rate=drop_path_rate,
            dynamic_img_size=True,
            weight_init="skip",
        )
        init_vit_weights(self, self.pos_embed, self.cls_token, getattr(self, "dist_token", None))
        self.img_size = size
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.depth = depth
        self.grid_size = (size[0] // patch_size, size[1] // patch_size)
        self._register_load_state_dict_pre_hook(_rename_old_reducer_keys)
        # timm's own check is an assert; every path to the patches passes this hook.
        self.patch_embed.register_forward_pre_hook(_check_image_sides)
        if pool != "none":
            install(
                adapt(self),
                keep=keep,
                method=pool,
                carry=carry,
                reduce_at=reduce_at,
                unpool=unpool,
                **(pool_options or {}),
            )

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        classifier(self.embed_dim, num_classes)  # raises before the model changes
        super().reset_classifier(num_classes, global_pool)

    def forward_features(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """timm's, except that an empty batch ``[0, C, H, W]`` gives empty features
        ``[0, num_prefix_tokens, D]`` (timm's position embedding cannot reshape zero images),
        so ``forward`` returns empty logits ``[0, num_classes]``."""
        if x.shape[0] == 0:
            prefix = x.new_zeros(
                0, self.num_prefix_tokens, self.embed_dim, dtype=next(self.parameters()).dtype
            )
            return prefix
        return super().forward_features(x, *args, **kwargs)


class DistilledDeiT(DeiT, VisionTransformerDistilled):
    """DeiT with a distillation token: ``DeiT(distilled=True)`` builds one."""


def _check_image_sides(patch_embed: nn.Module, inputs: tuple[Any, ...]) -> None:
    """timm's PatchEmbed pre-hook: the check our own PatchEmbed makes, before timm's assert."""
    height, width = inputs[0].shape[-2:]
    check_image_sides(height, width, cast(tuple[int, int], patch_embed.patch_size))  # timm keeps a pair


def _rename_old_reducer_keys(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        match = _OLD_REDUCER_KEY.match(key[len(prefix) :])
        if match:
            rest = key[len(prefix) + match.end() :]
            state_dict[f"{prefix}token_pooling.reducers.{match.group(1)}.{rest}"] = state_dict.pop(key)


# --------------------------------------------------------------------------- presets

# The papers' shapes (224x224, patch 16, depth 12, mlp ratio 4). DeiT-e252/e318 are the
# Token Pooling paper's intermediate widths; it does not give their head counts, we use
# 4 heads (63 per head) and 6 heads (53 per head).
_FULL = dict(img_size=224, patch_size=16, depth=12, mlp_ratio=4.0)
_WIDTHS = {"tiny": (192, 3), "e252": (252, 4), "e318": (318, 6), "small": (384, 6)}
_IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
_CIFAR10 = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
# The bundled digits are normalised by the dataset itself (its training split's statistics).
_SELF_NORMALISED = ((0.0,), (1.0,))

# name -> (description, defaults, (mean, std)): one registry entry per preset.
PRESETS: dict[str, tuple[str, dict[str, Any], tuple[tuple[float, ...], tuple[float, ...]]]] = {}
for _name, (_dim, _heads) in _WIDTHS.items():
    PRESETS[f"deit_{_name}"] = (
        f"DeiT-{_name} (dim {_dim}, {_heads} heads), 224x224, patch 16",
        dict(embed_dim=_dim, num_heads=_heads, **_FULL),
        _IMAGENET,
    )
    PRESETS[f"deit_{_name}_p4_32"] = (
        f"DeiT-{_name} widths on 32x32 inputs, patch 4 (64 tokens + class token)",
        dict(embed_dim=_dim, num_heads=_heads, img_size=32, patch_size=4, depth=12, num_classes=10),
        _CIFAR10,
    )
PRESETS["deit_small_distilled"] = (
    "DeiT-S with a distillation token",
    dict(embed_dim=384, num_heads=6, distilled=True, **_FULL),
    _IMAGENET,
)
# Small enough to train on the bundled digits in a couple of minutes on 2 CPU cores.
PRESETS["deit_digits"] = (
    "6-layer DeiT (dim 96, 3 heads) on 32x32 digits, patch 4",
    dict(embed_dim=96, num_heads=3, depth=6, img_size=32, patch_size=4, num_classes=10, in_chans=1),
    _SELF_NORMALISED,
)
# Real photographs at DeiT-S's token count: 28x28 Fashion-MNIST at patch 2 gives 14x14 = 196
# patch tokens, so the Token Pooling paper's per-layer budgets apply unchanged.
PRESETS["deit_fashion"] = (
    "6-layer DeiT (dim 64, 2 heads) on 28x28 Fashion-MNIST, patch 2 (196 tokens + class token)",
    dict(embed_dim=64, num_heads=2, depth=6, img_size=28, patch_size=2, num_classes=10, in_chans=1),
    ((0.2860,), (0.3530,)),  # the fashion_mnist data set's normalisation
)
PRESETS["deit_test"] = (
    "tiny DeiT for tests (dim 32, 2 heads, depth 3, 16x16, patch 4)",
    dict(embed_dim=32, num_heads=2, depth=3, img_size=16, patch_size=4, num_classes=5),
    _SELF_NORMALISED,
)

for _name, (_description, _defaults, _) in PRESETS.items():
    register(_name, DeiT, family="deit", description=_description, tiny=_name == "deit_test", **_defaults)


# --------------------------------------------------------------------------- timm registry


def _pretrained_cfg(name: str) -> dict[str, Any]:
    _, defaults, (mean, std) = PRESETS[name]
    side = defaults.get("img_size", 224)
    return {
        "url": "",
        "input_size": (defaults.get("in_chans", 3), side, side),
        "mean": mean,
        "std": std,
        "num_classes": defaults.get("num_classes", 1000),
        "interpolation": "bicubic",
        "crop_pct": 1.0 if side < 224 else 0.875,
        "first_conv": "patch_embed.proj",
        "classifier": ("head", "head_dist") if defaults.get("distilled") else "head",
    }


# timm's register_model reads each architecture's pretrained cfg from this module's
# ``default_cfgs``; it is the only name timm looks for here.
default_cfgs = {name: _pretrained_cfg(name) for name in PRESETS}


def _timm_entrypoint(name: str) -> Any:
    def build(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        kwargs.pop("pretrained_cfg", None)
        kwargs.pop("pretrained_cfg_overlay", None)
        kwargs.pop("cache_dir", None)
        # pretrained=True loads the weights shipped with leanformer (and refuses a preset
        # without them, naming those that have them).
        model = create_model(name, pretrained=pretrained, **kwargs)
        cfg = dict(default_cfgs[name], architecture=name)
        model.pretrained_cfg = model.default_cfg = cfg  # type: ignore[assignment]
        return model

    build.__name__ = build.__qualname__ = name
    build.__module__ = __name__
    return build


def _register_in_timm() -> None:
    for name in PRESETS:
        if not timm.is_model(name):
            register_model(_timm_entrypoint(name))


_register_in_timm()
