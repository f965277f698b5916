"""Score-based selection (top-K, random, importance) and ToMe-style bipartite merging."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from leanformer.ops.cluster_plan import weighted_segment_mean
from leanformer.ops.merging import bipartite_merge_plan
from leanformer.ops.token_selection import gather_tokens, importance_indices, random_indices, topk_indices


def test_topk_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(4, 11, generator=g)
    idx = topk_indices(scores, 5)
    for b in range(4):
        ranked = sorted(range(11), key=lambda i: -float(scores[b, i]))[:5]
        assert idx[b].tolist() == sorted(ranked)


def test_random_is_distinct_sorted_and_seeded() -> None:
    a = random_indices(3, 20, 7, generator=torch.Generator().manual_seed(1))
    b = random_indices(3, 20, 7, generator=torch.Generator().manual_seed(1))
    c = random_indices(3, 20, 7, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    for row in a.tolist():
        assert row == sorted(set(row)) and len(row) == 7 and all(0 <= i < 20 for i in row)


def _inclusion_probabilities(p: list[float], k: int) -> list[float]:
    """Exact P(token i is drawn) for k successive draws without replacement, by enumeration."""
    incl = [0.0] * len(p)
    for seq in itertools.permutations(range(len(p)), k):
        prob, left = 1.0, 1.0
        for i in seq:
            prob *= p[i] / left
            left -= p[i]
        for i in seq:
            incl[i] += prob
    return incl


@pytest.mark.parametrize("k", [1, 2])
def test_importance_sampling_follows_sequential_draws(k: int) -> None:
    p = [0.5, 0.3, 0.15, 0.05]
    n = 40000
    scores = torch.tensor(p).expand(n, 4) * 7.0  # unnormalised scores are fine
    idx = importance_indices(scores, k, generator=torch.Generator().manual_seed(0))
    freq = torch.zeros(4).index_add_(0, idx.flatten(), torch.ones(idx.numel())) / n
    torch.testing.assert_close(freq, torch.tensor(_inclusion_probabilities(p, k)), atol=0.012, rtol=0)
    for row in idx[:50].tolist():
        assert len(set(row)) == k


def test_importance_handles_zero_scores() -> None:
    scores = torch.tensor([[0.0, 1.0, 0.0, 2.0]])
    idx = importance_indices(scores, 3, generator=torch.Generator().manual_seed(0))
    assert {1, 3} <= set(idx[0].tolist())


def test_gather_tokens_gradient() -> None:
    x = torch.randn(2, 5, 3, requires_grad=True)
    idx = torch.tensor([[0, 3], [1, 4]])
    out = gather_tokens(x, idx)
    torch.testing.assert_close(out, torch.stack([x[0, [0, 3]], x[1, [1, 4]]]))
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum(-1).ne(0).sum() == 4


def test_selection_bad_k() -> None:
    with pytest.raises(ValueError, match="kept tokens"):
        topk_indices(torch.rand(1, 3), 4)
    with pytest.raises(ValueError, match="kept tokens"):
        random_indices(1, 3, -1)


# ------------------------------------------------------------------------------ merging


def ref_bipartite(x: torch.Tensor, sizes: list[float], k: int, fraction: float = 0.5) -> list[list[int]]:
    """One example, loops: groups of original token indices after ToMe rounds down to k,
    each round removing at most ``fraction`` of its tokens (at least one)."""
    groups = [[i] for i in range(x.shape[0])]
    feats = [x[i].clone() for i in range(x.shape[0])]
    w = list(sizes)
    while len(groups) > k:
        n = len(groups)
        r = min(n - k, max(1, int(n * fraction + 1e-9)))
        a_ids, b_ids = list(range(0, n, 2)), list(range(1, n, 2))
        best = []
        for a in a_ids:
            sims = [float(F.cosine_similarity(feats[a], feats[b], dim=0)) for b in b_ids]
            j = max(range(len(b_ids)), key=lambda t: (sims[t], -t))
            best.append((sims[j], a, b_ids[j]))
        order = sorted(range(len(a_ids)), key=lambda t: -best[t][0])  # stable on ties
        merged = {best[t][1]: best[t][2] for t in order[:r]}
        new_groups, new_feats, new_w = [], [], []
        for a in a_ids:
            if a not in merged:
                new_groups.append(groups[a])
                new_feats.append(feats[a])
                new_w.append(w[a])
        for b in b_ids:
            members = [b] + [a for a, dst in merged.items() if dst == b]
            tot = sum(w[m] for m in members)
            new_groups.append(sorted(i for m in members for i in groups[m]))
            new_feats.append(sum(w[m] * feats[m] for m in members) / tot)
            new_w.append(tot)
        groups, feats, w = new_groups, new_feats, new_w
    return groups


@pytest.mark.parametrize("fraction", [0.5, 0.25, 0.1])
@pytest.mark.parametrize("k", [1, 3, 6, 9, 10])
def test_bipartite_merge_matches_reference(k: int, fraction: float) -> None:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(3, 10, 4, generator=g, dtype=torch.float64)
    sizes = torch.randint(1, 4, (3, 10), generator=g).to(torch.float64)
    assign = bipartite_merge_plan(x, k, sizes=sizes, round_fraction=fraction)
    for b in range(3):
        groups = ref_bipartite(x[b], sizes[b].tolist(), k, fraction)
        got = [sorted(i for i in range(10) if assign[b, i] == j) for j in range(k)]
        assert got == groups
    out, out_sizes = weighted_segment_mean(x, sizes, assign, k)
    torch.testing.assert_close(out_sizes.sum(1), sizes.sum(1))  # mass is conserved
    assert out.shape == (3, k, 4)


def test_bipartite_merge_bad_k_and_fraction() -> None:
    with pytest.raises(ValueError, match="merged tokens"):
        bipartite_merge_plan(torch.randn(1, 4, 2), 0)
    for fraction in (0.0, 0.6, (3, 5)):
        with pytest.raises(ValueError, match="round_fraction"):
            bipartite_merge_plan(torch.randn(1, 4, 2), 2, round_fraction=fraction)


def test_round_fractions_are_sized_in_integers() -> None:
    """The exact ratio of a float sizes every round as the float's floor does (the ratio
    is what a module holds, for torch.compile)."""
    import math

    from leanformer.ops.merging import round_ratio

    assert round_ratio(0.5) == (1, 2) and round_ratio(0.25) == (1, 4) and round_ratio(0.1) == (1, 10)
    assert round_ratio(1 / 3) == (1, 3) and round_ratio((2, 7)) == (2, 7)
    for fraction in (0.5, 0.25, 0.1, 1 / 3, 0.3, 0.45):
        numerator, denominator = round_ratio(fraction)
        for n in range(1, 1000):
            assert n * numerator // denominator == math.floor(n * fraction + 1e-9), (fraction, n)


def test_smaller_rounds_differ_from_tome_only_where_a_round_hits_its_cap() -> None:
    """Removing 2 of 12 tokens is one round either way; removing 6 is one ToMe round
    (all of A) but two quarter rounds (3 + 3), which may pair tokens differently."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 12, 4, generator=g)
    assert torch.equal(bipartite_merge_plan(x, 10), bipartite_merge_plan(x, 10, round_fraction=0.25))
    tome, steps = bipartite_merge_plan(x, 6), bipartite_merge_plan(x, 6, round_fraction=0.25)
    assert not torch.equal(tome, steps)


