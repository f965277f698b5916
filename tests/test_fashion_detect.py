"""fashion_detect: canvases of fake garments checked against slow per-object references."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from leanformer.data import build_dataset
from leanformer.data.canvas import CanvasSpec, compose_canvases
from leanformer.data.fashion_detect import coco_ground_truth, collate_detection, uncompressed_rle


def fake_garments(n: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Bright blobs of random extent inside 28x28 tiles, with a faint fringe below the threshold."""
    gen = torch.Generator().manual_seed(seed)
    garments = torch.zeros(n, 28, 28, dtype=torch.uint8)
    for i in range(n):
        top, left = torch.randint(0, 8, (2,), generator=gen).tolist()
        h, w = torch.randint(10, 20, (2,), generator=gen).tolist()
        garments[i, top : top + h, left : left + w] = torch.randint(80, 256, (h, w), generator=gen).to(
            torch.uint8
        )
        garments[i, top + h : top + h + 1, left : left + w] = 10  # too faint to be the garment's own
    return garments, torch.arange(n) % 10


def reference_box(mask: torch.Tensor) -> list[float]:
    ys, xs = mask.nonzero(as_tuple=True)
    return [xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1]


def test_boxes_enclose_the_masks_tightly_and_every_pixel_has_one_owner() -> None:
    garments, classes = fake_garments()
    canvases = compose_canvases(garments, classes, num_canvases=40, seed=3)
    assert canvases.images.shape == (40, 128, 128) and canvases.labels.shape == (40, 6)
    objects = (canvases.labels >= 0).sum(dim=1)
    assert objects.min() >= 1 and objects.max() <= 6 and objects.float().mean() > 2
    for index in range(len(canvases)):
        boxes, labels, masks = canvases.instances(index)
        assert len(boxes) == len(labels) == len(masks) == objects[index]
        assert masks.sum(dim=0).max() <= 1  # instances never share a pixel
        for box, mask in zip(boxes, masks):
            assert mask.any()
            assert box.tolist() == reference_box(mask)
        # Pixels outside every garment are background (black); garment pixels are bright.
        covered = masks.any(dim=0)
        image = canvases.images[index]
        assert (image[~covered] == 0).all()
        assert (image[covered] > 0.1 * 255 - 1).all()


def test_semantic_map_is_the_class_of_the_visible_garment() -> None:
    garments, classes = fake_garments()
    canvases = compose_canvases(garments, classes, num_canvases=10, seed=1)
    for index in range(len(canvases)):
        _, labels, masks = canvases.instances(index)
        expected = torch.zeros(128, 128, dtype=torch.long)
        for label, mask in zip(labels, masks):
            expected[mask] = label + 1
        assert torch.equal(canvases.semantic(index), expected)


def test_without_overlap_the_garments_boxes_are_disjoint() -> None:
    garments, classes = fake_garments()
    spec = CanvasSpec(max_overlap=0.0)
    canvases = compose_canvases(garments, classes, num_canvases=30, seed=5, spec=spec)
    for index in range(len(canvases)):
        boxes, _, _ = canvases.instances(index)
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                a, b = boxes[i], boxes[j]
                iw = min(a[2], b[2]) - max(a[0], b[0])
                ih = min(a[3], b[3]) - max(a[1], b[1])
                assert iw <= 0 or ih <= 0


def test_canvases_depend_only_on_the_seed() -> None:
    garments, classes = fake_garments()
    a = compose_canvases(garments, classes, num_canvases=8, seed=7)
    b = compose_canvases(garments, classes, num_canvases=8, seed=7)
    c = compose_canvases(garments, classes, num_canvases=8, seed=8)
    assert torch.equal(a.images, b.images) and torch.equal(a.boxes, b.boxes) and torch.equal(a.owner, b.owner)
    assert not torch.equal(a.images, c.images)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (CanvasSpec(max_size=200), "exceeds the canvas size"),
        (CanvasSpec(min_size=30, max_size=20), "min_size"),
        (CanvasSpec(max_overlap=1.0), "max_overlap"),
        (CanvasSpec(max_objects=0), "max_objects"),
    ],
)
def test_bad_canvas_specs_are_refused(spec: CanvasSpec, message: str) -> None:
    garments, classes = fake_garments()
    with pytest.raises(ValueError, match=message):
        compose_canvases(garments, classes, num_canvases=2, seed=0, spec=spec)


