"""Fashion-MNIST: the IDX reader (gzip and raw, every bad-file case) and the dataset, on tiny files
written here (no test needs the real data)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from leanformer.data import build_dataset
from leanformer.data.fashion_mnist import FILES, MEAN, STD, find_root
from leanformer.data.idx import IdxError, read_idx


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX encoding of a uint8 array, written out by hand from the format's definition."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_fashion(folder: Path, *, n_train: int = 12, n_test: int = 6, gz: bool = True) -> dict:
    """Four IDX files with known pixels and labels; returns them for comparison."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        arrays[split] = (images, labels)
        for stem, array in zip(FILES[split], (images, labels)):
            data = idx_bytes(array)
            if gz:
                (folder / f"{stem}.gz").write_bytes(gzip.compress(data))
            else:
                (folder / stem).write_bytes(data)
    return arrays


@pytest.mark.parametrize("gz", [True, False])
def test_idx_reader_round_trips_gzip_and_raw(tmp_path: Path, gz: bool) -> None:
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / "a.idx"
    path.write_bytes(gzip.compress(idx_bytes(array)) if gz else idx_bytes(array))
    assert np.array_equal(read_idx(path), array)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda b: b"\x08\x03" + b[2:], "bad magic number"),
        (lambda b: b[:2] + b"\x0d" + b[3:], "not unsigned bytes"),
        (lambda b: b[:3] + b"\x00", "0 dimensions"),
        (lambda b: b[:6], "truncated IDX header"),
        (lambda b: b[:-5], "truncated"),
        (lambda b: b + b"\x00", "trailing bytes"),
        (lambda b: b"", "bad magic number"),
    ],
)
def test_idx_reader_refuses_bad_files(tmp_path: Path, corrupt, message: str) -> None:
    good = idx_bytes(np.zeros((2, 3, 4), dtype=np.uint8))
    for gz in (False, True):
        path = tmp_path / f"bad{int(gz)}"
        data = corrupt(good)
        path.write_bytes(gzip.compress(data) if gz else data)
        with pytest.raises(IdxError, match=message):
            read_idx(path)


def test_idx_reader_refuses_truncated_gzip(tmp_path: Path) -> None:
    path = tmp_path / "cut.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.zeros((4, 4), dtype=np.uint8)))[:-10])
    with pytest.raises(IdxError, match="gzip"):
        read_idx(path)


@pytest.mark.parametrize("gz", [True, False])
def test_dataset_reads_pixels_labels_and_normalises(tmp_path: Path, gz: bool) -> None:
    arrays = write_fashion(tmp_path, gz=gz)
    train = build_dataset("fashion_mnist", split="train", root=str(tmp_path))
    test = build_dataset("fashion_mnist", split="test", root=str(tmp_path))
    assert len(train) == 12 and len(test) == 6 and train.info.num_classes == 10 and train.info.in_chans == 1
    images, labels = arrays["test"]
    expected = (torch.from_numpy(images).float() / 255 - MEAN) / STD
    torch.testing.assert_close(test.images[:, 0], expected)
    assert torch.equal(test.labels, torch.from_numpy(labels).long())


def test_validation_split_is_the_last_training_images(tmp_path: Path) -> None:
    arrays = write_fashion(tmp_path)
    fit = build_dataset("fashion_mnist", split="train", root=str(tmp_path), validation=4)
    val = build_dataset("fashion_mnist", split="val", root=str(tmp_path), validation=4)
    assert len(fit) == 8 and len(val) == 4
    assert torch.equal(val.labels, torch.from_numpy(arrays["train"][1][8:]).long())
    with pytest.raises(ValueError, match="validation=N"):
        build_dataset("fashion_mnist", split="val", root=str(tmp_path))
    with pytest.raises(ValueError, match="validation must be"):
        build_dataset("fashion_mnist", split="train", root=str(tmp_path), validation=12)
    with pytest.raises(ValueError, match="splits train, test"):
        build_dataset("digits", split="val")


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("validation", True, "validation expects an integer, got True"),
        ("validation", "abc", "validation expects an integer, got 'abc'"),
        ("validation", 20.7, "validation expects an integer, got 20.7"),
        ("augment", "maybe", "augment expects true/false, got 'maybe'"),
        ("augment", 1, "augment expects true/false, got 1"),
    ],
)
def test_options_of_the_wrong_type_are_refused(tmp_path: Path, option: str, value, message: str) -> None:
    """``validation: true`` would be read as one image and ``augment: maybe`` as on."""
    write_fashion(tmp_path)
    with pytest.raises(ValueError, match=f"dataset 'fashion_mnist': option {message}"):
        build_dataset("fashion_mnist", split="train", root=str(tmp_path), **{option: value})


def test_options_given_as_text_are_read_as_their_type(tmp_path: Path) -> None:
    """The command line gives text; it is read as the option's type, as a YAML file's value is."""
    write_fashion(tmp_path)
    fit = build_dataset("fashion_mnist", split="train", root=str(tmp_path), validation="4", augment="false")
    assert len(fit) == 8


def test_augmentation_shifts_and_flips_only_the_training_split(tmp_path: Path) -> None:
    write_fashion(tmp_path)
    plain = build_dataset("fashion_mnist", split="train", root=str(tmp_path))
    aug = build_dataset("fashion_mnist", split="train", root=str(tmp_path), augment=True)
    test = build_dataset("fashion_mnist", split="test", root=str(tmp_path), augment=True)
    assert isinstance(test, type(build_dataset("fashion_mnist", split="test", root=str(tmp_path))))
    torch.manual_seed(0)
    x, y = aug[3]
    assert y == plain[3][1] and x.shape == (1, 28, 28)
    # Each augmented image is one of the 2 x 5 x 5 flips and shifts of the original.
    background = -MEAN / STD
    padded = torch.nn.functional.pad(plain[3][0], (2, 2, 2, 2), value=background)
    candidates = [
        img[..., i : i + 28, j : j + 28]
        for img in (padded, padded.flip(-1))
        for i in range(5)
        for j in range(5)
    ]
    assert any(torch.equal(x, c) for c in candidates)
    draws = {aug[3][0].sum().item() for _ in range(20)}
    assert len(draws) > 1  # not a fixed transform


def test_bad_files_and_missing_files_give_clear_errors(tmp_path: Path, monkeypatch) -> None:
    write_fashion(tmp_path / "ok")
    # Image and label counts that differ.
    (tmp_path / "ok" / "t10k-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(idx_bytes(np.zeros(5, dtype=np.uint8)))
    )
    with pytest.raises(ValueError, match=r"6 images .* but 5 labels"):
        build_dataset("fashion_mnist", split="test", root=str(tmp_path / "ok"))
    # A corrupt file names itself.
    (tmp_path / "ok" / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"\x01\x02\x03\x04"))
    with pytest.raises(ValueError, match=r"bad Fashion-MNIST file: .*train-images"):
        build_dataset("fashion_mnist", split="train", root=str(tmp_path / "ok"))
    # Missing files: one error that says how to get them.
    with pytest.raises(ValueError, match="apt-get install dataset-fashion-mnist"):
        build_dataset("fashion_mnist", split="train", root=str(tmp_path / "empty"))


def test_default_root_follows_leanformer_data(tmp_path: Path, monkeypatch) -> None:
    write_fashion(tmp_path / "fashion-mnist")
    monkeypatch.setenv("LEANFORMER_DATA", str(tmp_path))
    assert find_root() == tmp_path / "fashion-mnist"
    assert len(build_dataset("fashion_mnist", split="test")) == 6