def test_gather_tokens_from_a_prefix_stripped_view() -> None:
    base = torch.randn(2, 6, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 4], [2, 1]])
    out = gather_tokens(base[:, 1:], idx)
    torch.testing.assert_close(out, torch.stack([base[0, [1, 5]], base[1, [3, 2]]]))
    assert torch.autograd.gradcheck(lambda b: gather_tokens(b[:, 1:], idx), (base,))


def test_every_op_keeps_every_token_at_k_equal_n() -> None:
    """K = N is the identity for every selection and merging op, whatever the data (here
    exact and near duplicates, which merging would otherwise pair first); merging also
    accepts K > N as the identity, as the clustering ops and the layers do."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 9, 4, generator=g)
    x[:, 4] = x[:, 3]
    x[:, 6] = x[:, 5] + 1e-6
    scores = torch.rand(3, 9, generator=g)
    scores[0, 2] = 0.0
    identity = torch.arange(9).expand(3, 9)
    assert torch.equal(topk_indices(scores, 9), identity)
    assert torch.equal(random_indices(3, 9, 9, generator=g), identity)
    assert torch.equal(random_indices(3, 9, 9, seed=4), identity)
    assert torch.equal(importance_indices(scores, 9, generator=g), identity)
    assert torch.equal(importance_indices(scores, 9, seed=4), identity)
    for k in (9, 10, 100):
        assert torch.equal(bipartite_merge_plan(x, k), identity)


def test_seeded_draws_are_deterministic_and_differ_between_seeds_and_examples() -> None:
    a = random_indices(4, 50, 10, seed=3)
    assert torch.equal(a, random_indices(4, 50, 10, seed=3))
    assert not torch.equal(a, random_indices(4, 50, 10, seed=4))
    assert len({tuple(row) for row in a.tolist()}) == 4
    scores = torch.rand(4, 50, generator=torch.Generator().manual_seed(0))
    b = importance_indices(scores, 10, seed=3)
    assert torch.equal(b, importance_indices(scores, 10, seed=3))
    assert not torch.equal(b, importance_indices(scores, 10, seed=4))


def test_seeded_noise_is_uniform() -> None:
    """Counter-based noise: mean 1/2, variance 1/12, every decile near 10%, and no
    correlation between neighbouring tokens (200k draws: a bad hash fails by far)."""
    from leanformer.ops.hashed_noise import hashed_uniform

    u = hashed_uniform(400, 500, seed=0)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert abs(float(u.var()) - 1 / 12) < 0.002
    deciles = torch.histc(u.float(), bins=10, min=0.0, max=1.0) / u.numel()
    assert ((deciles - 0.1).abs() < 0.005).all()
    neighbours = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    assert abs(float(neighbours)) < 0.01