def test_rle_decodes_to_the_mask() -> None:
    mask = torch.zeros(5, 4, dtype=torch.bool)
    mask[1:3, 2] = True
    mask[0, 0] = True
    # Column-major: column 0 = 1 0 0 0 0, column 1 = 0s, column 2 = 0 1 1 0 0, column 3 = 0s.
    assert uncompressed_rle(mask) == {"size": [5, 4], "counts": [0, 1, 10, 2, 7]}
    decoded = np.repeat([i % 2 for i in range(5)], [0, 1, 10, 2, 7]).reshape(4, 5).T
    assert np.array_equal(decoded, mask.numpy())


def _idx(array: np.ndarray) -> bytes:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_fake_fashion(folder: Path) -> None:
    garments, classes = fake_garments(16)
    for prefix in ("train", "t10k"):
        (folder / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(garments.numpy())))
        (folder / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx(classes.numpy())))


def test_registered_dataset_gives_detection_and_semantic_targets(tmp_path: Path) -> None:
    write_fake_fashion(tmp_path)
    ds = build_dataset("fashion_detect", split="train", root=str(tmp_path), num_canvases=6, seed=2)
    assert len(ds) == 6 and ds.info.task == "detection" and ds.info.num_classes == 10
    image, target = ds[0]
    assert image.shape == (1, 128, 128) and set(target) == {"boxes", "labels", "masks", "image_id"}
    images, targets = collate_detection([ds[0], ds[1]])
    assert images.shape == (2, 1, 128, 128) and [t["image_id"] for t in targets] == [0, 1]
    semantic = build_dataset(
        "fashion_detect", split="train", root=str(tmp_path), num_canvases=6, seed=2, target="semantic"
    )
    assert semantic.info.num_classes == 11 and semantic.info.task == "semantic"
    assert torch.equal(semantic[0][0], image) and semantic[0][1].shape == (128, 128)
    test = build_dataset("fashion_detect", split="test", root=str(tmp_path), num_canvases=6, seed=2)
    assert not torch.equal(test[0][0], image)  # another split draws other canvases
    with pytest.raises(ValueError, match="target must be one of"):
        build_dataset("fashion_detect", split="train", root=str(tmp_path), target="boxes")
    with pytest.raises(ValueError, match="num_canvases must be >= 1"):
        build_dataset("fashion_detect", split="train", root=str(tmp_path), num_canvases=0)
    with pytest.raises(ValueError, match="draws from training images 50001 on"):
        build_dataset("fashion_detect", split="val", root=str(tmp_path), num_canvases=2)


def test_coco_ground_truth_matches_the_instances(tmp_path: Path) -> None:
    write_fake_fashion(tmp_path)
    ds = build_dataset("fashion_detect", split="test", root=str(tmp_path), num_canvases=5)
    coco = coco_ground_truth(ds, masks=True)
    assert [image["id"] for image in coco["images"]] == list(range(5))
    assert len(coco["categories"]) == 10 and coco["categories"][0]["id"] == 1
    notes = [a for a in coco["annotations"] if a["image_id"] == 2]
    boxes, labels, masks = ds.canvases.instances(2)
    assert [a["category_id"] for a in notes] == (labels + 1).tolist()
    for note, box, mask in zip(notes, boxes.tolist(), masks):
        assert note["bbox"] == [box[0], box[1], box[2] - box[0], box[3] - box[1]]
        assert note["area"] == mask.sum().item()
    mask_api = pytest.importorskip("pycocotools.mask")
    rle = mask_api.frPyObjects(notes[0]["segmentation"], 128, 128)
    assert np.array_equal(mask_api.decode(rle).astype(bool), masks[0].numpy())
