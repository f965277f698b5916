"""fashion_pairs: the paired task of digits_pairs on Fashion-MNIST, on fake garments written
here as IDX files (no test needs the real data)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from leanformer import create_model
from leanformer.data import build_dataset, list_datasets
from leanformer.data.fashion_mnist import FILES
from leanformer.data.paired import paired_views, quadrant_labels
from leanformer.layers.pair_embed import ImagePatchTokens, grid_regions
from test_fashion_mnist import idx_bytes, write_fashion

N_TRAIN, N_TEST = 30, 12


@pytest.fixture
def garments(tmp_path: Path) -> tuple[str, dict]:
    """A folder of fake Fashion-MNIST files and the arrays written to it."""
    arrays = write_fashion(tmp_path / "fashion", n_train=N_TRAIN, n_test=N_TEST, gz=False)
    return str(tmp_path / "fashion"), arrays


def pairs(root: str, split: str, **options):
    return build_dataset("fashion_pairs", split=split, root=root, **options)


def test_registered() -> None:
    assert "fashion_pairs" in list_datasets()


def test_items_info_and_labels_in_file_order(garments) -> None:
    root, arrays = garments
    test = pairs(root, "test")
    (a, b), y = test[0]
    assert a.shape == (1, 28, 28) and b.shape == (49,) and y.dtype == torch.long
    assert test.info.num_classes == 10 and test.info.in_chans == 1 and test.info.img_size == 28
    assert test.info.inputs == 2
    assert test.labels.tolist() == arrays["test"][1].tolist()
    train = pairs(root, "train", validation=8)
    val = pairs(root, "val", validation=8)
    assert len(train) == N_TRAIN - 8 and len(val) == 8 and len(test) == N_TEST
    assert train.labels.tolist() + val.labels.tolist() == arrays["train"][1].tolist()


def test_validation_pairs_are_the_last_training_pairs(garments) -> None:
    """An image gets the same pair whatever N is: train + val (N=8) is the whole training set."""
    root, _ = garments
    whole = pairs(root, "train")
    train, val = pairs(root, "train", validation=8), pairs(root, "val", validation=8)
    assert torch.equal(torch.cat([train.a, val.a]), whole.a)
    assert torch.equal(torch.cat([train.b, val.b]), whole.b)
    # And the test pairs do not depend on it either.
    assert torch.equal(pairs(root, "test").a, pairs(root, "test", validation=8).a)


def test_deterministic_from_the_seed(garments) -> None:
    root, _ = garments
    one, two = pairs(root, "train"), pairs(root, "train")
    assert torch.equal(one.a, two.a) and torch.equal(one.b, two.b)
    other = pairs(root, "train", seed=1)
    assert not torch.equal(one.a, other.a) and not torch.equal(one.b, other.b)


def test_the_test_split_draws_noise_of_its_own(tmp_path: Path) -> None:
    """Test images identical to training images still get other noise and occlusions (one
    stream for both would make test pairs twins of training pairs)."""
    folder = tmp_path / "twins"
    arrays = write_fashion(folder, n_train=N_TRAIN, n_test=N_TEST, gz=False)
    images, labels = arrays["train"][0][:N_TEST], arrays["train"][1][:N_TEST]
    for stem, array in zip(FILES["test"], (images, labels)):
        (folder / stem).write_bytes(idx_bytes(array))
    quiet = dict(noise_a=0.0, occlude=0.0, noise_b=0.0)
    train, test = pairs(str(folder), "train", **quiet), pairs(str(folder), "test", **quiet)
    assert torch.equal(train.a[:N_TEST], test.a) and torch.equal(train.b[:N_TEST], test.b)
    train, test = pairs(str(folder), "train"), pairs(str(folder), "test")
    assert not torch.allclose(train.a[:N_TEST], test.a) and not torch.allclose(train.b[:N_TEST], test.b)


def test_point_grid_is_cell_means_standardised_on_the_training_images(garments) -> None:
    """Without noise, point (r, c) is the mean ink of its 4x4 cell, standardised with the
    mean and std of every training pair's points."""
    root, arrays = garments
    ink = {split: arrays[split][0].astype(np.float64) / 255.0 for split in ("train", "test")}
    ref = {
        split: np.array(
            [
                [[x[4 * r : 4 * r + 4, 4 * c : 4 * c + 4].mean() for c in range(7)] for r in range(7)]
                for x in images
            ]
        ).reshape(len(images), 49)
        for split, images in ink.items()
    }
    mean, std = ref["train"].mean(), ref["train"].std(ddof=1)
    val = pairs(root, "val", validation=5, noise_b=0.0)
    np.testing.assert_allclose(val.b.numpy(), (ref["train"][-5:] - mean) / std, atol=1e-4)
    test = pairs(root, "test", noise_b=0.0)
    np.testing.assert_allclose(test.b.numpy(), (ref["test"] - mean) / std, atol=1e-4)


