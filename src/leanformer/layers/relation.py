"""Global and guided regional relation maps between two token sets (DRRT eqs. 3-9).

Shapes: ``a [B, N, d_A]`` (first input), ``b [B, M, d_B]`` (second input). A relation
map is ``[B, N, M]``: entry ``(i, j)`` relates ``a_i`` and ``b_j``. ``alpha`` is
normalised over ``j`` (it weights B's tokens for each ``a_i``, eq. 10), ``beta`` over
``i`` (it weights A's tokens for each ``b_j``, eq. 11).

Pairwise score forms ``Psi_ij``:

- ``"linear"``: the paper's literal ``W_g [W_a a_i; W_b b_j]``. It is a sum
  ``f(a_i) + g(b_j)``; ``softmax_j`` cancels ``f(a_i)``, so every row of ``alpha`` is the
  same distribution (and every column of ``beta``): the relation ignores the pairing.
  Kept for fidelity and for the test that documents this.
- ``"additive"`` (default): ``W_g tanh(W_a a_i + W_b b_j)``. This is the literal form with
  one hidden layer and a nonlinearity between the concatenation and ``W_g`` (a hidden
  layer on ``[W_a a_i; W_b b_j]`` is ``W_1 W_a a_i + W_2 W_b b_j``, the split folded into
  ``W_a``/``W_b``), i.e. additive attention. It keeps the paper's structure (project each
  side, combine, project to a scalar with ``W_g``) and is the smallest change that makes
  the score depend on the pair. Memory ``[B, N, M, d_rel]``.
- ``"dot"``: ``(W_a a_i) . (W_b b_j)``, the cheap bilinear alternative (``[B, N, M]``
  memory only), for large token counts.

Region labels: one integer per token, ``[N]`` (shared by the batch) or ``[B, N]``; a
label ``k`` in ``[0, K)`` puts the token in region ``k``, ``-1`` in none. Region pair
``k`` relates A's region ``k`` with B's region ``k`` (topographic correspondence).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from leanformer.layers.checks import check_positive

RelationForm = Literal["additive", "linear", "dot"]
RELATION_FORMS: tuple[str, ...] = get_args(RelationForm)


class PairScore(nn.Module):
    """``Psi_ij`` for all pairs: ``a [B, N, d_A], b [B, M, d_B] -> [B, N, M]``.

    ``W_a`` (``proj_a``), ``W_b`` (``proj_b``) and ``W_g`` (``score``) as in eq. 5 (or
    ``W_r`` in eq. 7: the regional module uses its own ``PairScore``).
    """

    def __init__(
        self, dim_a: int, dim_b: int, *, relation_dim: int | None = None, form: str = "additive"
    ) -> None:
        super().__init__()
        if form not in RELATION_FORMS:
            raise ValueError(f"unknown relation form {form!r}; choose from {', '.join(RELATION_FORMS)}")
        check_positive(optional=True, relation_dim=relation_dim)  # 0 is not "the default"
        d = relation_dim or min(dim_a, dim_b)
        self.form = form
        self.relation_dim = d
        self.proj_a = nn.Linear(dim_a, d)
        # One bias is enough: in every form a second one would be redundant with the first.
        self.proj_b = nn.Linear(dim_b, d, bias=False)
        # W_g acts on the concatenation (2d) in the literal form, on the d hidden units
        # in the additive one; the dot form needs none.
        self.score: nn.Linear | None = (
            nn.Linear(2 * d if form == "linear" else d, 1, bias=False) if form != "dot" else None
        )

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        pa, pb = self.proj_a(a), self.proj_b(b)  # [B, N, d], [B, M, d]
        if self.form == "dot":
            return pa @ pb.transpose(1, 2) / math.sqrt(self.relation_dim)
        assert self.score is not None
        w = self.score.weight[0]
        if self.form == "linear":
            # W_g [u; v] = w_u . u + w_v . v: computed as a broadcast sum, never concatenated.
            d = self.relation_dim
            return (pa @ w[:d])[:, :, None] + (pb @ w[d:])[:, None, :]
        return torch.tanh(pa[:, :, None, :] + pb[:, None, :, :]) @ w  # [B, N, M, d] @ [d]

    def extra_repr(self) -> str:
        return f"form={self.form}, relation_dim={self.relation_dim}"


class GlobalRelation(nn.Module):
    """Global relation maps (eqs. 3-5): ``(a, b) -> (alpha [B, N, M], beta [B, N, M])``.

    ``alpha = softmax_j(Psi / sqrt(d_B))`` (rows sum to 1), ``beta = softmax_i(Psi / sqrt(d_A))``
    (columns sum to 1), with ``d_A, d_B`` the feature widths of the two inputs.
    """

    def __init__(
        self, dim_a: int, dim_b: int, *, relation_dim: int | None = None, form: str = "additive"
    ) -> None:
        super().__init__()
        self.dim_a, self.dim_b = dim_a, dim_b
        self.pair = PairScore(dim_a, dim_b, relation_dim=relation_dim, form=form)

    def forward(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        _check_pair(a, b)
        psi = self.pair(a, b)
        alpha = torch.softmax(psi / math.sqrt(self.dim_b), dim=-1)
        beta = torch.softmax(psi / math.sqrt(self.dim_a), dim=-2)
        return alpha, beta


class RegionalRelation(nn.Module):
    """Guided regional relation maps (eqs. 6-9), ``K`` region pairs sharing one ``PairScore``.

    For region pair ``k``, ``R^k_ij = [label_a(i) == k and label_b(j) == k]`` and
    ``alpha^k = softmax_j(Psi masked to R^k) / C_r`` with ``C_r = sum_{i,j,k} R^k_ij / sqrt(d_B)``
    (``beta^k``: softmax over ``i``, ``sqrt(d_A)``). Pairs outside region ``k`` are masked out
    of the softmax (they get exactly zero weight) rather than given logit 0 as a literal
    ``R * Psi`` would; rows (columns) with no pair in region ``k`` are all zero. So each
    row of ``alpha^k`` for ``a_i`` in region ``k`` sums to ``1 / C_r``.

    ``forward`` returns the per-region maps ``[B, K, N, M]`` (and the masks); :meth:`summed` returns
    ``sum_k`` of them ``[B, N, M]`` without the ``K`` axis (regions are disjoint, so the
    sum is one softmax masked to same-label pairs), which is all eqs. 10-13 need when no
    recurrence runs on the maps.
    """

    def __init__(
        self,
        dim_a: int,
        dim_b: int,
        *,
        num_regions: int,
        relation_dim: int | None = None,
        form: str = "additive",
    ) -> None:
        super().__init__()
        check_positive(num_regions=num_regions)
        self.dim_a, self.dim_b = dim_a, dim_b
        self.num_regions = num_regions
        self.pair = PairScore(dim_a, dim_b, relation_dim=relation_dim, form=form)

    def forward(
        self, a: Tensor, b: Tensor, region_a: Tensor, region_b: Tensor, *, check_values: bool = True
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Per-region maps ``(alpha, beta)`` and the region-pair masks ``R``, each ``[B, K, N, M]``."""
        ra, rb = self._labels(a, b, region_a, region_b, check_values)
        mask = region_masks(ra, rb, self.num_regions)
        alpha, beta = self._maps(self.pair(a, b)[:, None], mask)
        return alpha, beta, mask

    def summed(
        self, a: Tensor, b: Tensor, region_a: Tensor, region_b: Tensor, *, check_values: bool = True
    ) -> tuple[Tensor, Tensor]:
        """``(sum_k alpha^k, sum_k beta^k)``, each ``[B, N, M]``."""
        ra, rb = self._labels(a, b, region_a, region_b, check_values)
        mask = (ra[:, :, None] == rb[:, None, :]) & (ra[:, :, None] >= 0)  # same region: [B, N, M]
        return self._maps(self.pair(a, b), mask)

    def _labels(
        self, a: Tensor, b: Tensor, region_a: Tensor, region_b: Tensor, check_values: bool
    ) -> tuple[Tensor, Tensor]:
        _check_pair(a, b)
        B = a.shape[0]
        ra = check_region_labels(
            region_a, a.shape[1], self.num_regions, "region_a", check_values=check_values
        )
        rb = check_region_labels(
            region_b, b.shape[1], self.num_regions, "region_b", check_values=check_values
        )
        for name, r in (("region_a", ra), ("region_b", rb)):
            if r.shape[0] not in (1, B):
                raise ValueError(f"{name} has labels for {r.shape[0]} examples but the batch has {B}")
        return ra.to(a.device).expand(B, -1), rb.to(a.device).expand(B, -1)

    def _maps(self, psi: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Masked softmaxes of ``psi`` (broadcast to ``mask``'s shape ``[..., N, M]``) over j and i."""
        # C_r per example: the number of region pairs over all k (eq. 9).
        count = mask.flatten(1).sum(-1).to(psi.dtype).clamp_min(1.0)
        extra = (1,) * (mask.ndim - 1)
        c_alpha = (count / math.sqrt(self.dim_b)).view(-1, *extra)
        c_beta = (count / math.sqrt(self.dim_a)).view(-1, *extra)
        # A finite fill (not -inf) keeps fully masked rows finite (uniform, then zeroed by
        # the mask) so no NaN reaches the backward pass.
        logits = torch.where(mask, psi, torch.finfo(psi.dtype).min)
        alpha = torch.softmax(logits, dim=-1) * mask / c_alpha
        beta = torch.softmax(logits, dim=-2) * mask / c_beta
        return alpha, beta


def region_masks(region_a: Tensor, region_b: Tensor, num_regions: int) -> Tensor:
    """``R^k_ij`` (eq. 8) as bool ``[B, K, N, M]`` from labels ``[B, N]`` and ``[B, M]``."""
    k = torch.arange(num_regions, device=region_a.device)
    in_a = region_a[:, None, :] == k[None, :, None]  # [B, K, N]
    in_b = region_b[:, None, :] == k[None, :, None]  # [B, K, M]
    return in_a[..., :, None] & in_b[..., None, :]


def region_pair_count(region_a: Tensor, region_b: Tensor, num_regions: int) -> Tensor:
    """``sum_{i,j,k} R^k_ij`` per example ``[B]`` from labels ``[B, N]``, ``[B, M]``."""
    k = torch.arange(num_regions, device=region_a.device)
    na = (region_a[..., None] == k).sum(-2)  # tokens of A per region [B, K]
    nb = (region_b[..., None] == k).sum(-2)
    return (na * nb).sum(-1)


def check_region_labels(
    labels: Tensor, num_tokens: int, num_regions: int, name: str, *, check_values: bool = True
) -> Tensor:
    """Validate region labels; returns them as ``[B or 1, N]`` int64.

    Shape and dtype checks are free; ``check_values`` also checks the range, which
    reads the values (a host sync on an accelerator): skip it for labels already checked.
    """
    if not isinstance(labels, Tensor):
        raise ValueError(f"{name} must be a tensor of integer region labels, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer region labels, got dtype {labels.dtype}")
    if labels.ndim not in (1, 2) or labels.shape[-1] != num_tokens:
        raise ValueError(
            f"{name} must have one label per token, shape [{num_tokens}] or [B, {num_tokens}]; "
            f"got shape {tuple(labels.shape)}"
        )
    if check_values and labels.numel():
        lo, hi = int(labels.min()), int(labels.max())
        if lo < -1 or hi >= num_regions:
            raise ValueError(
                f"{name} labels must be in [0, {num_regions}) (or -1 for none); got values in [{lo}, {hi}]"
            )
    labels = labels.long()
    return labels[None] if labels.ndim == 1 else labels


def _check_pair(a: Tensor, b: Tensor) -> None:
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0]:
        raise ValueError(
            f"expected token sets a [B, N, d_A] and b [B, M, d_B], got {tuple(a.shape)}, {tuple(b.shape)}"
        )


__all__ = [
    "RELATION_FORMS",
    "GlobalRelation",
    "PairScore",
    "RegionalRelation",
    "check_region_labels",
    "region_masks",
    "region_pair_count",
]
