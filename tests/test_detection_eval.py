"""COCO box AP through pycocotools on hand-made predictions, with the numbers worked out by hand.

COCO interpolates precision at 101 recall points (0, 0.01, ..., 1) and averages them; with
boxes equal to the ground truth every IoU threshold gives the same AP, so AP = AP50 = AP75.
"""

from __future__ import annotations

import pytest
import torch

from leanformer.engine.detection_eval import coco_box_ap, coco_results

pytest.importorskip("pycocotools")


def ground_truth() -> dict:
    """Image 0: two garments of class 0 (a small one, 20x20, and a medium one, 40x40);
    image 1: one medium garment of class 3. No large object."""
    boxes = {
        1: (0, [10.0, 10.0, 30.0, 30.0], 0),
        2: (0, [50.0, 50.0, 90.0, 90.0], 0),
        3: (1, [5.0, 60.0, 45.0, 100.0], 3),
    }
    annotations = [
        {
            "id": key,
            "image_id": image,
            "category_id": label + 1,
            "bbox": [x0, y0, x1 - x0, y1 - y0],
            "area": (x1 - x0) * (y1 - y0),
            "iscrowd": 0,
        }
        for key, (image, (x0, y0, x1, y1), label) in boxes.items()
    ]
    images = [{"id": i, "width": 128, "height": 128} for i in (0, 1)]
    return {"images": images, "annotations": annotations, "categories": [{"id": c + 1} for c in range(10)]}


def prediction(image_id: int, boxes: list[list[float]], scores: list[float], labels: list[int]) -> dict:
    return {
        "image_id": image_id,
        "boxes": torch.tensor(boxes).reshape(-1, 4),
        "scores": torch.tensor(scores),
        "labels": torch.tensor(labels, dtype=torch.long),
    }


SMALL, MEDIUM, OTHER = [10.0, 10.0, 30.0, 30.0], [50.0, 50.0, 90.0, 90.0], [5.0, 60.0, 45.0, 100.0]


def test_perfect_predictions_score_one() -> None:
    metrics = coco_box_ap(
        ground_truth(),
        [prediction(0, [SMALL, MEDIUM], [0.9, 0.8], [0, 0]), prediction(1, [OTHER], [0.7], [3])],
    )
    assert metrics.pop("ap_large") is None  # no large object: COCO has no AP for that range
    assert metrics == pytest.approx({"ap": 1.0, "ap50": 1.0, "ap75": 1.0, "ap_small": 1.0, "ap_medium": 1.0})


def test_one_miss_halves_the_recall_of_its_class() -> None:
    # Class 0 (index 1 in COCO): only the medium garment found -> precision 1 up to recall 0.5,
    # none beyond: 51 of the 101 recall points -> 51/101. Class 3: perfect -> 1.
    # Small objects: the only one is missed -> 0; medium: both found -> 1.
    metrics = coco_box_ap(
        ground_truth(), [prediction(0, [MEDIUM], [0.9], [0]), prediction(1, [OTHER], [0.7], [3])]
    )
    expected = (51 / 101 + 1.0) / 2
    assert metrics["ap"] == pytest.approx(expected) and metrics["ap50"] == pytest.approx(expected)
    assert metrics["ap75"] == pytest.approx(expected)
    assert metrics["ap_small"] == 0.0 and metrics["ap_medium"] == pytest.approx(1.0)


