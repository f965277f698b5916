"""Squared Euclidean distances between tokens, as the clusterings take them.

Distances come from one batched matrix product, ``|x|^2 + |y|^2 - 2 x.y``. That expansion
cancels badly when tokens sit far from the origin compared with their spread, so the
clusterings take it on tokens centred per example (:func:`centred`), which leaves the
distances unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pairwise_sq_dists(
    x: Tensor, y: Tensor | None = None, *, x_sq_norms: Tensor | None = None, y_sq_norms: Tensor | None = None
) -> Tensor:
    """Squared Euclidean distances ``[B, N, M]`` between ``x [B, N, C]`` and ``y [B, M, C]``.

    One batched matrix product (``|x|^2 + |y|^2 - 2 x.y``); clamped at 0 because rounding
    can make the expansion slightly negative for (near-)identical tokens. The expansion
    cancels badly when the tokens sit far from the origin compared with their spread:
    pass tokens centred per example (:func:`centred`), which leaves distances unchanged.
    ``x_sq_norms [B, N]``, ``y_sq_norms [B, M]``: ``|x|^2``, ``|y|^2`` when the caller has them.
    """
    xx = (x * x).sum(-1) if x_sq_norms is None else x_sq_norms
    if y is None:
        y, yy = x, xx
    else:
        yy = (y * y).sum(-1) if y_sq_norms is None else y_sq_norms
    # baddbmm fuses the -2 scale and the |y|^2 term into the one matrix product.
    d = torch.baddbmm(yy[:, None, :], x, y.transpose(1, 2), alpha=-2.0)
    return d.add_(xx[:, :, None]).clamp_min_(0.0)


def centred(x: Tensor) -> Tensor:
    """``x [B, N, C]`` minus each example's mean token, in float32 at least.

    Distances between tokens do not change, but their float32 rounding does: the
    expansion ``|x|^2 + |y|^2 - 2 x.y`` loses the digits of ``|x - y|^2`` that lie below
    the rounding of ``|x|^2``. Half-precision tokens are widened, so ``|x|^2`` cannot
    overflow either.
    """
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x - x.mean(dim=1, keepdim=True)


def token_sq_dists(x: Tensor) -> Tensor:
    """Squared distances ``[B, N, N]`` between the tokens of ``x [B, N, C]`` (centred).

    Exactly symmetric with a zero diagonal: the two members of an unweighted 2-token
    cluster then cost exactly the same as each other's medoid, and the tie goes to the
    lower index as in a per-example reference.
    """
    d = pairwise_sq_dists(x)
    d = torch.minimum(d, d.transpose(1, 2))
    d.diagonal(dim1=1, dim2=2).zero_()
    return d
