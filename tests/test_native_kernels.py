"""What the C++ kernels share: the package was built with them (`make venv` builds them),
and the two clustering kernels refuse bad inputs with clear errors."""

from __future__ import annotations

import importlib

import pytest
import torch

from native_kernels import clustered


@pytest.mark.parametrize(
    ("wrapper", "extension"),
    [
        ("attention_native", "_attention_received_cpu"),
        ("kmedoids_native", "_kmedoids_cpu"),
        ("kmeans_native", "_kmeans_cpu"),
    ],
)
def test_the_package_was_built_with_the_kernel(wrapper: str, extension: str) -> None:
    """A build that failed would otherwise show only as slower runs."""
    native = importlib.import_module(f"leanformer.ops.{wrapper}")
    assert native.kernel_available(), (
        f"leanformer.ops.{extension} is missing: reinstall with a C++ compiler "
        "(pip install --no-build-isolation -e .) and read the build's warnings"
    )


@pytest.mark.parametrize(
    ("wrapper", "what"), [("kmedoids_native", "K-Medoids"), ("kmeans_native", "K-Means")]
)
def test_clustering_kernels_refuse_bad_inputs_clearly(wrapper: str, what: str, monkeypatch) -> None:
    """Both take (tokens, their mean, weights, K starting tokens, iterations)."""
    native = importlib.import_module(f"leanformer.ops.{wrapper}")
    x, w = clustered(2, 10, 3, seed=0, dtype=torch.float32)
    mean, start = x.mean(dim=1), w.topk(4, dim=1).indices
    with pytest.raises(RuntimeError, match="one floating type"):
        native.iterate_on_cpu(x, mean, w.double(), start, 5)
    with pytest.raises(RuntimeError, match=r"mean must be \[B, C\]"):
        native.iterate_on_cpu(x, mean[:, 1:], w, start, 5)
    with pytest.raises(RuntimeError, match="int64"):
        native.iterate_on_cpu(x, mean, w, start.int(), 5)
    repeated = start.clone()
    repeated[0, 1] = repeated[0, 0]
    outside = start.clone()
    outside[1, 0] = 10
    for bad in (repeated, outside):
        with pytest.raises(ValueError, match="K distinct tokens"):
            native.iterate_on_cpu(x, mean, w, bad, 5)
    nan = x.clone()
    nan[1, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="finite tokens and weights"):
        native.iterate_on_cpu(nan, nan.mean(dim=1), w, start, 5)
    with pytest.raises(RuntimeError, match="must all be CPU tensors"):
        native.iterate_on_cpu(x, mean, w.to("meta"), start, 5)
    monkeypatch.setattr(native, "_kernel", None)
    with pytest.raises(RuntimeError, match=f"without its C\\+\\+ {what} kernel"):
        native.iterate_on_cpu(x, mean, w, start, 5)
