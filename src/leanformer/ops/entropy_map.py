"""ENACT's entropy map and the sign of its curvature, per feature map.

Pipeline (shapes for a batch of ``B`` feature maps of ``H x W`` positions, ``N = H*W``):

1. ``entropy_from_logits``: one learned logit per position ``[B, N]`` -> softmax over the
   *valid* positions of each map -> per-position self-information term ``-p log2 p``
   (bits, as the public code; padding gets exactly 0).
2. ``curvature_signs``: optional Gaussian smoothing (``sigma``; 0 disables) on the 2-D
   grid, then a second-derivative Sobel filter, then the sign: ``True`` (+1) where the
   entropy is concave along the row (second derivative < 0, a ridge or peak), ``False``
   (-1) where it is convex *or flat*: a zero curvature goes to the -1 side, as in the
   public code's ``(step > 0) * 2 - 1``. "Zero" includes rounding noise: a curvature
   within a few epsilons of the filter's scale (``FLAT_EPS``), which is what a flat
   area gives once blurred, so a uniform area stays one region.

Padding follows DETR: every map's valid positions form a top-left rectangle of
``hv x wv`` positions (images are padded at the bottom and right). Every filter uses
replicate borders at the edge of that rectangle, so a padded map gives exactly the
signs the same map would give unpadded (batched equals per-image) and padded entries
are never read. The separable filters are applied as small per-map ``[H, H]`` and
``[W, W]`` matrices (:func:`border_conv_matrix`).

Kernel choice: regions are runs in row-major order, so what matters is the curvature
*along the row*. We use the Sobel second-derivative kernel ``d2/dx2`` (``[1, -2, 1]``
across, ``[1, 2, 1]`` smoothing down), the 2-D form of the public code's 1-D
``[-1, 2, -1]`` over the flattened sequence, without its wrap-around from one row's end
to the next row's start. (Adding the Sobel ``d2/dy2`` would cancel the direct
neighbours and leave a diagonal-only stencil.)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_LN2 = math.log(2.0)


def entropy_from_logits(logits: Tensor, valid: Tensor | None = None) -> Tensor:
    """Logits ``[B, N]`` -> entropy terms ``-p log2 p`` ``[B, N]`` with ``p = softmax`` over valid positions.

    ``valid [B, N]`` (bool, True = real position) excludes padding from the softmax;
    padded positions get entropy 0 and no gradient. Differentiable.
    """
    if valid is not None:
        logits = logits.masked_fill(~valid, float("-inf"))
    logp = logits.log_softmax(dim=-1)
    if valid is not None:
        # 0 * (-inf) would be NaN at padding; the where keeps both value and gradient finite.
        logp = torch.where(valid, logp, torch.zeros_like(logp))
    return -(logp.exp() * logp) / _LN2


def valid_extent(valid: Tensor) -> tuple[Tensor, Tensor]:
    """``valid [B, H, W]`` (top-left rectangles) -> valid rows ``hv [B]`` and columns ``wv [B]``."""
    return valid[:, :, 0].sum(dim=1), valid[:, 0, :].sum(dim=1)


def is_top_left_rectangle(valid: Tensor, hv: Tensor, wv: Tensor) -> Tensor:
    """0-d bool tensor: every map's valid positions are a non-empty top-left ``hv x wv`` rectangle.

    Returned as a tensor so the caller can fold it into a host sync it needs anyway.
    """
    _, H, W = valid.shape
    rows = torch.arange(H, device=valid.device)[None, :, None] < hv[:, None, None]
    cols = torch.arange(W, device=valid.device)[None, None, :] < wv[:, None, None]
    return (valid == (rows & cols)).all() & (hv > 0).all() & (wv > 0).all()


def border_conv_matrix(n: int, kernel: Tensor, extent: Tensor) -> Tensor:
    """1-D correlation with ``kernel [2r + 1]``, replicate borders at ``extent [B]``: matrices ``[B, n, n]``.

    Row ``i`` of map ``b`` holds the weights of
    ``y[i] = sum_t kernel[t] x[clamp(i + t - r, 0, extent_b - 1)]``: positions past the
    map's valid extent are never read, and the border is replicated exactly as if the map
    had only ``extent_b`` positions. Applying these matrices on both sides of an
    ``[H, W]`` map is a 2-D separable filter in two tiny batched matmuls (direct
    convolutions with one channel and a long kernel cost far more on CPU).
    """
    r = kernel.numel() // 2
    B = extent.shape[0]
    taps = torch.arange(-r, r + 1, device=extent.device)
    src = torch.arange(n, device=extent.device)[:, None] + taps[None, :]  # [n, T]
    src = torch.minimum(src.clamp(min=0)[None], (extent - 1).clamp(min=0)[:, None, None])  # [B, n, T]
    weights = kernel.to(extent.device)[None, None, :].expand(B, n, -1)
    return torch.zeros(B, n, n, dtype=kernel.dtype, device=extent.device).scatter_add_(2, src, weights)


MAX_SIGMA = 1000.0  # radius 3000 positions: far wider than any feature map, still a small kernel


def check_sigma(sigma: object) -> float:
    """``sigma`` as a float, or a ``ValueError``: it must be finite and in ``[0, MAX_SIGMA]``.

    The upper bound keeps the ``2 * ceil(3 sigma) + 1``-tap kernel allocatable; far below
    it the blur is already flat over any feature map.
    """
    try:
        value = float(sigma)  # type: ignore[arg-type]  # also numpy scalars and 0-dim tensors
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(sigma, bool | str) or not (math.isfinite(value) and 0 <= value <= MAX_SIGMA):
        raise ValueError(
            f"sigma must be a finite number in [0, {MAX_SIGMA:g}] (0 disables smoothing), got {sigma!r}"
        )
    return value


def gaussian_kernel1d(sigma: float, *, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Normalised 1-D Gaussian ``[2r + 1]`` with radius ``r = ceil(3 sigma)``."""
    radius = max(1, math.ceil(3.0 * sigma))
    t = torch.arange(-radius, radius + 1, dtype=dtype, device=device)
    g = torch.exp(-0.5 * (t / sigma) ** 2)
    return g / g.sum()