def test_image_is_the_photograph_standardised(garments) -> None:
    root, arrays = garments
    clean = pairs(root, "test", noise_a=0.0, occlude=0.0).a[:, 0]
    pixels = torch.from_numpy(arrays["test"][0].astype(np.float32) / 255.0)
    train = torch.from_numpy(arrays["train"][0].astype(np.float32) / 255.0)
    torch.testing.assert_close(clean, (pixels - train.mean()) / train.std())


def test_occlusion_blanks_one_quadrant_of_a_garment() -> None:
    """The shared building block on 28x28 sources: an occluded image differs from the clean
    one in exactly one quadrant, which is black; about half are hit at occlude=0.5."""
    sources = torch.rand(64, 28, 28) + 0.1  # no black pixel of their own
    clean, _ = paired_views(sources, 28, 7, 0.0, 0.0, 0.0, torch.Generator().manual_seed(0))
    blanked, _ = paired_views(sources, 28, 7, 0.0, 1.0, 0.0, torch.Generator().manual_seed(0))
    quadrant = quadrant_labels(28, 28)
    for n in range(64):
        differs = [
            q for q in range(4) if not torch.equal(blanked[n, 0][quadrant == q], clean[n, 0][quadrant == q])
        ]
        assert len(differs) == 1, n
        assert bool((blanked[n, 0][quadrant == differs[0]] == 0).all()), n
    half, _ = paired_views(sources, 28, 7, 0.0, 0.5, 0.0, torch.Generator().manual_seed(0))
    hit = (half != clean).flatten(1).any(1).float().mean()
    assert 0.25 < hit < 0.75


def test_regions_match_the_drrt_fashion_defaults(garments) -> None:
    root, _ = garments
    ds = pairs(root, "test", return_regions=True)
    (_, _, ra, rb), _ = ds[2]
    assert ra.shape == (28, 28) and rb.shape == (49,)
    # The pixel map reduced to drrt_fashion's 4x4 patches gives its default token regions.
    ext = ImagePatchTokens(img_size=28, patch_size=4, in_chans=1, dim=4)
    assert ext.token_regions(ra, 4).tolist() == grid_regions((7, 7), (2, 2)).tolist()
    assert rb.tolist() == grid_regions((7, 7), (2, 2)).tolist()
    model = create_model("drrt_fashion")
    batch = [ds[i] for i in range(3)]
    inputs = [torch.stack([item[0][k] for item in batch]) for k in range(4)]
    assert model(*inputs).shape == (3, 10)
    # Without region maps, the model's own defaults serve: the same logits.
    torch.testing.assert_close(model.eval()(*inputs[:2]), model(*inputs))


def test_other_sizes_keep_the_pairing(garments) -> None:
    root, _ = garments
    ds = pairs(root, "test", img_size=32, points=4)
    (a, b), _ = ds[0]
    assert a.shape == (1, 32, 32) and b.shape == (16,) and ds.info.img_size == 32


def test_bad_options_are_one_line_errors(garments, tmp_path: Path) -> None:
    root, _ = garments
    with pytest.raises(ValueError, match=r"points must divide the 28x28 images \(2, 4, 7, 14 or 28\), got 5"):
        pairs(root, "train", points=5)
    with pytest.raises(ValueError, match="img_size must be even"):
        pairs(root, "train", img_size=27)
    with pytest.raises(ValueError, match="occlude in"):
        pairs(root, "train", occlude=-0.1)
    with pytest.raises(ValueError, match="split 'val' needs validation=N"):
        pairs(root, "val")
    with pytest.raises(ValueError, match=rf"validation must be in \[1, {N_TRAIN - 1}\]"):
        pairs(root, "train", validation=N_TRAIN)
    with pytest.raises(
        ValueError, match=r"Fashion-MNIST files not found.*apt-get install dataset-fashion-mnist"
    ):
        pairs(str(tmp_path / "nowhere"), "test")


def test_images_of_another_size_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "small"
    write_fashion(folder, n_train=4, n_test=2, gz=False)
    small = np.zeros((2, 20, 20), dtype=np.uint8)
    (folder / FILES["test"][0]).write_bytes(idx_bytes(small))
    assert len(pairs(str(folder), "train")) == 4
    with pytest.raises(ValueError, match=r"needs 28x28 images, the test file holds \(20, 20\)"):
        pairs(str(folder), "test")


def test_paired_views_draw_in_a_fixed_order() -> None:
    """The shared building block: same generator state, same views; points must divide."""
    sources = torch.rand(4, 28, 28)
    one = paired_views(sources, 28, 7, 0.3, 0.5, 0.15, torch.Generator().manual_seed(3))
    two = paired_views(sources, 28, 7, 0.3, 0.5, 0.15, torch.Generator().manual_seed(3))
    assert all(torch.equal(x, y) for x, y in zip(one, two))
    assert one[0].shape == (4, 1, 28, 28) and one[1].shape == (4, 49)
