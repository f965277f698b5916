"""Sizes the machine cannot hold are refused before they are built, with the estimate and
the limit; normal sizes are not estimated at all."""

from __future__ import annotations

from pathlib import Path

import pytest

import leanformer
from leanformer.cli import main
from leanformer.memory_budget import (
    check_fits,
    check_image_pixels,
    estimate_parameters,
    has_large_option,
)
from leanformer.models.registry import model_info

Capture = pytest.CaptureFixture[str]


def test_check_fits_names_the_estimate_and_the_limit() -> None:
    check_fits(1e9, "this", available=lambda: int(2e9))
    check_fits(1e18, "this", available=lambda: None)  # unknown: not judged
    with pytest.raises(
        ValueError, match=r"this would need about 3\.0 GB .*than the 2\.0 GB this machine has"
    ):
        check_fits(3e9, "this", available=lambda: int(2e9))


@pytest.mark.parametrize("depth", [1, 3, 7])
def test_the_parameter_estimate_matches_the_built_model(depth: int) -> None:
    """Built on the meta device, a deep model extrapolated from one and two blocks: the
    count of the real model, exactly."""
    entry = model_info("deit_test")
    options = {**entry.defaults, "depth": depth}
    real = leanformer.create_model("deit_test", depth=depth)
    expected = sum(t.numel() for t in (*real.parameters(), *real.buffers()))
    assert estimate_parameters(entry.cls, options) == expected


def test_normal_options_are_not_estimated() -> None:
    assert not has_large_option(model_info("deit_small").defaults)
    assert has_large_option({"depth": 10**9}) and has_large_option({"embed_dims": [64, 4096]})


def test_a_model_too_large_for_the_machine_is_refused_before_it_is_built() -> None:
    with pytest.raises(ValueError, match=r"model deit_test with depth=1000000000 .* would need about"):
        leanformer.create_model("deit_test", depth=10**9)


def _one_line(argv: list[str], capsys: Capture) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_cli_refuses_sizes_that_would_exhaust_memory(tmp_path: Path, capsys: Capture) -> None:
    out = tmp_path / "run"
    err = _one_line(["train", "--model", "deit_test", "--opt", "depth=1000000000", "--out", str(out)], capsys)
    assert "would need about" in err and "this machine has available" in err
    assert not out.exists()
    err = _one_line(["bench", "--model", "deit_test", "--batch-size", "5000000"], capsys)
    assert "--batch-size 5000000" in err and "would need about" in err


def test_an_image_too_large_is_refused_before_it_is_decoded(tmp_path: Path, capsys: Capture) -> None:
    from PIL import Image

    with pytest.raises(ValueError, match="Mpx, more than the 64 Mpx"):
        check_image_pixels(9000, 9000, "an image")
    check_image_pixels(8000, 8000, "an image")
    big = tmp_path / "big.png"
    Image.new("1", (9000, 9000)).save(big)  # one bit per pixel: a small file, 81 Mpx decoded
    out = tmp_path / "maps"
    err = _one_line(["visualize", "enact", "--input", str(big), "--out", str(out)], capsys)
    assert "is 9000x9000 = 81 Mpx" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.png"]


def test_a_training_batch_too_large_is_refused_before_the_run_folder(tmp_path: Path, capsys: Capture) -> None:
    """Measured on one example: a training batch keeps its activations, an evaluation
    batch does not; either too large for the machine is refused, nothing written."""
    from leanformer.memory_budget import check_batch_fits

    seen: list[int] = []
    check_batch_fits(lambda: seen.append(1), input_bytes=10**9, batch_size=256, what="b")
    assert seen == []  # normal batches are not measured
    with pytest.raises(ValueError, match=r"^b 257 \(1000\.00 MB per example\) would need about 257\.0 GB"):
        check_batch_fits(
            lambda: seen.append(1), input_bytes=10**9, batch_size=257, what="b", available=lambda: 10**10
        )
    assert seen == [1]
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("model: deit_digits\ndata:\n  name: digits\n  eval_batch_size: 1000000000\n")
    err = _one_line(["train", "--config", str(config), "--out", str(out)], capsys)
    assert (
        err.startswith("leanformer: error: data.eval_batch_size 1000000000 (") and "would need about" in err
    )
    assert not out.exists()


def test_an_image_folder_refuses_a_huge_image_before_decoding_it(tmp_path: Path, capsys: Capture) -> None:
    from PIL import Image

    root = tmp_path / "images"
    (root / "cat").mkdir(parents=True)
    (root / "dog").mkdir()
    Image.new("RGB", (20, 20)).save(root / "dog" / "small.png")
    Image.new("1", (9000, 9000)).save(root / "cat" / "big.png")
    (root / "dog" / "broken.png").write_bytes(b"not an image")
    out = tmp_path / "run"
    argv = [
        "train",
        "--model",
        "deit_test",
        "--data",
        "imagefolder",
        "--data-root",
        str(root),
        "--out",
        str(out),
    ]
    err = _one_line([*argv, "--img-size", "16", "--batch-size", "2"], capsys)
    assert f"image {root / 'cat' / 'big.png'} is 9000x9000 = 81 Mpx" in err
    assert not out.exists()
    from leanformer.data.imagefolder import load_rgb

    with pytest.raises(ValueError, match=r"broken\.png cannot be read"):
        load_rgb(str(root / "dog" / "broken.png"))
    assert load_rgb(str(root / "dog" / "small.png")).size == (20, 20)
