"""Datasets: bundled digits, local CIFAR-10 batches, image folders, the registry's errors."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from leanformer.data import build_dataset, list_datasets
from leanformer.data.sampler import GlobalBatchSampler
from leanformer.data.tensor_dataset import TensorImageDataset  # resolves a builder's annotation below


def test_digits_split_is_stratified_deterministic_and_normalised() -> None:
    train = build_dataset("digits", split="train")
    test = build_dataset("digits", split="test")
    assert len(train) + len(test) == 1797
    assert train.images.shape[1:] == (1, 32, 32) and train.info.num_classes == 10
    counts_train = torch.bincount(train.labels, minlength=10).double() / len(train)
    counts_test = torch.bincount(test.labels, minlength=10).double() / len(test)
    assert (counts_train - counts_test).abs().max() < 0.02  # stratified
    assert abs(train.images.mean().item()) < 1e-5 and abs(train.images.std().item() - 1) < 1e-3
    again = build_dataset("digits", split="test")
    assert torch.equal(again.images, test.images) and torch.equal(again.labels, test.labels)


def test_digits_options() -> None:
    ds = build_dataset("digits", split="test", img_size=16, channels=3)
    assert ds[0][0].shape == (3, 16, 16) and ds.info.in_chans == 3
    with pytest.raises(ValueError, match="img_size"):
        build_dataset("digits", split="train", img_size=4)
    with pytest.raises(ValueError, match="no option 'size'"):
        build_dataset("digits", split="train", size=16)
    with pytest.raises(ValueError, match="option test_fraction expects a number, got 'abc'"):
        build_dataset("digits", split="train", test_fraction="abc")
    with pytest.raises(ValueError, match=r"option img_size expects an integer, got 16\.5"):
        build_dataset("digits", split="train", img_size=16.5)


def test_unknown_dataset_and_split() -> None:
    with pytest.raises(ValueError, match="did you mean digits"):
        build_dataset("digit", split="train")
    with pytest.raises(ValueError, match="split"):
        build_dataset("digits", split="validation")
    with pytest.raises(TypeError, match="a dataset name must be a string, got None; known: "):
        build_dataset(None, split="train")  # type: ignore[arg-type]
    assert {"digits", "cifar10", "imagefolder"} <= set(list_datasets())


def _write_cifar(folder: Path, n: int = 4) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": list(range(n))}
        with (folder / name).open("wb") as handle:
            pickle.dump(entry, handle)


def test_cifar10_reads_local_batches(tmp_path: Path) -> None:
    _write_cifar(tmp_path / "cifar-10-batches-py")
    train = build_dataset("cifar10", split="train", root=str(tmp_path))
    test = build_dataset("cifar10", split="test", root=str(tmp_path / "cifar-10-batches-py"))
    assert len(train) == 20 and len(test) == 4
    assert train[0][0].shape == (3, 32, 32) and int(train[1][1]) == 1


def test_cifar10_missing_files_listed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data_batch_1.*never downloads"):
        build_dataset("cifar10", split="train", root=str(tmp_path))
    with pytest.raises(ValueError, match="root"):
        build_dataset("cifar10", split="train")


def test_imagefolder(tmp_path: Path) -> None:
    for split in ("train", "test"):
        for label, colour in (("cat", 10), ("dog", 200)):
            folder = tmp_path / split / label
            folder.mkdir(parents=True)
            for i in range(2):
                Image.fromarray(np.full((10, 12, 3), colour + i, dtype=np.uint8)).save(folder / f"{i}.png")
    ds = build_dataset("imagefolder", split="train", root=str(tmp_path), img_size=8)
    assert len(ds) == 4 and ds.info.num_classes == 2
    x, y = ds[3]
    assert x.shape == (3, 8, 8) and int(y) == 1
    with pytest.raises(ValueError, match="no class folders"):
        build_dataset("imagefolder", split="train", root=str(tmp_path / "train" / "cat"))


def test_imagefolder_root_named_by_a_number_stays_a_folder_name(tmp_path: Path, monkeypatch) -> None:
    """``--data-root 123`` names the folder "123", as a YAML ``root: "123"`` does."""
    from leanformer.config import load_config

    assert load_config(None, {"data.root": "123"}).data.root == "123"
    assert load_config(None, {"data.root": "null"}).data.root is None
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="root 123 is not a folder"):
        build_dataset("imagefolder", split="train", root="123")


def test_imagefolder_pixels_match_a_plain_pil_reference(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()  # a class with no images yet keeps its index
    (tmp_path / "c").mkdir()
    Image.fromarray(pixels).save(tmp_path / "a" / "0.png")
    Image.fromarray(pixels[::-1].copy()).save(tmp_path / "c" / "0.gif")
    (tmp_path / "c" / "notes.txt").write_text("not an image")
    ds = build_dataset("imagefolder", split="train", root=str(tmp_path), img_size=6)
    assert ds.info.num_classes == 3 and [int(y) for _, y in ds] == [0, 2]
    resized = Image.fromarray(pixels).resize((6, 6), Image.Resampling.BICUBIC)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    expected = torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0).permute(2, 0, 1)
    expected = (expected - mean[:, None, None]) / std[:, None, None]
    torch.testing.assert_close(ds[0][0], expected)
    (tmp_path / "empty" / "x").mkdir(parents=True)
    with pytest.raises(ValueError, match="no images"):
        build_dataset("imagefolder", split="train", root=str(tmp_path / "empty"), img_size=6)


def test_global_batches_split_across_ranks_exactly() -> None:
    single = list(GlobalBatchSampler(10, batch_size=4, shuffle=True, seed=3))
    ranks = [
        list(GlobalBatchSampler(10, batch_size=4, shuffle=True, seed=3, rank=r, world_size=2)) for r in (0, 1)
    ]
    assert [a + b for a, b in zip(*ranks)] == single
    assert len(single) == 2  # last partial batch dropped
    with pytest.raises(ValueError, match="divisible"):
        GlobalBatchSampler(10, batch_size=5, shuffle=False, world_size=2)


def test_options_of_a_builder_with_other_annotations_reach_it_unchanged() -> None:
    """Only plain scalars are checked; a tuple, say, is the builder's to check."""
    from leanformer.data.registry import _BUILDERS, DatasetInfo, register_dataset

    seen = {}

    @register_dataset("_test_tuple_option")
    def build(*, split: str, shape: tuple[int, int] = (2, 2), scale: float = 1.0) -> TensorImageDataset:
        seen.update(shape=shape, scale=scale)
        info = DatasetInfo(num_classes=2, in_chans=1, img_size=shape[0])
        return TensorImageDataset(torch.zeros(2, 1, *shape), torch.zeros(2, dtype=torch.long), info)

    try:
        build_dataset("_test_tuple_option", split="test", shape=[4, 4], scale=2)
        assert seen == {"shape": [4, 4], "scale": 2.0}
        with pytest.raises(ValueError, match="option scale expects a number, got 'big'"):
            build_dataset("_test_tuple_option", split="test", scale="big")
    finally:
        del _BUILDERS["_test_tuple_option"]