def test_a_duplicate_ranked_between_two_hits_costs_precision() -> None:
    # Class 0 ranked: SMALL (hit, P=1, R=.5), SMALL again (duplicate: false positive, P=1/2),
    # MEDIUM (hit, P=2/3, R=1). Interpolated precision: 1 for recall <= .5 (51 points),
    # 2/3 above (50 points) -> (51 + 50 * 2/3) / 101. Class 3 perfect.
    preds = [
        prediction(0, [SMALL, SMALL, MEDIUM], [0.9, 0.8, 0.7], [0, 0, 0]),
        prediction(1, [OTHER], [0.7], [3]),
    ]
    class0 = (51 + 50 * 2 / 3) / 101
    metrics = coco_box_ap(ground_truth(), preds)
    assert metrics["ap"] == pytest.approx((class0 + 1.0) / 2)
    assert metrics["ap50"] == pytest.approx((class0 + 1.0) / 2)
    # A duplicate ranked below every hit costs nothing: precision at each recall is unchanged.
    late = [
        prediction(0, [SMALL, MEDIUM, SMALL], [0.9, 0.8, 0.7], [0, 0, 0]),
        prediction(1, [OTHER], [0.7], [3]),
    ]
    assert coco_box_ap(ground_truth(), late)["ap"] == pytest.approx(1.0)


def test_a_wrong_class_or_a_poor_box_scores_nothing_at_strict_thresholds() -> None:
    wrong_class = [prediction(0, [SMALL, MEDIUM], [0.9, 0.8], [1, 1]), prediction(1, [OTHER], [0.7], [2])]
    assert coco_box_ap(ground_truth(), wrong_class)["ap"] == 0.0
    # The other image's box shifted by 8 of its 40 pixels: IoU = 32*40 / (2*1600 - 1280) = 2/3,
    # a hit at IoU thresholds 0.5, 0.55, 0.6 and 0.65, a miss from 0.7 on (so at AP75).
    shifted = [OTHER[0] + 8, OTHER[1], OTHER[2] + 8, OTHER[3]]
    metrics = coco_box_ap(
        ground_truth(),
        [prediction(0, [SMALL, MEDIUM], [0.9, 0.8], [0, 0]), prediction(1, [shifted], [0.7], [3])],
    )
    assert metrics["ap50"] == pytest.approx(1.0)
    assert metrics["ap75"] == pytest.approx(0.5)  # class 0 perfect, class 3 missed
    assert metrics["ap"] == pytest.approx((1.0 + 4 / 10) / 2)  # class 3 hits at 4 of the 10 thresholds


def test_no_detections_scores_zero() -> None:
    assert coco_box_ap(ground_truth(), [prediction(0, [], [], [])])["ap"] == 0.0


def test_results_are_coco_boxes_with_one_based_categories() -> None:
    rows = coco_results([prediction(4, [[1.0, 2.0, 11.0, 7.0]], [0.5], [9])])
    assert rows == [{"image_id": 4, "category_id": 10, "bbox": [1.0, 2.0, 10.0, 5.0], "score": 0.5}]


def test_bad_predictions_are_refused() -> None:
    with pytest.raises(ValueError, match="2 boxes, 1 scores and 1 labels"):
        coco_results([prediction(0, [SMALL, MEDIUM], [0.9], [0])])
    with pytest.raises(ValueError, match="must be finite"):
        coco_results([prediction(0, [[0.0, 0.0, float("nan"), 1.0]], [0.9], [0])])
    with pytest.raises(ValueError, match=r"images not in the ground truth: \[7\]"):
        coco_box_ap(ground_truth(), [prediction(7, [SMALL], [0.9], [0])])


def test_a_dataset_without_boxes_is_refused(tmp_path) -> None:
    from leanformer.data import build_dataset
    from leanformer.engine.detection_eval import evaluate_detector
    from test_fashion_detect import write_fake_fashion

    write_fake_fashion(tmp_path)
    semantic = build_dataset(
        "fashion_detect", split="test", root=str(tmp_path), num_canvases=2, target="semantic"
    )
    with pytest.raises(ValueError, match="needs fashion_detect with target=detection"):
        evaluate_detector(torch.nn.Identity(), semantic, batch_size=2)
    detection = build_dataset("fashion_detect", split="test", root=str(tmp_path), num_canvases=2)
    with pytest.raises(ValueError, match="Identity is not a detector"):
        evaluate_detector(torch.nn.Identity(), detection, batch_size=2)
