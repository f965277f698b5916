"""Visual Perceiver: query subsets, DQS grouping, parity with references, paper figures."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from leanformer import create_model
from leanformer.layers.cross_attention import CrossAttention, CrossAttentionBlock
from leanformer.models.perceiver import VisualPerceiver


def _model(seed: int = 0, *, spread: float = 1.0) -> VisualPerceiver:
    torch.manual_seed(seed)
    model = create_model("visual_perceiver_test").eval()
    # Spread the queries apart so their attention (and DQS similarities) differ.
    with torch.no_grad():
        model.queries.normal_(0.0, spread)
    return model  # type: ignore[return-value]


def _images(B: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def test_cross_attention_matches_manual_softmax() -> None:
    torch.manual_seed(0)
    attn = CrossAttention(12, num_heads=3).eval()
    q, x = torch.randn(1, 5, 12), torch.randn(2, 7, 12)
    out = attn(q, x)
    Q = attn.q(q).reshape(1, 5, 3, 4).transpose(1, 2)
    kv = attn.kv(x).reshape(2, 7, 2, 3, 4)
    K, V = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    probs = (Q @ K.transpose(-2, -1) / math.sqrt(4)).softmax(-1)
    ref = attn.proj((probs @ V).transpose(1, 2).reshape(2, 5, 12))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(attn.probs(q, x), probs)
    with pytest.raises(ValueError, match="divisible"):
        CrossAttention(10, num_heads=3)


def test_cross_block_is_mix_then_finish_and_per_query() -> None:
    torch.manual_seed(0)
    blk = CrossAttentionBlock(16, num_heads=2).eval()
    q, x = torch.randn(1, 6, 16), torch.randn(3, 9, 16)
    full = blk(q, x)
    torch.testing.assert_close(full, blk.finish(q, blk.mix(q, x)))
    # Queries do not interact: a subset of queries gives the same rows.
    torch.testing.assert_close(blk(q[:, [4, 1]], x), full[:, [4, 1]])


def test_num_queries_q_equals_full_model() -> None:
    model, x = _model(), _images()
    full = model(x)
    torch.testing.assert_close(model(x, num_queries=model.num_queries), full)
    torch.testing.assert_close(model(x, query_index=torch.arange(model.num_queries)), full)
    torch.testing.assert_close(model.forward_head(model.forward_features(x)), full)


def _restricted(model: VisualPerceiver, index: list[int]) -> VisualPerceiver:
    """Reference: a copy of the model that owns exactly the queries ``index``."""
    ref = copy.deepcopy(model)
    ref.queries = nn.Parameter(model.queries.detach()[index].clone())
    ref.num_queries = len(index)
    return ref


def test_subset_equals_model_with_exactly_those_queries() -> None:
    model, x = _model(), _images()
    index = [5, 0, 2]
    torch.testing.assert_close(model(x, query_index=torch.tensor(index)), _restricted(model, index)(x))
    torch.testing.assert_close(model(x, num_queries=3), _restricted(model, [0, 1, 2])(x))
    assert not torch.allclose(model(x, num_queries=3), model(x))  # the query count matters


def test_per_input_index_equals_one_input_at_a_time() -> None:
    model, x = _model(), _images()
    g = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(model.num_queries, generator=g)[:3] for _ in range(len(x))])
    out = model(x, query_index=index)
    for b in range(len(x)):
        torch.testing.assert_close(out[b : b + 1], model(x[b : b + 1], query_index=index[b]))


def _mixed_threshold(model: VisualPerceiver, x: torch.Tensor) -> float:
    """A threshold at which the inputs keep different numbers of queries."""
    with torch.no_grad():
        y = model.cross.mix(model.candidate_queries(len(x)), model.embed(x))
        y = y / y.norm(dim=-1, keepdim=True)
        s = (y @ y.transpose(1, 2)).tril(-1)
    return float(s[s != 0].quantile(0.7))


@pytest.mark.parametrize("rule", ["any", "kept"])
@pytest.mark.parametrize("max_padding", [0.0, 0.25, 100.0])  # per count, bucketed, one padded group
def test_dqs_mixed_batch_equals_each_input_alone(rule: str, max_padding: float) -> None:
    model, x = _model(), _images(B=8)
    model.dqs_max_padding = max_padding
    t = _mixed_threshold(model, x)
    out = model(x, dqs_threshold=t, dqs_rule=rule)
    counts, mask = model.last_kept_counts, model.last_kept_mask
    assert counts is not None and mask is not None
    assert counts.shape == (8,) and len(set(counts.tolist())) > 1  # really a mixed batch
    torch.testing.assert_close(counts, mask.sum(1))
    for b in range(len(x)):
        kept = torch.nonzero(mask[b]).flatten()
        alone = model(x[b : b + 1], query_index=kept)
        torch.testing.assert_close(out[b : b + 1], alone, rtol=1e-4, atol=1e-5)
        # ... and running the input alone with DQS selects the same queries.
        torch.testing.assert_close(
            model(x[b : b + 1], dqs_threshold=t, dqs_rule=rule), alone, rtol=1e-4, atol=1e-5
        )


def test_dqs_extreme_thresholds() -> None:
    model, x = _model(), _images()
    out = model(x, dqs_threshold=1.0)
    assert model.last_kept_counts is not None
    assert model.last_kept_counts.tolist() == [model.num_queries] * len(x)
    torch.testing.assert_close(out, model(x))
    out = model(x, dqs_threshold=-1.0)
    assert model.last_kept_counts.tolist() == [1] * len(x)
    torch.testing.assert_close(out, model(x, num_queries=1))
    model(x)
    assert model.last_kept_counts is None  # a fixed-K call does not leave stale counts


def test_dqs_within_first_k_and_with_gradients() -> None:
    model, x = _model(), _images()
    out = model(x, num_queries=5, dqs_threshold=1.0)
    torch.testing.assert_close(out, model(x, num_queries=5))
    model.train()
    model(x, dqs_threshold=0.0).sum().backward()
    assert model.queries.grad is not None and bool(model.queries.grad[0].abs().sum() > 0)


def test_dqs_on_an_empty_batch_is_empty_as_fixed_k_is() -> None:
    model = _model()
    empty = _images(0)
    assert model(empty).shape == model(empty, dqs_threshold=0.5).shape == (0, 5)
    assert model.last_kept_counts is not None and model.last_kept_counts.shape == (0,)
    assert model.last_kept_mask is not None and model.last_kept_mask.shape == (0, 8)


def test_attention_maps_are_distributions() -> None:
    model, x = _model(), _images()
    maps = model.cross_attention_maps(x, num_queries=6)
    assert maps.shape == (4, 6, 4, 4)
    torch.testing.assert_close(maps.sum(dim=(-2, -1)), torch.ones(4, 6))


def test_other_resolution() -> None:
    model = _model()
    assert model(torch.randn(2, 3, 24, 24), num_queries=3).shape == (2, 5)


def test_bad_inputs() -> None:
    model, x = _model(), _images()
    with pytest.raises(ValueError, match=r"num_queries must be an integer in \[1, 8\]"):
        model(x, num_queries=0)
    with pytest.raises(ValueError, match=r"num_queries must be an integer in \[1, 8\]"):
        model(x, num_queries=9)
    with pytest.raises(ValueError, match="either num_queries or query_index"):
        model(x, num_queries=2, query_index=torch.tensor([0]))
    with pytest.raises(ValueError, match=r"values must be in \[0, 7\]"):
        model(x, query_index=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="integer tensor"):
        model(x, query_index=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="shape"):
        model(x, query_index=torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown dqs_rule"):
        model(x, dqs_threshold=0.5, dqs_rule="greedy")
    with pytest.raises(ValueError, match="dqs_rule='kept' needs a dqs_threshold"):
        model(x, dqs_rule="kept")  # used to be ignored: every query ran
    with pytest.raises(ValueError, match="num_queries must be an integer >= 1"):
        create_model("visual_perceiver_test", num_queries=0)
    with pytest.raises(ValueError, match="no option"):
        create_model("visual_perceiver_test", num_querys=4)


def test_reset_classifier_and_registry() -> None:
    model = _model()
    model.reset_classifier(3)
    assert model(_images(2)).shape == (2, 3)
    digits = create_model("visual_perceiver_digits")
    assert digits(torch.randn(2, 1, 32, 32), num_queries=4).shape == (2, 10)


def _gmacs(model: nn.Module, x: torch.Tensor, **kwargs: object) -> float:
    try:
        from leanformer.bench.flops import count_gflops
    except ImportError:  # counted on the unfused attention path, which FlopCounterMode sees
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.utils.flop_counter import FlopCounterMode

        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
            model(x, **kwargs)
        return counter.get_total_flops() / 2 / len(x) / 1e9
    return count_gflops(model, (x,), forward_kwargs=kwargs)


def test_paper_parameter_count_and_gflops() -> None:
    torch.manual_seed(0)
    model = create_model("visual_perceiver_cifar").eval()
    params = sum(p.numel() for p in model.parameters())
    assert abs(params / 6.18e6 - 1) < 0.03, params
    x = torch.randn(1, 3, 32, 32)
    # Paper table 1: 394M multiply-adds at Q=64, 195M at Q=32, 11M at Q=1.
    for K, paper in [(64, 0.394), (32, 0.195), (1, 0.011)]:
        gmacs = _gmacs(model, x, num_queries=K)
        assert abs(gmacs / paper - 1) < 0.05, (K, gmacs)


def test_sincos_position_init() -> None:
    from leanformer.models.perceiver import sincos_2d

    codes = sincos_2d((4, 4), 32)
    assert codes.shape == (1, 16, 32)
    # Distinct positions get distinct codes; the embedding stays a learned parameter.
    assert torch.cdist(codes[0], codes[0]).add(torch.eye(16)).min() > 0.1
    model = create_model("visual_perceiver_test", pos_embed_init="sincos")
    torch.testing.assert_close(model.pos_embed.detach(), codes)
    assert model.pos_embed.requires_grad
    with pytest.raises(ValueError, match="pos_embed_init"):
        create_model("visual_perceiver_test", pos_embed_init="fourier")
