"""The Python API: misuse is a clear TypeError/ValueError; a NaN stays in its own image;
an empty batch gives an empty output."""

from __future__ import annotations

import pytest
import torch

import leanformer
from leanformer.pooling.registry import list_methods


@pytest.mark.parametrize("name", [None, 5, ["deit_test"]])
def test_create_model_needs_a_name(name: object) -> None:
    with pytest.raises(TypeError, match="create_model takes a model name"):
        leanformer.create_model(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", ["yes", "no", 1, None])
def test_pretrained_is_a_bool(flag: object) -> None:
    # "no" is truthy: accepting strings would load weights the caller declined.
    with pytest.raises(TypeError, match="pretrained must be True or False"):
        leanformer.create_model("deit_fashion", pretrained=flag)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", [m for m in list_methods() if m != "none"])
def test_a_nan_pixel_stays_in_its_own_image(method: str) -> None:
    """Every method: the clean images' outputs are what they are beside a clean image
    (K-Means/K-Medoids failed the whole batch), and the bad image's output is not finite."""
    torch.manual_seed(0)
    model = leanformer.create_model("deit_test", pool=method, keep=0.5).eval()
    images = torch.randn(3, 3, 16, 16)
    images[1, 0, 5, 7] = float("nan")
    repaired = images.clone()
    repaired[1] = 0.0
    with torch.no_grad():
        # The same batch size and seed: random methods draw the same numbers both times.
        torch.manual_seed(1)
        out = model(images)
        torch.manual_seed(1)
        clean = model(repaired)
    torch.testing.assert_close(out[[0, 2]], clean[[0, 2]], rtol=1e-5, atol=1e-5)
    assert not torch.isfinite(out[1]).all()


@pytest.mark.parametrize("options", [{}, {"pool": "wkmedoids", "keep": 0.5}, {"distilled": True}])
def test_an_empty_batch_gives_an_empty_output(options: dict) -> None:
    model = leanformer.create_model("deit_test", **options)
    for training in (False, True):
        model.train(training)
        out = model(torch.randn(0, 3, 16, 16))
        assert out.shape == (0, 5)
