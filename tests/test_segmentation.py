"""Semantic segmentation: ``SegmentationScores`` against a pixel-by-pixel reference, and the
``segvit`` models (a DeiT with a head per patch) with and without token pooling.

The reference counts every pixel in Python loops; the scores must match it over several
batches, with an ignored label and absent classes. The model gives logits at every pixel,
trains every parameter, keeps every patch position under any reducer (``unpool``), equals
gathering the reduced tokens through the recorded map, and refuses pooling without it.
"""

from __future__ import annotations

import math

import pytest
import torch

import leanformer
from leanformer.engine.segmentation_eval import SegmentationScores


def _slow_iou(batches: list[tuple[torch.Tensor, torch.Tensor]], k: int, ignore: int | None) -> list[float]:
    tp, fp, fn = [0] * k, [0] * k, [0] * k
    for prediction, target in batches:
        for p, t in zip(prediction.flatten().tolist(), target.flatten().tolist(), strict=True):
            if t == ignore:
                continue
            if p == t:
                tp[t] += 1
            else:
                fp[p] += 1
                fn[t] += 1
    return [tp[c] / (tp[c] + fp[c] + fn[c]) if tp[c] + fp[c] + fn[c] else math.nan for c in range(k)]


def test_scores_match_a_pixel_by_pixel_count() -> None:
    g = torch.Generator().manual_seed(0)
    k = 5
    batches = []
    scores = SegmentationScores(k, ignore_index=255)
    for _ in range(3):
        target = torch.randint(0, k - 1, (2, 7, 9), generator=g)  # class 4 never in the target
        target[0, 0, :4] = 255
        logits = torch.randn(2, k, 7, 9, generator=g)
        logits[:, 3] -= 100  # class 3 never predicted
        scores.update(logits, target)
        batches.append((logits.argmax(1), target))
    expected = _slow_iou(batches, k, 255)
    got = scores.per_class_iou().tolist()
    for e, v in zip(expected, got, strict=True):
        assert (math.isnan(e) and math.isnan(v)) or abs(e - v) < 1e-12
    present = [e for e in expected if not math.isnan(e)]
    assert scores.mean_iou() == pytest.approx(100 * sum(present) / len(present))
    right = sum(int((p == t)[t != 255].sum()) for p, t in batches)
    counted = sum(int((t != 255).sum()) for _, t in batches)
    assert scores.pixel_accuracy() == pytest.approx(100 * right / counted)


def test_scores_refuse_bad_inputs() -> None:
    scores = SegmentationScores(3)
    with pytest.raises(ValueError, match="differ in shape"):
        scores.update(torch.zeros(2, 4, 4, dtype=torch.long), torch.zeros(2, 4, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="logits have 4 classes"):
        scores.update(torch.zeros(2, 4, 4, 4), torch.zeros(2, 4, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must lie in 0\.\.2"):
        scores.update(torch.full((1, 2, 2), 3), torch.zeros(1, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="num_classes must be an int >= 1"):
        SegmentationScores(0)
    assert math.isnan(SegmentationScores(2).mean_iou())


def test_segvit_predicts_every_pixel_and_trains_every_parameter() -> None:
    torch.manual_seed(0)
    model = leanformer.create_model("segvit_test").train()
    x = torch.randn(2, 1, 32, 32)
    logits = model(x)
    assert logits.shape == (2, 5, 32, 32) and torch.isfinite(logits).all()
    target = torch.randint(0, 5, (2, 32, 32))
    torch.nn.functional.cross_entropy(logits, target).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model(torch.randn(1, 1, 48, 32)).shape == (1, 5, 48, 32)  # another image size


@pytest.mark.parametrize("method", ["merge", "wkmedoids", "powerbert", "tome"])
def test_pooled_segvit_heads_every_position_the_token_it_went_into(method: str) -> None:
    torch.manual_seed(0)
    keep = {"r": 4} if method == "tome" else 0.5
    model = leanformer.create_model("segvit_test", pool=method, keep=keep).eval()
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        dense = model.forward_features(x)
        pooling = model.token_pooling
        pooling.unpool_output, pooling.trace_source = False, True
        reduced = model.forward_features(x)
        assign = pooling.assignment(fill=True)
        pooling.unpool_output, pooling.trace_source = True, False
        logits = model(x)
    assert reduced.shape[1] < dense.shape[1] == 1 + 16
    gathered = torch.stack([reduced[b, assign[b]] for b in range(2)])
    torch.testing.assert_close(dense, gathered, rtol=0, atol=1e-6)
    assert logits.shape == (2, 5, 32, 32)


def test_segvit_refuses_pooling_without_unpooling() -> None:
    with pytest.raises(ValueError, match="needs unpool=True"):
        leanformer.create_model("segvit_test", pool="merge", keep=0.5, unpool=False)
    model = leanformer.create_model("segvit_test", pool="merge", keep=0.5)
    model.token_pooling.unpool_output = False
    with pytest.raises(ValueError, match="needs all 16 patch positions"):
        model(torch.randn(1, 1, 32, 32))
