"""The C++ segment sums (``segment_sum_cpu.cpp``): the sums of ``embedding_bag``, for
inference only, with clear errors and a warning when the package was built without them.
``test_segment_sum.py`` runs the reference tests with and without the kernel."""

from __future__ import annotations

import warnings

import pytest
import torch

from leanformer.ops import segment_sum_native
from leanformer.ops.native import KERNELS, MissingKernelWarning, use_kernel
from leanformer.ops.segment_sum import segment_sum
from native_kernels import without_kernel


def _embedding_bag_sums(monkeypatch, *args) -> torch.Tensor:
    with without_kernel(monkeypatch, segment_sum_native):
        return segment_sum(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_kernel_sums_as_embedding_bag(dtype: torch.dtype, monkeypatch) -> None:
    """The same sums in the same order (each example's rows in row order): equal to
    rounding, whatever the layout of the rows; empty segments are 0."""
    g = torch.Generator().manual_seed(5)
    full = torch.randn(6, 66, 40, generator=g, dtype=dtype)
    segment = torch.randint(0, 50, (6, 65), generator=g)
    weights = torch.rand(6, 65, generator=g, dtype=dtype)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-13, "atol": 1e-13}
    channels_strided = full.transpose(1, 2).contiguous().transpose(1, 2)
    overlapping = full[:1, 1:].expand(6, -1, -1)
    for values in (full[:, 1:], full[:, 1:].contiguous(), channels_strided[:, 1:], overlapping):
        for w in (weights, None):
            with torch.inference_mode():
                assert use_kernel(segment_sum_native.OP, values, segment, w)
                got = segment_sum(values, segment, 60, w)
            torch.testing.assert_close(got, _embedding_bag_sums(monkeypatch, values, segment, 60, w), **tol)
            assert torch.equal(got[:, 50:], torch.zeros_like(got[:, 50:]))


def test_the_kernel_is_for_inference_only() -> None:
    """Whatever needs a gradient, or is not a float32/64 CPU tensor, takes embedding_bag."""
    values, segment = torch.randn(2, 5, 3), torch.randint(0, 2, (2, 5))
    weights = torch.rand(2, 5)
    assert use_kernel(segment_sum_native.OP, values, segment, weights)
    assert not use_kernel(segment_sum_native.OP, values.requires_grad_(), segment, weights)
    with torch.no_grad():
        assert use_kernel(segment_sum_native.OP, values, segment, weights)
    assert not use_kernel(segment_sum_native.OP, values.detach(), segment, weights.requires_grad_())
    assert not use_kernel(segment_sum_native.OP, values.detach().half(), segment, None)
    assert not use_kernel(segment_sum_native.OP, values.detach(), segment.int(), None)
    assert not use_kernel(segment_sum_native.OP, values.detach().to("meta"), segment, None)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")  # forward AD's import
def test_what_a_kernel_cannot_see_takes_embedding_bag() -> None:
    """A forward-mode tangent is not dropped in silence (embedding_bag takes it, and says
    it has no forward AD); the imaginary part of a conjugate, whose values are stored
    negated, is read as its values."""
    import torch.autograd.forward_ad as forward_ad

    g = torch.Generator().manual_seed(6)
    values = torch.randn(2, 7, 4, generator=g)
    segment = torch.randint(0, 3, (2, 7), generator=g)
    weights = torch.rand(2, 7, generator=g)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(values, torch.randn_like(values))
        assert not use_kernel(segment_sum_native.OP, dual, segment, weights)
        with pytest.raises(NotImplementedError, match="forward AD"):
            segment_sum(dual, segment, 3, weights)
    negated = torch.complex(torch.zeros_like(values), values).conj().imag
    negated_weights = torch.complex(torch.zeros_like(weights), weights).conj().imag
    assert negated.is_neg() and negated_weights.is_neg()
    with torch.inference_mode():
        got = segment_sum(negated, segment, 3, negated_weights)
    torch.testing.assert_close(got, segment_sum(-values, segment, 3, -weights))


def test_the_kernel_refuses_bad_inputs_clearly() -> None:
    values, segment, weights = torch.randn(2, 5, 3), torch.randint(0, 2, (2, 5)), torch.rand(2, 5)
    for bad in (-1, 2):
        outside = segment.clone()
        outside[1, 4] = bad
        with pytest.raises(ValueError, match=r"segment ids must lie in \[0, S\) with S = 2"):
            segment_sum_native.segment_sum_on_cpu(values, outside, 2, weights)
    with pytest.raises(RuntimeError, match=r"weights must be \[B, N\]"):
        segment_sum_native.segment_sum_on_cpu(values, segment, 2, weights[:, 1:])
    with pytest.raises(RuntimeError, match=r"segments must be \[B, N\]"):
        segment_sum_native.segment_sum_on_cpu(values, segment[:1], 2, None)
    with pytest.raises(RuntimeError, match="must all be on one device"):
        segment_sum_native.segment_sum_on_cpu(values, segment, 2, weights.to("meta"))


def test_without_the_kernel_it_warns_once_and_sums_alike(monkeypatch) -> None:
    values, segment = torch.randn(2, 5, 3), torch.randint(0, 2, (2, 5))
    want = segment_sum(values, segment, 2)
    monkeypatch.setattr(KERNELS[segment_sum_native.OP], "extension", None)
    monkeypatch.setattr(KERNELS[segment_sum_native.OP], "warned", False)
    with pytest.warns(MissingKernelWarning, match="_segment_sum_cpu") as record:
        first = segment_sum(values, segment, 2)
    assert record[0].filename == __file__  # it points at the caller of segment_sum
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = segment_sum(values, segment, 2)
    torch.testing.assert_close(first, want)
    assert torch.equal(first, second)
