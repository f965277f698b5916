"""ENACT entropy map and curvature signs."""

from __future__ import annotations

import math

import pytest
import torch

from leanformer.ops.entropy_map import (
    curvature_signs,
    entropy_from_logits,
    gaussian_smooth,
    is_top_left_rectangle,
    valid_extent,
)


def test_entropy_is_minus_p_log2_p_over_valid_positions():
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, False]])
    p = torch.softmax(logits[0, :3], dim=0)
    expected = torch.cat([-p * torch.log2(p), torch.zeros(1, dtype=torch.float64)])
    torch.testing.assert_close(entropy_from_logits(logits, valid)[0], expected)
    # total entropy of a uniform distribution over n positions is log2(n) bits
    torch.testing.assert_close(entropy_from_logits(torch.zeros(1, 8)).sum(), torch.tensor(3.0))


def test_entropy_gradient_is_finite_and_zero_at_padding():
    logits = torch.randn(2, 6, requires_grad=True)
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, 4:] = False
    (g,) = torch.autograd.grad(entropy_from_logits(logits, valid).pow(2).sum(), logits)
    assert torch.isfinite(g).all()
    assert (g[~valid] == 0).all() and (g[valid] != 0).any()


def slow_gaussian(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """2-D Gaussian with replicate borders, by explicit loops (radius ceil(3 sigma))."""
    r = max(1, math.ceil(3 * sigma))
    B, H, W = x.shape
    out = torch.zeros_like(x)
    for b in range(B):
        for i in range(H):
            for j in range(W):
                num = den = 0.0
                for di in range(-r, r + 1):
                    for dj in range(-r, r + 1):
                        g = math.exp(-(di * di + dj * dj) / (2 * sigma * sigma))
                        ii, jj = min(max(i + di, 0), H - 1), min(max(j + dj, 0), W - 1)
                        num += g * float(x[b, ii, jj])
                        den += g
                out[b, i, j] = num / den
    return out


def test_gaussian_smoothing_matches_loop_reference():
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    torch.testing.assert_close(gaussian_smooth(x, 1.0), slow_gaussian(x, 1.0))
    assert gaussian_smooth(x, 0.0) is x
    with pytest.raises(ValueError, match="sigma"):
        gaussian_smooth(x, -1.0)


def test_signs_of_known_curves():
    # concave along the row (a peak) -> True (+1); convex -> False (-1); flat -> -1 (zero side).
    j = torch.arange(9, dtype=torch.float64)
    peak = -((j - 4) ** 2)
    maps = torch.stack([peak.expand(3, 9), (-peak).expand(3, 9), torch.zeros(3, 9, dtype=torch.float64)])
    s = curvature_signs(maps, sigma=0.0)
    assert s[0, :, 1:-1].all()
    assert not s[1, :, 1:-1].any()
    assert not s[2].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sigma", [0.0, 1.0, 3.0, 10.0])
def test_a_flat_area_has_no_concave_positions_once_blurred(sigma: float, dtype: torch.dtype) -> None:
    # The exact curvature of a uniform area is 0 (the -1 side). Blurred, the filter's
    # weights do not cancel exactly in floating point, and a strict sign read rounding
    # noise as +1 at scattered positions (75 of a flat 25x34 map at sigma 3).
    flat = entropy_from_logits(torch.zeros(2, 25 * 34, dtype=dtype)).view(2, 25, 34)
    assert not curvature_signs(flat, sigma=sigma).any()
    if sigma > 3:
        return  # the filter reaches across the whole 34-column map
    # A uniform left part beside a varied right part: every position whose filter
    # reaches only the uniform columns is flat too, whatever lies beyond its reach.
    gen = torch.Generator().manual_seed(0)
    mixed = torch.rand(2, 25, 34, generator=gen, dtype=dtype)
    mixed[:, :, :20] = 0.0123
    reach = math.ceil(3 * sigma) + 1 if sigma > 0 else 1  # Gaussian radius + the [1, -2, 1]
    signs = curvature_signs(mixed, sigma=sigma)
    assert not signs[:, :, : 20 - reach].any()
    assert signs[:, :, 20 + reach :].any()  # the varied part still has concave positions


def test_padded_map_gets_the_signs_of_the_map_alone():
    gen = torch.Generator().manual_seed(0)
    H, W, hv, wv = 8, 9, 5, 7
    for sigma in (0.0, 1.0, 3.0):
        alone = torch.rand(1, hv, wv, generator=gen, dtype=torch.float64)
        padded = torch.rand(1, H, W, generator=gen, dtype=torch.float64) * 100  # garbage in the padding
        padded[0, :hv, :wv] = alone[0]
        valid = torch.zeros(1, H, W, dtype=torch.bool)
        valid[0, :hv, :wv] = True
        torch.testing.assert_close(
            curvature_signs(padded, sigma=sigma, valid=valid)[0, :hv, :wv],
            curvature_signs(alone, sigma=sigma)[0],
        )


def test_mask_rectangle_check():
    valid = torch.zeros(2, 4, 5, dtype=torch.bool)
    valid[0, :3, :4] = True
    valid[1] = True
    hv, wv = valid_extent(valid)
    assert hv.tolist() == [3, 4] and wv.tolist() == [4, 5]
    assert bool(is_top_left_rectangle(valid, hv, wv))
    valid[1, 0, 0] = False
    hv, wv = valid_extent(valid)
    assert not bool(is_top_left_rectangle(valid, hv, wv))
    with pytest.raises(ValueError, match="sigma"):
        curvature_signs(torch.zeros(1, 3, 3), sigma=-0.5)


def slow_sobel_xx(x: torch.Tensor) -> torch.Tensor:
    """Sobel d2/dx2 ([1,2,1] down x [1,-2,1] across) with replicate borders, by loops."""
    B, H, W = x.shape
    k = [[1, -2, 1], [2, -4, 2], [1, -2, 1]]
    out = torch.zeros_like(x)
    for b in range(B):
        for i in range(H):
            for j in range(W):
                acc = 0.0
                for di in (-1, 0, 1):
                    for dj in (-1, 0, 1):
                        ii, jj = min(max(i + di, 0), H - 1), min(max(j + dj, 0), W - 1)
                        acc += k[di + 1][dj + 1] * float(x[b, ii, jj])
                out[b, i, j] = acc
    return out


def test_second_derivative_matches_loop_reference_and_respects_extent():
    from leanformer.ops.entropy_map import second_derivative_x

    x = torch.randn(2, 4, 6, dtype=torch.float64)
    torch.testing.assert_close(second_derivative_x(x), slow_sobel_xx(x))
    valid = torch.zeros(2, 4, 6, dtype=torch.bool)
    valid[:, :3, :5] = True
    torch.testing.assert_close(second_derivative_x(x, valid)[:, :3, :5], slow_sobel_xx(x[:, :3, :5]))
