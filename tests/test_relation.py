"""Global and guided regional relation maps (DRRT eqs. 3-9)."""

from __future__ import annotations

import math

import pytest
import torch

from leanformer.layers.relation import (
    GlobalRelation,
    PairScore,
    RegionalRelation,
    check_region_labels,
    region_pair_count,
)

FORMS = ["additive", "linear", "dot"]


def pair_reference(score: PairScore, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Psi_ij one pair at a time, with the concatenation of eq. 5 written out."""
    B, N, M = a.shape[0], a.shape[1], b.shape[1]
    out = torch.zeros(B, N, M, dtype=a.dtype)
    for n in range(B):
        for i in range(N):
            for j in range(M):
                u, v = score.proj_a(a[n, i]), score.proj_b(b[n, j])
                if score.form == "linear":
                    out[n, i, j] = score.score(torch.cat([u, v]))[0]
                elif score.form == "additive":
                    out[n, i, j] = score.score(torch.tanh(u + v))[0]
                else:
                    out[n, i, j] = u @ v / math.sqrt(score.relation_dim)
    return out


@pytest.fixture
def pair() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(2, 6, 8, dtype=torch.float64), torch.randn(2, 4, 5, dtype=torch.float64)


@pytest.mark.parametrize("form", FORMS)
def test_pair_score_matches_reference(form: str, pair) -> None:
    a, b = pair
    score = PairScore(8, 5, relation_dim=3, form=form).double()
    torch.testing.assert_close(score(a, b), pair_reference(score, a, b))


@pytest.mark.parametrize("form", FORMS)
def test_global_maps_match_eqs_3_4(form: str, pair) -> None:
    a, b = pair
    rel = GlobalRelation(8, 5, relation_dim=3, form=form).double()
    alpha, beta = rel(a, b)
    psi = pair_reference(rel.pair, a, b)
    torch.testing.assert_close(alpha, torch.softmax(psi / math.sqrt(5), dim=2))  # over j, d_B = 5
    torch.testing.assert_close(beta, torch.softmax(psi / math.sqrt(8), dim=1))  # over i, d_A = 8
    torch.testing.assert_close(alpha.sum(-1), torch.ones(2, 6, dtype=torch.float64))
    torch.testing.assert_close(beta.sum(-2), torch.ones(2, 4, dtype=torch.float64))


def test_literal_linear_form_is_degenerate(pair) -> None:
    """W_g[W_a a_i; W_b b_j] = f(a_i) + g(b_j): softmax over j drops f, all rows of alpha are equal."""
    a, b = pair
    alpha, beta = GlobalRelation(8, 5, form="linear").double()(a, b)
    torch.testing.assert_close(alpha, alpha[:, :1].expand_as(alpha))
    torch.testing.assert_close(beta, beta[:, :, :1].expand_as(beta))


@pytest.mark.parametrize("form", ["additive", "dot"])
def test_default_forms_are_not_degenerate(form: str, pair) -> None:
    a, b = pair
    alpha, beta = GlobalRelation(8, 5, form=form).double()(a, b)
    assert (alpha - alpha[:, :1]).abs().amax() > 1e-4
    assert (beta - beta[:, :, :1]).abs().amax() > 1e-4
    assert GlobalRelation(8, 5).pair.form == "additive"


# Two examples with different labels (the second shares nothing of region 1 on side b).
REGION_A = torch.tensor([[0, 0, 1, 1, 1, -1], [1, 0, 0, 0, 1, 1]])
REGION_B = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 1]])


def regional_reference(rel: RegionalRelation, a, b, ra, rb) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs. 6-9 with loops over examples, regions and rows/columns."""
    psi = pair_reference(rel.pair, a, b)
    B, N, M = psi.shape
    K = rel.num_regions
    alpha = torch.zeros(B, K, N, M, dtype=psi.dtype)
    beta = torch.zeros(B, K, N, M, dtype=psi.dtype)
    for n in range(B):
        count = sum(
            int(ra[n, i] == k and rb[n, j] == k) for k in range(K) for i in range(N) for j in range(M)
        )
        for k in range(K):
            cols = [j for j in range(M) if rb[n, j] == k]
            rows = [i for i in range(N) if ra[n, i] == k]
            for i in rows:
                if cols:
                    alpha[n, k, i, cols] = torch.softmax(psi[n, i, cols], 0) / (count / math.sqrt(rel.dim_b))
            for j in cols:
                if rows:
                    beta[n, k, rows, j] = torch.softmax(psi[n, rows, j], 0) / (count / math.sqrt(rel.dim_a))
    return alpha, beta


@pytest.mark.parametrize("form", FORMS)
def test_regional_maps_match_reference(form: str, pair) -> None:
    a, b = pair
    rel = RegionalRelation(8, 5, num_regions=2, relation_dim=3, form=form).double()
    alpha, beta, mask = rel(a, b, REGION_A, REGION_B)
    ref_alpha, ref_beta = regional_reference(rel, a, b, REGION_A, REGION_B)
    torch.testing.assert_close(alpha, ref_alpha)
    torch.testing.assert_close(beta, ref_beta)
    # Zero weight on every pair outside region k, and only there (softmax weights are > 0).
    assert (alpha[~mask] == 0).all() and (beta[~mask] == 0).all()
    assert (alpha[mask] > 0).all() and (beta[mask] > 0).all()
    # The K-free summed form equals the sum of the per-region maps.
    s_alpha, s_beta = rel.summed(a, b, REGION_A, REGION_B)
    torch.testing.assert_close(s_alpha, alpha.sum(1))
    torch.testing.assert_close(s_beta, beta.sum(1))


def test_c_r_by_hand(pair) -> None:
    """Example 0: region 0 pairs 2x2, region 1 pairs 3x2 -> sum R = 10; d_B = 5, d_A = 8."""
    a, b = pair
    assert region_pair_count(REGION_A, REGION_B, 2).tolist() == [4 + 6, 3 * 3 + 3 * 1]
    rel = RegionalRelation(8, 5, num_regions=2).double()
    alpha, beta, _ = rel(a, b, REGION_A, REGION_B)
    c_alpha, c_beta = 10 / math.sqrt(5), 10 / math.sqrt(8)
    # Rows of alpha^k for a_i in region k sum to 1 / C_r; other rows are all zero.
    row_sums = alpha[0].sum(-1)  # [K, N]
    expected = torch.tensor([[1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0]], dtype=torch.float64) / c_alpha
    torch.testing.assert_close(row_sums, expected)
    col_sums = beta[0].sum(-2)  # [K, M]
    expected = torch.tensor([[1, 0, 0, 1], [0, 1, 1, 0]], dtype=torch.float64) / c_beta
    torch.testing.assert_close(col_sums, expected)


def test_masking_differs_from_literal_zero_logits(pair) -> None:
    """R * Psi would give outside pairs exp(0) weight; masking gives them none."""
    a, b = pair
    rel = RegionalRelation(8, 5, num_regions=2).double()
    alpha, _, mask = rel(a, b, REGION_A, REGION_B)
    psi = rel.pair(a, b)[:, None] * mask
    literal = torch.softmax(psi, -1)
    assert (literal[~mask] > 0).any()
    assert (alpha[~mask] == 0).all()


def test_gradients_finite_with_empty_regions(pair) -> None:
    """Unlabelled tokens (-1) and regions empty on one side give zero rows, not NaN."""
    a, b = (t.clone().requires_grad_() for t in pair)
    rel = RegionalRelation(8, 5, num_regions=3).double()
    alpha, beta, _ = rel(a, b, REGION_A, REGION_B)  # region 2 is empty everywhere
    assert alpha[:, 2].abs().sum() == 0
    (alpha.square().sum() + beta.square().sum()).backward()
    for t in (a.grad, b.grad, *(p.grad for p in rel.parameters())):
        assert t is not None and torch.isfinite(t).all() and t.abs().sum() > 0


def test_gradcheck_regional() -> None:
    torch.manual_seed(3)
    rel = RegionalRelation(3, 2, num_regions=2, relation_dim=2).double()
    a = torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, 3, 2, dtype=torch.float64, requires_grad=True)
    ra, rb = torch.tensor([0, 0, 1, -1]), torch.tensor([1, 0, 0])
    assert torch.autograd.gradcheck(lambda x, y: rel(x, y, ra, rb)[:2], (a, b))


