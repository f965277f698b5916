"""``detr_fashion``: a small Conditional DETR (Meng et al., 2021) for ``fashion_detect`` canvases.

The detector is Hugging Face's ``ConditionalDetrForObjectDetection``, built offline from
its config: a timm ResNet-18 cut after its second stage (stride 8, so a 128-pixel canvas
gives the encoder a 16x16 map of 256 tokens), created with random weights (no download),
then a 3 + 3 layer transformer of width 128 with 20 queries. Its float32 weights are about
9.5 MB. Conditional DETR rather than DETR: it converges several times faster, which matters
when training on a CPU, and it is one of ENACT's three hosts in its paper.

DETR freezes its backbone's batch norms because it starts from ImageNet weights; this
backbone is trained from scratch, so they are ordinary (trainable) batch norms again.
``enact=True`` (``detr_fashion_enact``) puts ENACT in every encoder layer
(:func:`leanformer.patch.transformers.apply_enact`); the host's weights keep their names.
``attention_matrix="explicit"`` holds every attention's probabilities as tensors (the
host's ``eager`` attention, and ENACT's explicit matrix) instead of fused kernels: the
baseline of ENACT's training-memory claim.

``forward(images [B, C, H, W], targets=None)`` returns the host's output; given targets
(dicts of ``boxes [K, 4]`` x0, y0, x1, y1 in pixels and ``labels [K]``, as ``fashion_detect``
yields them), ``.loss`` is the host's Hungarian-matched loss. ``predict(images)`` gives one
``{"boxes", "scores", "labels"}`` per image, the format of :mod:`leanformer.engine.detection_eval`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from leanformer.layers.checks import check_positive, check_positive_number, check_rates, head_dim
from leanformer.layers.enact_attention import check_attention_matrix
from leanformer.models.registry import register

_TRANSFORMERS_HINT = "detr_fashion needs Hugging Face transformers: pip install 'leanformer[transformers]'"
BACKBONE_STRIDE = 8  # a ResNet's second stage


class DetrFashion(nn.Module):
    """Conditional DETR with a from-scratch ResNet-18 stem (stages 1-2), dense or ENACT encoder."""

    task = "detection"
    NUM_INPUTS = 1

    def __init__(
        self,
        *,
        num_classes: int = 10,
        in_chans: int = 1,
        img_size: int = 128,
        d_model: int = 128,
        encoder_layers: int = 3,
        decoder_layers: int = 3,
        num_heads: int = 4,
        dim_feedforward: int = 512,
        num_queries: int = 20,
        dropout: float = 0.0,
        max_detections: int = 100,
        enact: bool = False,
        sigma: float = 3.0,
        attention_matrix: str = "fused",
    ) -> None:
        super().__init__()
        check_positive(
            num_classes=num_classes,
            in_chans=in_chans,
            img_size=img_size,
            encoder_layers=encoder_layers,
            decoder_layers=decoder_layers,
            dim_feedforward=dim_feedforward,
            num_queries=num_queries,
            max_detections=max_detections,
        )
        head_dim(d_model, num_heads, dim_name="d_model")
        if d_model % 2:  # the sine position encoding splits the width between rows and columns
            raise ValueError(f"d_model must be even, got {d_model}")
        check_rates(dropout=dropout)
        check_positive_number(sigma=sigma)
        if img_size < 2 * BACKBONE_STRIDE:
            raise ValueError(f"img_size must be >= {2 * BACKBONE_STRIDE}, got {img_size}")
        try:
            from transformers import ConditionalDetrConfig, ConditionalDetrForObjectDetection
        except ImportError:
            raise ValueError(_TRANSFORMERS_HINT) from None
        self.num_classes, self.in_chans, self.img_size = num_classes, in_chans, img_size
        self.max_detections, self.enact = max_detections, enact
        backbone = {
            "model_type": "timm_backbone",
            "backbone": "resnet18",
            "num_channels": in_chans,
            "features_only": True,
            "use_pretrained_backbone": False,
            "out_indices": [2],  # stride 8
        }
        # num_labels is a field of every transformers config, taken through **kwargs.
        config = ConditionalDetrConfig(  # type: ignore[call-arg]
            backbone_config=backbone,
            num_channels=in_chans,
            num_labels=num_classes,
            d_model=d_model,
            encoder_layers=encoder_layers,
            decoder_layers=decoder_layers,
            encoder_attention_heads=num_heads,
            decoder_attention_heads=num_heads,
            encoder_ffn_dim=dim_feedforward,
            decoder_ffn_dim=dim_feedforward,
            num_queries=num_queries,
            dropout=dropout,
            auxiliary_loss=True,
        )
        check_attention_matrix(attention_matrix, name="attention_matrix")
        # Every attention of the host, and ENACT's (apply_enact follows the host): "explicit"
        # holds the probabilities as tensors, DETR's own code and ENACT's memory baseline.
        config._attn_implementation = "eager" if attention_matrix == "explicit" else "sdpa"
        # The ResNet backbone has no attention: left at sdpa, transformers does not warn that
        # timm ignores "eager".
        backbone_config: Any = config.backbone_config  # built from the dict above
        backbone_config._attn_implementation = "sdpa"
        self.detector: Any = ConditionalDetrForObjectDetection(config)
        _thaw_batch_norms(self.detector.model.backbone)
        if enact:
            from leanformer.patch.transformers import apply_enact

            apply_enact(self.detector, sigma=sigma)

    def example_inputs(self, batch_size: int, **_: Any) -> tuple[Tensor]:
        return (torch.randn(batch_size, self.in_chans, self.img_size, self.img_size),)

    def forward(self, images: Tensor, targets: list[dict[str, Tensor]] | None = None) -> Any:
        labels = None if targets is None else host_targets(targets, images.shape[-2:])
        return self.detector(pixel_values=images, labels=labels)

    @torch.no_grad()
    def predict(self, images: Tensor) -> list[dict[str, Tensor]]:
        """Per image, the ``max_detections`` best (query, class) pairs: ``boxes [D, 4]`` (x0, y0,
        x1, y1 in pixels), ``scores [D]`` (sigmoid class probabilities, as the host's
        focal loss trains them) and ``labels [D]``."""
        output = self.detector(pixel_values=images)
        return detections(output.logits, output.pred_boxes, images.shape[-2:], self.max_detections)


def host_targets(
    targets: list[dict[str, Tensor]], size: tuple[int, int] | torch.Size
) -> list[dict[str, Tensor]]:
    """Targets in pixels (``boxes`` x0, y0, x1, y1; ``labels``) as the host's loss takes them:
    ``class_labels`` and ``boxes`` (cx, cy, w, h) as fractions of the image."""
    H, W = size
    converted = []
    for target in targets:
        boxes = target["boxes"].float()
        if boxes.ndim != 2 or boxes.shape[-1] != 4 or len(boxes) != len(target["labels"]):
            raise ValueError(f"a target needs boxes [K, 4] and labels [K], got {tuple(boxes.shape)} boxes")
        scale = boxes.new_tensor([W, H, W, H])
        x0, y0, x1, y1 = (boxes / scale).unbind(-1)
        cxcywh = torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], dim=-1)
        converted.append({"class_labels": target["labels"].long(), "boxes": cxcywh})
    return converted


def detections(
    logits: Tensor, pred_boxes: Tensor, size: tuple[int, int] | torch.Size, max_detections: int
) -> list[dict[str, Tensor]]:
    """``logits [B, Q, C]`` and ``pred_boxes [B, Q, 4]`` (cx, cy, w, h fractions) -> per image the
    top ``max_detections`` (query, class) pairs by sigmoid score, boxes in pixels."""
    B, Q, C = logits.shape
    H, W = size
    scores, flat = logits.sigmoid().flatten(1).topk(min(max_detections, Q * C), dim=1)  # [B, D]
    query, label = flat // C, flat % C
    cx, cy, w, h = pred_boxes.gather(1, query[..., None].expand(-1, -1, 4)).unbind(-1)
    boxes = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)
    boxes = boxes * boxes.new_tensor([W, H, W, H])
    return [{"boxes": boxes[b], "scores": scores[b], "labels": label[b]} for b in range(B)]


def _thaw_batch_norms(module: nn.Module) -> None:
    """Replace the host's frozen batch norms (buffers only) by trainable ``nn.BatchNorm2d``."""
    for name, child in module.named_children():
        if type(child).__name__.endswith("FrozenBatchNorm2d"):
            weight: Tensor = child.weight  # type: ignore[assignment]  # a buffer of the frozen norm
            setattr(module, name, nn.BatchNorm2d(weight.shape[0]))
        else:
            _thaw_batch_norms(child)


register(
    "detr_fashion",
    DetrFashion,
    family="detr_fashion",
    description="Conditional DETR for fashion_detect: ResNet-18 stages 1-2 from scratch (16x16 map at "
    "128 px), 3+3 layers, d 128, 20 queries (transformers)",
)
register(
    "detr_fashion_enact",
    DetrFashion,
    family="detr_fashion",
    description="detr_fashion with ENACT in its encoder",
    enact=True,
)
register(
    "detr_fashion_test",
    DetrFashion,
    family="detr_fashion",
    tiny=True,
    description="tiny detr_fashion with ENACT for tests (64 px, d 32, 1+2 layers, 5 queries)",
    img_size=64,
    d_model=32,
    encoder_layers=1,
    decoder_layers=2,  # Conditional DETR's query scaling starts at its second decoder layer
    num_heads=4,
    dim_feedforward=64,
    num_queries=5,
    enact=True,
    sigma=1.0,
)
