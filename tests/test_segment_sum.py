"""segment_sum against a per-example loop, with empty segments, dtypes and gradients."""

from __future__ import annotations

import pytest
import torch

from leanformer.ops.segment_sum import segment_sum


def _ref(values: torch.Tensor, segment: torch.Tensor, s: int, weights: torch.Tensor | None) -> torch.Tensor:
    B, N, D = values.shape
    out = torch.zeros(B, s, D, dtype=values.dtype)
    for b in range(B):
        for i in range(N):
            w = 1.0 if weights is None else weights[b, i]
            out[b, segment[b, i]] += w * values[b, i]
    return out


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_loop_reference_with_empty_segments(weighted: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    B, N, D, S = 3, 11, 5, 7
    values = torch.randn(B, N, D, generator=g, dtype=dtype)
    segment = torch.randint(0, S - 2, (B, N), generator=g)  # the last two segments stay empty
    segment[1] = 3  # one example with a single segment
    weights = torch.rand(B, N, generator=g, dtype=dtype) if weighted else None
    out = segment_sum(values, segment, S, weights)
    assert out.shape == (B, S, D) and out.dtype == dtype
    torch.testing.assert_close(out, _ref(values, segment, S, weights))
    assert torch.equal(out[:, S - 2 :], torch.zeros(B, 2, D, dtype=dtype))


def test_non_contiguous_values() -> None:
    g = torch.Generator().manual_seed(1)
    values = torch.randn(2, 6, 8, generator=g)[:, :, ::2]
    segment = torch.randint(0, 3, (2, 6), generator=g)
    torch.testing.assert_close(segment_sum(values, segment, 3), _ref(values, segment, 3, None))


def test_gradcheck_values_and_weights() -> None:
    g = torch.Generator().manual_seed(2)
    values = torch.randn(2, 7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weights = (torch.rand(2, 7, generator=g, dtype=torch.float64) + 0.1).requires_grad_()
    segment = torch.randint(0, 4, (2, 7), generator=g)
    assert torch.autograd.gradcheck(lambda v, w: segment_sum(v, segment, 4, w), (values, weights))
