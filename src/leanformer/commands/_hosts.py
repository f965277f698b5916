"""``--timm-model`` / ``--hf-model``: third-party vision transformers for bench and eval.

A timm name is built by ``timm.create_model(name, pretrained=False, **opts)``; a Hugging
Face ``transformers`` class name (``ViTForImageClassification``, ``Dinov2Model``, ...)
from its default config with ``--opt`` overriding config fields. Nothing is downloaded:
weights are random unless ``--opt pretrained=true --opt pretrained_file=PATH`` (timm)
names a local file. ``--pool``/``--keep``/``--carry`` then apply
:func:`leanformer.apply_token_pooling` (carry defaults to on, as there).
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any

from torch import Tensor, nn


def add_host_arguments(parser: argparse.ArgumentParser | Any) -> None:
    parser.add_argument(
        "--timm-model", help="a timm ViT/DeiT name (random weights; --opt KEY=VALUE go to timm.create_model)"
    )
    parser.add_argument(
        "--hf-model",
        help="a Hugging Face transformers class, e.g. ViTForImageClassification, built from its "
        "default config (--opt KEY=VALUE override config fields); for bench also detr "
        "(DETR-R50, dense vs ENACT)",
    )


def host_name(args: argparse.Namespace) -> str | None:
    timm_name, hf_name = getattr(args, "timm_model", None), getattr(args, "hf_model", None)
    if timm_name and hf_name:
        raise ValueError("give --timm-model or --hf-model, not both")
    return f"timm:{timm_name}" if timm_name else f"hf:{hf_name}" if hf_name else None


class ClassifierLogits(nn.Module):
    """A ``transformers`` classifier seen as ``images [B, C, H, W] -> logits [B, classes]``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> Tensor:
        return self.model(pixel_values=images).logits


def _hf_model(name: str, options: dict[str, Any]) -> nn.Module:
    import transformers

    cls = getattr(transformers, name, None)
    config_cls = getattr(cls, "config_class", None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module) or config_cls is None:
        from leanformer.patch.transformers import supported_models

        close = difflib.get_close_matches(name, supported_models(), n=3)
        hint = (
            f"; did you mean {', '.join(close)}?"
            if close
            else f"; supported: {', '.join(supported_models())}"
        )
        raise ValueError(
            f"{name!r} is not a transformers model class (transformers {transformers.__version__}){hint}"
        )
    config = config_cls()
    unknown = [key for key in options if not hasattr(config, key)]
    if unknown:
        raise ValueError(f"{config_cls.__name__} has no field {', '.join(map(repr, unknown))}")
    for key, value in options.items():
        setattr(config, key, value)
    return _construct(f"{name} (transformers)", lambda: cls(config), options)


def _construct(name: str, build: Any, options: dict[str, Any]) -> nn.Module:
    """``build()``; a library's error on the options given (``hidden_size=-1`` reaching
    ``torch.empty``) becomes a ValueError naming the model and options: bad input, exit 2."""
    try:
        return build()
    except (RuntimeError, ValueError, TypeError, AssertionError, ZeroDivisionError) as err:
        given = ", ".join(f"{k}={v!r}" for k, v in options.items()) or "none"
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{name} cannot be built with the options {given}: {detail}") from None


def _timm_options(options: dict[str, Any]) -> dict[str, Any]:
    options = dict(options)
    path = options.pop("pretrained_file", None)
    if path is not None:
        options["pretrained_cfg_overlay"] = {"file": str(path)}
    return options


def build_host_model(
    args: argparse.Namespace, *, data: Any = None
) -> tuple[str, nn.Module, int, dict[str, Any]]:
    """``(name, model, input size, row fields)`` for ``--timm-model``/``--hf-model``.

    ``data`` (a dataset's info) fills the classes, channels and image size the options
    do not set. The model comes back patched when ``--pool`` is given.
    """
    name = host_name(args)
    assert name is not None
    if getattr(args, "pretrained", False):
        raise ValueError(
            "--pretrained loads the weights shipped with leanformer and goes with --model; a timm "
            "model takes its own from a local file (--opt pretrained=true --opt pretrained_file=PATH)"
        )
    options: dict[str, Any] = dict(args.opt)
    if name.startswith("timm:"):
        from leanformer.patch.timm import create_timm_model

        if data is not None:
            for key, value in (("num_classes", data.num_classes), ("in_chans", data.in_chans)):
                options.setdefault(key, value)
            if data.img_size is not None:
                options.setdefault("img_size", data.img_size)
        timm_options = _timm_options(options)
        model = _construct(f"{name[5:]} (timm)", lambda: create_timm_model(name[5:], **timm_options), options)
        patch_embed: Any = model.patch_embed
        size = int(patch_embed.img_size[0]) if patch_embed.img_size else 224
    else:
        if data is not None:
            for key, value in (("num_labels", data.num_classes), ("num_channels", data.in_chans)):
                options.setdefault(key, value)
            if data.img_size is not None:
                options.setdefault("image_size", data.img_size)
        model = _hf_model(name[3:], options)
        hf_config: Any = model.config
        size = int(hf_config.image_size)
    row: dict[str, Any] = {**options}
    if args.pool:
        import leanformer

        carry = True if args.carry is None else bool(args.carry)
        leanformer.apply_token_pooling(model, method=args.pool, keep=args.keep, carry=carry)
        row.update(pool=args.pool, keep=args.keep, carry=carry)
    elif args.keep is not None or args.carry:
        raise ValueError("--keep and --carry need --pool METHOD")
    return name, model, size, row
