"""The K-Medoids distance matrix: what the first product leaves unknown, and reveals."""

from __future__ import annotations

import pytest
import torch

from leanformer.ops.medoid_distances import MedoidDistances, medoids_first_order, split_point


def _tokens(b: int = 3, n: int = 21, c: int = 48, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, n, c, generator=g) * 3 + 1


def _reference(x: torch.Tensor) -> torch.Tensor:
    return torch.cdist(x.double(), x.double()) ** 2


def _medoid_pairs(b: int, n: int, k: int) -> torch.Tensor:
    """Mask of the pairs of two different initial medoids (positions < k)."""
    idx = torch.arange(n)
    pairs = (idx[:, None] < k) & (idx[None, :] < k) & (idx[:, None] != idx[None, :])
    return pairs.expand(b, n, n)


def _check_known(d: torch.Tensor, x: torch.Tensor, unknown: torch.Tensor) -> None:
    assert torch.equal(d, d.transpose(1, 2))  # bitwise: exact ties stay ties
    assert torch.equal(d.diagonal(dim1=1, dim2=2), torch.zeros(d.shape[:2]))
    assert torch.isinf(d[unknown]).all()
    torch.testing.assert_close(d.double()[~unknown], _reference(x)[~unknown], rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("k", [0, 1, 10, 20, 21])
def test_only_pairs_of_initial_medoids_are_left_unknown(k: int) -> None:
    x = _tokens()
    dists = MedoidDistances(x, k)
    _check_known(dists.matrix, x, _medoid_pairs(3, 21, k))
    assert torch.equal(dists.known, (torch.arange(21) >= k).expand(3, 21))


def test_products_skip_the_mirror_of_the_one_sided_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-medoids [K, N) against [0, s), then [s, N) against itself: nothing else, and
    every entry outside the medoid block is still known."""
    x = _tokens(b=2, n=70, c=8)
    k = 20
    s = split_point(k, 70)
    assert k < s < 70  # the split is in use at this size
    shapes: list[tuple[int, int]] = []
    real_bmm = torch.bmm

    def recording_bmm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        shapes.append((a.shape[1], b.shape[2]))
        return real_bmm(a, b, out=out)

    monkeypatch.setattr(torch, "bmm", recording_bmm)
    dists = MedoidDistances(x, k)
    assert shapes == [(70 - k, s), (70 - s, 70 - s)]
    _check_known(dists.matrix, x, _medoid_pairs(2, 70, k))


def test_split_point() -> None:
    assert split_point(98, 196) == 160  # the benchmark's layer: K + 49 rounded up to 16
    assert split_point(10, 21) == 16
    assert split_point(20, 21) == 21  # rounding reaches N: one product
    assert split_point(0, 8) == 8


def test_reveal_fills_the_rows_and_columns_asked_for() -> None:
    x = _tokens()
    k = 10
    dists = MedoidDistances(x, k)
    before = dists.matrix.clone()
    ask = torch.zeros(3, 21, dtype=torch.bool)
    ask[0, [2, 7]] = True  # two rows at once: their shared entry is computed twice
    ask[2, 4] = True
    ask[2, 15] = True  # a non-medoid: known already, nothing to do
    dists.reveal(ask)
    assert dists.known[0, [2, 7]].all() and dists.known[2, 4]
    # Example 2 may reveal a second row early (one product shape for the batch), no more.
    assert dists.known[0, :k].sum() == 2 and dists.known[2, :k].sum() <= 2
    assert not dists.known[1, :k].any()
    known = dists.known
    unknown = _medoid_pairs(3, 21, k) & ~known[:, :, None] & ~known[:, None, :]
    _check_known(dists.matrix, x, unknown)
    assert torch.equal(dists.matrix[1], before[1])  # an example that asked for nothing


def test_reveal_keeps_the_values_written_earlier() -> None:
    """An entry shared by two rows is written when the first is revealed, never again."""
    x = _tokens(b=1)
    dists = MedoidDistances(x, 10)
    first = torch.zeros(1, 21, dtype=torch.bool)
    first[0, 3] = True
    dists.reveal(first)
    dists.matrix[0, 3, 5] = dists.matrix[0, 5, 3] = 123.0  # a marker in place of that value
    second = torch.zeros(1, 21, dtype=torch.bool)
    second[0, 5] = True
    dists.reveal(second)
    assert dists.matrix[0, 5, 3] == 123.0 and dists.matrix[0, 3, 5] == 123.0


def test_rows_revealed_only_to_fill_the_batch_keep_their_values() -> None:
    """Example 1 needs one row while example 0 needs two: example 1 then recomputes a row
    it already has, which must not change any of that row's entries."""
    x = _tokens(b=2, n=8)
    dists = MedoidDistances(x, 3)
    first = torch.zeros(2, 8, dtype=torch.bool)
    first[1, :2] = True
    dists.reveal(first)
    marker = 1e6  # larger than any distance here, so a recomputed value would win a min
    dists.matrix[1, 0, 2] = dists.matrix[1, 2, 0] = marker
    dists.matrix[1, 1, 2] = dists.matrix[1, 2, 1] = marker
    second = torch.zeros(2, 8, dtype=torch.bool)
    second[0, :2] = True
    second[1, 2] = True
    dists.reveal(second)
    assert dists.known[0, :2].all() and dists.known[1, :3].all()
    for i, j in ((0, 2), (2, 0), (1, 2), (2, 1)):
        assert dists.matrix[1, i, j] == marker


def test_symmetric_even_when_the_product_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """A matrix product may round x_i.x_j and x_j.x_i differently: the matrix must stay
    bitwise symmetric anyway (ties between two members' costs depend on it). Simulated
    by a product that adds a little of each left-hand row's first feature."""
    real_bmm = torch.bmm

    def skewed_bmm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        result = real_bmm(a, b) + 1e-3 * a[..., :1]
        return result if out is None else out.copy_(result)

    monkeypatch.setattr(torch, "bmm", skewed_bmm)
    x = _tokens()
    dists = MedoidDistances(x, 10)
    ask = torch.zeros(3, 21, dtype=torch.bool)
    ask[:, [1, 4, 6]] = True  # three rows per example revealed together
    dists.reveal(ask)
    d = dists.matrix
    assert torch.equal(d, d.transpose(1, 2))
    assert torch.equal(d.diagonal(dim1=1, dim2=2), torch.zeros(3, 21))


def test_reveal_all_computes_everything_up_front() -> None:
    x = _tokens()
    dists = MedoidDistances(x, 12, reveal_all=True)
    _check_known(dists.matrix, x, torch.zeros(3, 21, 21, dtype=torch.bool))
    assert dists.known.all()
    before = dists.matrix.clone()
    dists.reveal(torch.ones(3, 21, dtype=torch.bool))  # nothing left to do
    assert torch.equal(dists.matrix, before)


def test_medoids_first_order() -> None:
    init = torch.tensor([[4, 0, 2], [1, 5, 3]])
    order = medoids_first_order(init, 6)
    assert order.tolist() == [[4, 0, 2, 1, 3, 5], [1, 5, 3, 0, 2, 4]]