def _extents(x: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor]:
    B, H, W = x.shape
    if valid is not None:
        return valid_extent(valid)
    return torch.full((B,), H, device=x.device), torch.full((B,), W, device=x.device)


def _filters(
    x: Tensor, valid: Tensor | None, rows: list[Tensor], cols: list[Tensor]
) -> tuple[Tensor, Tensor]:
    """Products of border-conv matrices (first listed applied first): ``[B, H, H]`` and ``[B, W, W]``."""
    _, H, W = x.shape
    hv, wv = _extents(x, valid)
    P = Q = None
    for k in rows:
        M = border_conv_matrix(H, k, hv)
        P = M if P is None else M @ P
    for k in cols:
        M = border_conv_matrix(W, k, wv)
        Q = M if Q is None else M @ Q
    assert P is not None and Q is not None
    return P, Q


def gaussian_smooth(x: Tensor, sigma: float, valid: Tensor | None = None) -> Tensor:
    """Separable Gaussian blur of ``x [B, H, W]`` with replicate borders at each map's valid extent.

    ``sigma == 0`` is the identity.
    """
    if check_sigma(sigma) == 0:
        return x
    g = gaussian_kernel1d(sigma, dtype=x.dtype, device=x.device)
    P, Q = _filters(x, valid, [g], [g])
    return P @ x @ Q.transpose(1, 2)


# Sobel d2/dx2 = [1, 2, 1] (down) x [1, -2, 1] (across).
_SOBEL_SMOOTH = (1.0, 2.0, 1.0)
_SECOND_DIFF = (1.0, -2.0, 1.0)


def second_derivative_x(x: Tensor, valid: Tensor | None = None) -> Tensor:
    """Sobel ``d2/dx2`` of ``x [B, H, W]`` (replicate borders at each map's valid extent) -> ``[B, H, W]``."""
    smooth = torch.tensor(_SOBEL_SMOOTH, dtype=x.dtype, device=x.device)
    diff = torch.tensor(_SECOND_DIFF, dtype=x.dtype, device=x.device)
    P, Q = _filters(x, valid, [smooth], [diff])
    return P @ x @ Q.transpose(1, 2)


# A curvature smaller than this many epsilons of its rounding scale is taken as 0
# (see curvature_signs).
FLAT_EPS = 8.0


def curvature_signs(entropy: Tensor, *, sigma: float, valid: Tensor | None = None) -> Tensor:
    """Entropy map ``[B, H, W]`` -> curvature signs ``[B, H, W]`` (bool: True = +1, concave).

    ``valid [B, H, W]`` marks the real positions (a top-left rectangle per map); signs at
    padded positions are meaningless (they belong to no region). Not differentiable:
    gradients never flow through the discrete signs.
    """
    check_sigma(sigma)
    with torch.no_grad():
        e = entropy.detach()
        if valid is not None:
            e = e.masked_fill(~valid, 0.0)  # never read, but 0 * inf would still poison the matmul
        smooth = torch.tensor(_SOBEL_SMOOTH, dtype=e.dtype, device=e.device)
        diff = torch.tensor(_SECOND_DIFF, dtype=e.dtype, device=e.device)
        rows, cols = [smooth], [diff]
        if sigma > 0:
            g = gaussian_kernel1d(sigma, dtype=e.dtype, device=e.device)
            rows, cols = [g, smooth], [g, diff]
        # Blur then Sobel, both with replicate borders at the valid rectangle: one [H, H]
        # and one [W, W] matrix per map, so padded entries are never read.
        P, Q = _filters(e, valid, rows, cols)
        curvature = P @ e @ Q.transpose(1, 2)
        # Where the entropy is flat the exact curvature is 0, but the blurred filter's
        # weights do not cancel exactly in floating point: its sign would be rounding
        # noise, splitting a uniform area into spurious regions. A curvature within
        # rounding of zero counts as zero (the -1 side): below FLAT_EPS units of the
        # dtype's epsilon of the same filter applied to |e| with |weights| (what bounds
        # the rounding; flat maps measured at most 0.35 units).
        P_abs, Q_abs = _filters(e, valid, [k.abs() for k in rows], [k.abs() for k in cols])
        scale = P_abs @ e.abs() @ Q_abs.transpose(1, 2)
        return curvature < -(FLAT_EPS * torch.finfo(e.dtype).eps) * scale
