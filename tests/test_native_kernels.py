"""What the C++ kernels share: the package was built with them (`make venv` builds them),
and the two clustering kernels refuse bad inputs with clear errors (the custom ops
themselves: ``test_kernel_ops.py``)."""

from __future__ import annotations

import importlib

import pytest
import torch

from leanformer.ops.native import KERNELS, kernel_available
from native_kernels import clustered


@pytest.mark.parametrize(
    ("wrapper", "extension"),
    [
        ("attention_native", "_attention_received_cpu"),
        ("kmedoids_native", "_kmedoids_cpu"),
        ("kmeans_native", "_kmeans_cpu"),
        ("segment_sum_native", "_segment_sum_cpu"),
    ],
)
def test_the_package_was_built_with_the_kernel(wrapper: str, extension: str) -> None:
    """A build that failed would otherwise show only as slower runs."""
    native = importlib.import_module(f"leanformer.ops.{wrapper}")
    assert kernel_available(native.OP), (
        f"leanformer.ops.{extension} is missing: reinstall with a C++ compiler "
        "(pip install --no-build-isolation -e .) and read the build's warnings"
    )


@pytest.mark.parametrize(
    ("wrapper", "what"), [("kmedoids_native", "K-Medoids"), ("kmeans_native", "K-Means")]
)
def test_clustering_kernels_refuse_bad_inputs_clearly(wrapper: str, what: str, monkeypatch) -> None:
    """Both take (tokens, weights, K starting tokens, iterations)."""
    native = importlib.import_module(f"leanformer.ops.{wrapper}")
    x, w = clustered(2, 10, 3, seed=0, dtype=torch.float32)
    start = w.topk(4, dim=1).indices
    with pytest.raises(RuntimeError, match="one floating type"):
        native.iterate_on_cpu(x, w.double(), start, 5)
    with pytest.raises(RuntimeError, match=r"weights must be \[B, N\]"):
        native.iterate_on_cpu(x, w[:, 1:], start, 5)
    with pytest.raises(RuntimeError, match="int64"):
        native.iterate_on_cpu(x, w, start.int(), 5)
    repeated = start.clone()
    repeated[0, 1] = repeated[0, 0]
    outside = start.clone()
    outside[1, 0] = 10
    for bad in (repeated, outside):
        with pytest.raises(ValueError, match="K distinct tokens"):
            native.iterate_on_cpu(x, w, bad, 5)
    nan = x.clone()
    nan[1, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="finite tokens and weights"):
        native.iterate_on_cpu(nan, w, start, 5)
    with pytest.raises(RuntimeError, match="must all be on one device"):
        native.iterate_on_cpu(x, w.to("meta"), start, 5)
    monkeypatch.setattr(KERNELS[native.OP], "extension", None)
    with pytest.raises(RuntimeError, match=f"without its C\\+\\+ {what} kernel"):
        native.iterate_on_cpu(x, w, start, 5)


@pytest.mark.parametrize("wrapper", ["kmedoids_native", "kmeans_native"])
def test_clustering_kernels_read_any_token_layout_as_its_contiguous_copy(wrapper: str) -> None:
    """A reducer gets ``x[:, 1:]`` of a block's output: rows contiguous, examples further
    apart than their rows. The kernels read such views in place and copy other layouts;
    every layout must give the plan of the contiguous tokens, bit for bit."""
    native = importlib.import_module(f"leanformer.ops.{wrapper}")
    full, w = clustered(3, 41, 6, seed=4, dtype=torch.float32)
    w = w[:, 1:].contiguous()
    start = w.topk(12, dim=1).indices
    layouts = {
        "without the first token": full[:, 1:],
        "channels strided": full.transpose(1, 2).contiguous().transpose(1, 2)[:, 1:],
        "examples overlapping": full[:1, 1:].expand(3, -1, -1),
    }
    for name, tokens in layouts.items():
        assert not tokens.is_contiguous()
        got = native.iterate_on_cpu(tokens, w, start, 5)
        want = native.iterate_on_cpu(tokens.contiguous(), w, start, 5)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), name
    # Stored negated (the imaginary part of a conjugate): read as its values.
    negated = torch.complex(torch.zeros_like(full), full).conj().imag[:, 1:]
    assert negated.is_neg()
    got = native.iterate_on_cpu(negated, w, start, 5)
    want = native.iterate_on_cpu(torch.neg(full[:, 1:]).contiguous(), w, start, 5)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), "negated view"
    # One example at an offset into its storage.
    one = native.iterate_on_cpu(full[1:2, 1:], w[1:2], start[1:2], 5)
    every = native.iterate_on_cpu(full[:, 1:].contiguous(), w, start, 5)
    for a, b in zip(one, every, strict=True):
        assert torch.equal(a, b[1:2])