def test_shared_labels_broadcast(pair) -> None:
    a, b = pair
    rel = RegionalRelation(8, 5, num_regions=2).double()
    shared = rel(a, b, REGION_A[0], REGION_B[0])
    batched = rel(a, b, REGION_A[0].expand(2, -1), REGION_B[0].expand(2, -1))
    for x, y in zip(shared, batched):
        torch.testing.assert_close(x, y)


def test_bad_region_labels(pair) -> None:
    a, b = pair
    rel = RegionalRelation(8, 5, num_regions=2)
    a, b = a.float(), b.float()
    with pytest.raises(ValueError, match=r"region_a labels must be in \[0, 2\).*\[0, 2\]"):
        rel(a, b, torch.tensor([0, 0, 1, 1, 2, 0]), REGION_B[0])
    with pytest.raises(ValueError, match=r"region_b labels must be in \[0, 2\).*\[-3, 1\]"):
        rel(a, b, REGION_A[0], torch.tensor([0, -3, 1, 1]))
    with pytest.raises(ValueError, match=r"region_a must have one label per token, shape \[6\]"):
        rel(a, b, torch.tensor([0, 1, 1]), REGION_B[0])
    with pytest.raises(ValueError, match=r"region_b must have one label per token, shape \[4\]"):
        rel(a, b, REGION_A, REGION_B[:, :3])
    with pytest.raises(ValueError, match="integer region labels"):
        rel(a, b, REGION_A.float(), REGION_B)
    with pytest.raises(ValueError, match="labels for 3 examples but the batch has 2"):
        rel(a, b, REGION_A[:1].expand(3, -1), REGION_B)
    with pytest.raises(ValueError, match="num_regions must be an integer >= 1"):
        RegionalRelation(8, 5, num_regions=0)
    with pytest.raises(ValueError, match="unknown relation form 'bilinear'"):
        GlobalRelation(8, 5, form="bilinear")
    with pytest.raises(ValueError, match="expected token sets"):
        GlobalRelation(8, 5)(a[0], b)
    # Skipping the value check is allowed only for labels checked before.
    assert check_region_labels(REGION_A, 6, 2, "r", check_values=False).shape == (2, 6)
