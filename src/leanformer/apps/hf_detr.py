"""Dense vs ENACT in a Hugging Face DETR: encoder and whole-model time, peak memory, cluster ratio.

The detector is ``DetrForObjectDetection`` with a timm ResNet-50 (DETR-R50; ``dilation=True``
gives DC5, a map twice as large each way), built offline from its config with random
weights. The ENACT model is a deep copy with :func:`leanformer.patch.transformers.apply_enact`,
so both share every host weight. Inputs are the two photographs scikit-learn ships,
resized; every other image is smaller and padded at the bottom and right, as DETR
batches images of different sizes. Runs alternate between the two models
(:func:`time_interleaved`), so background load hits both alike.

Needs the ``transformers`` extra; ``leanformer bench`` imports this module only for
``--hf-model detr``, so the rest of the command works without it.
"""

from __future__ import annotations

import copy
import inspect
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_sample_image
from torch import Tensor, nn
from transformers import DetrConfig, DetrForObjectDetection

from leanformer.bench.memory import cpu_peak_mb
from leanformer.bench.timing import time_interleaved
from leanformer.patch.transformers import apply_enact
from leanformer.patch.transformers.detr import cluster_ratios

SCOPES = ("encoder_fwd", "encoder_train", "model_fwd")
_PHOTOS = ("china.jpg", "flower.jpg")
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def build_detr_pair(
    *, dilation: bool = False, sigma: float = 3.0, seed: int = 0, **config: Any
) -> tuple[nn.Module, nn.Module]:
    """A random-weight DETR-R50 (``config`` overrides ``DetrConfig``) and its ENACT copy, in eval mode."""
    # DetrConfig keeps unknown keyword arguments silently; a typo must not go unnoticed.
    # ``backbone`` and ``num_labels`` are taken through its **kwargs.
    known = {
        *inspect.signature(DetrConfig.__init__).parameters,
        *DetrConfig().to_dict(),
        "backbone",
        "num_labels",
    }
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"DetrConfig has no field {', '.join(unknown)}")
    options = {"backbone": "resnet50", **config}
    _check_backbone(options["backbone"])
    torch.manual_seed(seed)
    # transformers' signature omits the backbone keywords its config still reads from **kwargs.
    detr_config = DetrConfig(  # type: ignore[call-arg]
        use_timm_backbone=True, use_pretrained_backbone=False, dilation=dilation, **options
    )
    dense = DetrForObjectDetection(detr_config).eval()
    enact = apply_enact(copy.deepcopy(dense), sigma=sigma)
    return dense, enact


