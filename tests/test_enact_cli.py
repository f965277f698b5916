"""`leanformer visualize enact` writes a PNG and reports the regions; bad options raise."""

from __future__ import annotations

import argparse

import pytest

from leanformer.apps import enact_maps
from leanformer.commands import visualize_enact


def args(tmp_path, **kw):
    parser = argparse.ArgumentParser()
    visualize_enact.add_arguments(parser)
    ns = parser.parse_args([])
    ns.json, ns.quiet, ns.seed, ns.device, ns.threads = True, True, 0, "cpu", None
    ns.out = str(tmp_path / "enact.png")
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_visualize_noise_writes_png(tmp_path):
    (row,) = visualize_enact.run(args(tmp_path, image="noise", stride=32))
    assert (tmp_path / "enact.png").stat().st_size > 1000
    assert row["feature_size"] == "12x16" and 1 <= row["regions"] <= row["positions"] == 192
    assert 0 < row["cluster_ratio"] <= 1


def test_visualize_bad_options(tmp_path):
    with pytest.raises(ValueError, match="power of 2"):
        visualize_enact.run(args(tmp_path, stride=12))
    with pytest.raises(ValueError, match="sigma"):
        visualize_enact.run(args(tmp_path, sigma=-1.0))
    with pytest.raises(ValueError, match="not a file"):
        visualize_enact.run(args(tmp_path, input=str(tmp_path / "missing.png")))


def test_command_offers_the_bundled_samples() -> None:
    assert set(visualize_enact._SAMPLES) == set(enact_maps.SAMPLES)
