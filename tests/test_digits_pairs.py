"""The digits_pairs task and the local paired_arrays loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leanformer.data import build_dataset, list_datasets
from leanformer.data.digits import digits_split
from leanformer.data.paired import paired_views, quadrant_labels
from leanformer.layers.pair_embed import ImagePatchTokens, grid_regions


def test_registered() -> None:
    assert {"digits_pairs", "paired_arrays"} <= set(list_datasets())


def test_items_and_info() -> None:
    ds = build_dataset("digits_pairs", split="test")
    (a, b), y = ds[0]
    assert a.shape == (1, 32, 32) and b.shape == (16,) and y.dtype == torch.long
    assert ds.info.num_classes == 10 and ds.info.in_chans == 1 and ds.info.img_size == 32
    assert len(ds) == 360 and len(build_dataset("digits_pairs", split="train")) == 1437
    # Same labels and order as the plain digits split.
    assert ds.labels.tolist() == digits_split(0.2, 0)[3].tolist()


def test_deterministic_and_splits_differ() -> None:
    one = build_dataset("digits_pairs", split="train")
    two = build_dataset("digits_pairs", split="train")
    assert torch.equal(one.a, two.a) and torch.equal(one.b, two.b)
    other_seed = build_dataset("digits_pairs", split="train", seed=1)
    assert not torch.equal(one.a, other_seed.a)
    # Test split: built independently of the train split's build (same result either way).
    assert torch.equal(
        build_dataset("digits_pairs", split="test").a, build_dataset("digits_pairs", split="test").a
    )


def test_point_grid_is_cell_means_of_the_scan() -> None:
    """Without noise, point (r, c) is the mean of the 2x2 cell of the 8x8 scan (then standardised)."""
    ds = build_dataset("digits_pairs", split="train", noise_b=0.0)
    x_train = digits_split(0.2, 0)[0]
    ref = np.zeros((len(x_train), 4, 4), dtype=np.float64)
    for n in range(len(x_train)):
        for r in range(4):
            for c in range(4):
                ref[n, r, c] = x_train[n, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2].mean()
    ref = (ref - ref.mean()) / ref.std(ddof=1)
    np.testing.assert_allclose(ds.b.numpy(), ref.reshape(len(x_train), 16), atol=1e-4)


def test_occlusion_blanks_exactly_one_quadrant() -> None:
    scans = torch.from_numpy(digits_split(0.2, 0)[1][:50])
    gen = torch.Generator().manual_seed(0)
    clean, _ = paired_views(scans, 32, 4, 0.0, 0.0, 0.0, gen)
    occluded, _ = paired_views(scans, 32, 4, 0.0, 1.0, 0.0, gen)
    quadrant = quadrant_labels(32, 32)
    for n in range(50):
        same = occluded[n, 0] == clean[n, 0]
        zero = occluded[n, 0] == 0
        blanked = [q for q in range(4) if bool(zero[quadrant == q].all())]
        kept = [q for q in range(4) if bool(same[quadrant == q].all())]
        assert len(set(blanked) | set(kept)) == 4 and len(kept) >= 3, n
    # About half the images are hit with occlude=0.5.
    half, _ = paired_views(scans, 32, 4, 0.0, 0.5, 0.0, torch.Generator().manual_seed(0))
    hit = (half != clean).flatten(1).any(1).float().mean()
    assert 0.25 < hit < 0.75


def test_regions_are_corresponding_quadrants() -> None:
    ds = build_dataset("digits_pairs", split="test", return_regions=True)
    (_, _, ra, rb), _ = ds[3]
    assert ra.shape == (32, 32) and rb.shape == (16,)
    # The image map, reduced to 4x4 patches as the model does, matches the model's defaults.
    ext = ImagePatchTokens(img_size=32, patch_size=4, in_chans=1, dim=4)
    assert ext.token_regions(ra, 4).tolist() == grid_regions((8, 8), (2, 2)).tolist()
    assert rb.tolist() == grid_regions((4, 4), (2, 2)).tolist()
    # Topographic correspondence: the top-left point and the top-left pixel share a region.
    assert ra[0, 0] == rb[0] == 0 and ra[31, 31] == rb[15] == 3


def test_trains_a_model_batch() -> None:
    from leanformer import create_model

    ds = build_dataset("digits_pairs", split="test", return_regions=True)
    batch = [ds[i] for i in range(3)]
    inputs = [torch.stack([item[0][k] for item in batch]) for k in range(4)]
    model = create_model("drt", dim=16, extractor_depth=0)
    assert model(*inputs).shape == (3, 10)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="points must divide"):
        build_dataset("digits_pairs", split="train", points=3)
    with pytest.raises(ValueError, match="img_size must be even"):
        build_dataset("digits_pairs", split="train", img_size=7)
    with pytest.raises(ValueError, match="occlude in"):
        build_dataset("digits_pairs", split="train", occlude=1.5)
    with pytest.raises(ValueError, match="has no option 'nois'"):
        build_dataset("digits_pairs", split="train", nois=0.1)


def write_npz(path, n: int = 20, **extra) -> None:
    rng = np.random.default_rng(0)
    np.savez(
        path,
        a=rng.normal(size=(n, 1, 8, 8)).astype(np.float32),
        b=rng.normal(size=(n, 6)).astype(np.float32),
        labels=np.arange(n) % 2,
        **extra,
    )


def test_paired_arrays_seeded_split_and_shared_regions(tmp_path) -> None:
    ra = np.zeros((8, 8), dtype=np.int64)
    ra[:, 4:] = 1
    write_npz(tmp_path / "p.npz", region_a=ra, region_b=np.array([0, 0, 0, 1, 1, 1]))
    train = build_dataset("paired_arrays", split="train", root=str(tmp_path / "p.npz"))
    test = build_dataset("paired_arrays", split="test", root=str(tmp_path / "p.npz"))
    assert len(train) == 16 and len(test) == 4
    assert train.info.num_classes == 2 and train.info.in_chans == 1 and train.info.img_size == 8
    (a, b, r_a, r_b), _ = train[0]
    assert (
        a.shape == (1, 8, 8)
        and b.shape == (6,)
        and r_a.shape == (8, 8)
        and r_b.tolist() == [0, 0, 0, 1, 1, 1]
    )
    all_a = torch.cat([train.a, test.a])
    assert torch.unique(all_a.flatten(1), dim=0).shape[0] == 20  # a partition of the examples


def test_paired_arrays_split_key_and_per_example_regions(tmp_path) -> None:
    split = np.array(["train"] * 15 + ["test"] * 5)
    write_npz(
        tmp_path / "p.npz",
        split=split,
        region_a=np.tile(np.arange(4), (20, 1)),  # per example, per token
        region_b=np.tile(np.array([0, 1, 2, 3, 0, 1]), (20, 1)),
    )
    test = build_dataset("paired_arrays", split="test", root=str(tmp_path / "p.npz"))
    assert len(test) == 5 and test.per_example_regions
    (_, _, r_a, r_b), _ = test[4]
    assert r_a.tolist() == [0, 1, 2, 3] and r_b.shape == (6,)


def test_paired_arrays_folder(tmp_path) -> None:
    write_npz(tmp_path / "train.npz", n=6)
    write_npz(tmp_path / "test.npz", n=4)
    assert len(build_dataset("paired_arrays", split="test", root=str(tmp_path))) == 4
    (_, _), _ = build_dataset("paired_arrays", split="train", root=str(tmp_path))[0]


def test_paired_arrays_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        build_dataset("paired_arrays", split="train", root=str(tmp_path / "missing.npz"))
    np.savez(tmp_path / "bad.npz", a=np.zeros((3, 2)), labels=np.zeros(3))
    with pytest.raises(ValueError, match=r"lacks array\(s\) b"):
        build_dataset("paired_arrays", split="train", root=str(tmp_path / "bad.npz"))
    np.savez(tmp_path / "len.npz", a=np.zeros((3, 2)), b=np.zeros((4, 2)), labels=np.zeros(3))
    with pytest.raises(ValueError, match="same length"):
        build_dataset("paired_arrays", split="train", root=str(tmp_path / "len.npz"))
    write_npz(tmp_path / "r.npz", region_a=np.zeros((8, 8), dtype=np.int64))
    with pytest.raises(ValueError, match="both region_a and region_b"):
        build_dataset("paired_arrays", split="train", root=str(tmp_path / "r.npz"))
    write_npz(tmp_path / "s.npz", split=np.array(["train"] * 19 + ["val"]))
    with pytest.raises(ValueError, match="'split' must hold"):
        build_dataset("paired_arrays", split="train", root=str(tmp_path / "s.npz"))
