"""FLOPs in the papers' convention (multiply-adds) and parameter counts of the DeiT references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import leanformer
from leanformer.bench.flops import count_gflops
from leanformer.bench.report import count_params
from leanformer.layers.attention import Attention


@pytest.mark.parametrize(
    ("name", "gflops", "params_m"),
    [("deit_small", 4.6, 22.1), ("deit_tiny", 1.25, 5.7)],
)
def test_deit_reference_costs(name: str, gflops: float, params_m: float) -> None:
    model = leanformer.create_model(name)
    measured = count_gflops(model, (torch.randn(1, 3, 224, 224),))
    assert measured == pytest.approx(gflops, rel=0.03)
    assert count_params(model) / 1e6 == pytest.approx(params_m, rel=0.01)


class _AlwaysScores(nn.Module):
    """Runs an Attention through its explicit-softmax path (matmuls torch counts itself)."""

    def __init__(self, attn: Attention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, need_received=True)[0]


class _Fused(nn.Module):
    def __init__(self, attn: Attention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)[0]


def test_fused_attention_counted_like_unfused() -> None:
    attn = Attention(64, num_heads=4).eval()
    x = torch.randn(2, 50, 64)
    fused = count_gflops(_Fused(attn), (x,))
    explicit = count_gflops(_AlwaysScores(attn), (x,))
    # the explicit path's only extra matmul-free work is the softmax, which neither counts
    assert fused == pytest.approx(explicit, rel=1e-6)
    linear_only = (50 * 64 * 64 * 4) / 1e9
    assert fused > linear_only * 1.05  # the attention matmuls are in the count


def test_gflops_per_sample_independent_of_batch() -> None:
    model = leanformer.create_model("deit_test")
    one = count_gflops(model, (torch.randn(1, 3, 16, 16),))
    four = count_gflops(model, (torch.randn(4, 3, 16, 16),))
    assert one == pytest.approx(four)


def test_bad_inputs_are_refused_before_the_model_runs() -> None:
    """A bare tensor, no batch or an empty one: a message, not a failure inside the model or
    a division by zero; a batch given by keyword (Hugging Face's pixel_values=) counts."""
    from leanformer.bench.throughput import measure_throughput

    calls = []

    class Recorder(torch.nn.Module):
        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return pixel_values.flatten(1) @ torch.ones(12, 4)

    x = torch.randn(2, 3, 2, 2)
    for measure in (count_gflops, lambda m, i: measure_throughput(m, i, runs=1, warmup=0)):
        for inputs, error, message in (
            (x, TypeError, r"inputs must be a tuple of the model's positional inputs, e.g. \(images,\)"),
            ((), ValueError, "no batched tensor among the inputs"),
            ((x[:0],), ValueError, "the batch is empty"),
        ):
            with pytest.raises(error, match=message):
                measure(Recorder(), inputs)
    assert calls == []
    # 12 x 4 multiply-adds per sample.
    assert count_gflops(Recorder(), (), forward_kwargs={"pixel_values": x}) == pytest.approx(48 / 1e9)
    assert measure_throughput(Recorder(), (), forward_kwargs={"pixel_values": x}, runs=1)["img_per_s"] > 0


def test_matrix_vector_products_are_counted() -> None:
    # FlopCounterMode has no formula for aten.mv; DRRT's additive relation score
    # (tanh(...) @ w_g over [B, N, M, d]) dispatches to it and read cheaper than `dot`.
    class ScoreByVector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w  # [B, N, M, 8] @ [8]

    x = torch.randn(2, 5, 6, 8)
    assert count_gflops(ScoreByVector(), (x,)) == pytest.approx(5 * 6 * 8 / 1e9)
    from leanformer import create_model

    additive, dot = (create_model("drrt_test", relation=r) for r in ("additive", "dot"))
    # The same pairwise work (a d-wide product per token pair), plus the additive form's projections.
    assert count_gflops(additive, additive.example_inputs(2)) >= count_gflops(dot, dot.example_inputs(2))