def _check_backbone(name: Any) -> None:
    """timm builds the backbone; an unknown name would fail inside transformers with a bare
    RuntimeError."""
    import difflib

    import timm

    if not isinstance(name, str) or not timm.is_model(name):
        close = difflib.get_close_matches(str(name), timm.list_models("resnet*"), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else " (a timm model name, e.g. resnet50)"
        raise ValueError(f"unknown DETR backbone {name!r}{hint}")


def photo_batch(batch_size: int, img_size: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """``pixel_values [B, 3, H, W]`` (ImageNet-normalised photos) and ``pixel_mask [B, H, W]`` (1 = real).

    Odd images are resized to 90% of each side and padded at the bottom and right.
    """
    H, W = img_size
    pixels = torch.zeros(batch_size, 3, H, W)
    mask = torch.zeros(batch_size, H, W, dtype=torch.long)
    mean = torch.tensor(_IMAGENET_MEAN)[:, None, None]
    std = torch.tensor(_IMAGENET_STD)[:, None, None]
    for b in range(batch_size):  # builds inputs once, outside anything timed
        photo = torch.from_numpy(load_sample_image(_PHOTOS[b % 2]).copy()).permute(2, 0, 1).float() / 255
        h, w = (H, W) if b % 2 == 0 else (int(0.9 * H), int(0.9 * W))
        resized = F.interpolate(photo[None], size=(h, w), mode="bilinear", align_corners=False)[0]
        pixels[b, :, :h, :w] = (resized - mean) / std
        mask[b, :h, :w] = 1
    return pixels, mask


def encoder_inputs(model: nn.Module, pixel_values: Tensor, pixel_mask: Tensor) -> dict[str, Any]:
    """The keyword arguments the model's encoder receives for these images (one forward, no grad)."""
    seen: dict[str, Any] = {}
    core: Any = model.model  # a transformers DetrModel
    encoder = core.encoder
    handle = encoder.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    try:
        with torch.no_grad():
            model(pixel_values=pixel_values, pixel_mask=pixel_mask)
    finally:
        handle.remove()
    keep = ("inputs_embeds", "attention_mask", "spatial_position_embeddings", "enact_spatial_shape")
    return {k: seen[k] for k in keep if k in seen}


def _scope_fn(
    model: nn.Module, scope: str, pixels: Tensor, mask: Tensor, kw: dict[str, Any]
) -> Callable[[], None]:
    core: Any = model.model  # a transformers DetrModel
    encoder = core.encoder

    def encoder_fwd() -> None:
        with torch.inference_mode():
            encoder(**kw)

    def encoder_train() -> None:
        encoder(**kw).last_hidden_state.square().mean().backward()
        # Freed inside the call, so the measured peak holds the gradients as training would.
        encoder.zero_grad(set_to_none=True)

    def model_fwd() -> None:
        with torch.inference_mode():
            model(pixel_values=pixels, pixel_mask=mask)

    return {"encoder_fwd": encoder_fwd, "encoder_train": encoder_train, "model_fwd": model_fwd}[scope]


def compare_dense_enact(
    dense: nn.Module,
    enact: nn.Module,
    pixel_values: Tensor,
    pixel_mask: Tensor,
    *,
    scopes: tuple[str, ...] = SCOPES,
    warmup: int = 1,
    runs: int = 5,
    memory: bool = True,
) -> list[dict[str, Any]]:
    """One row per scope: median ms of dense and ENACT, their ratio, peak MB, ENACT's cluster ratio."""
    unknown = set(scopes) - set(SCOPES)
    if unknown:
        raise ValueError(f"unknown scopes {sorted(unknown)}; choose from {', '.join(SCOPES)}")
    enact_kw = encoder_inputs(enact, pixel_values, pixel_mask)
    dense_kw = {k: v for k, v in enact_kw.items() if not k.startswith("enact_")}
    H, W = enact_kw["enact_spatial_shape"]
    ratios = cluster_ratios(enact)
    rows = []
    for scope in scopes:
        training = scope == "encoder_train"
        for m in (dense, enact):
            m.train(training)
        fns = {
            "dense": _scope_fn(dense, scope, pixel_values, pixel_mask, dense_kw),
            "enact": _scope_fn(enact, scope, pixel_values, pixel_mask, enact_kw),
        }
        t = time_interleaved(fns, warmup=warmup, runs=runs)
        row: dict[str, Any] = {
            "scope": scope,
            "feature_size": f"{H}x{W}",
            "batch_size": int(pixel_values.shape[0]),
            "dense_ms": round(t["dense"] * 1e3, 2),
            "enact_ms": round(t["enact"] * 1e3, 2),
            "time_ratio": round(t["enact"] / t["dense"], 3),
            "cluster_ratio": round(statistics.mean(ratios), 4),
            "cluster_ratio_per_layer": [round(r, 4) for r in ratios],
            "threads": torch.get_num_threads(),
        }
        if memory:
            md, me = cpu_peak_mb(fns["dense"]), cpu_peak_mb(fns["enact"])
            row.update(dense_mb=round(md, 1), enact_mb=round(me, 1), mem_ratio=round(me / md, 3))
        rows.append(row)
    for m in (dense, enact):
        m.eval()
    return rows
