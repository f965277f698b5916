"""Local recurrence (DRRT eqs. 1-2) against a step-by-step loop reference."""

from __future__ import annotations

import pytest
import torch

from leanformer.layers.local_recurrence import ACTIVATIONS, LocalRecurrence

ALL_ACTS = sorted(ACTIVATIONS)


def loop_reference(layer: LocalRecurrence, x: torch.Tensor) -> torch.Tensor:
    """Eqs. 1-2 literally: one example, one step, one matrix-vector product at a time."""
    U, V, b_h = layer.recurrence_weights()
    W, b_o = layer.output_proj.weight, layer.output_proj.bias
    act_h, act_o = ACTIVATIONS[layer.hidden_act_name], ACTIVATIONS[layer.out_act_name]
    out = torch.zeros(x.shape[0], x.shape[1], W.shape[0], dtype=x.dtype)
    for n in range(x.shape[0]):
        h = torch.zeros(V.shape[0], dtype=x.dtype)
        for t in range(x.shape[1]):
            h = act_h(U @ x[n, t] + V @ h + b_h)
            out[n, t] = act_o(W @ h + b_o)
    return out


@pytest.mark.parametrize("hidden_act", ALL_ACTS)
@pytest.mark.parametrize("seq_len", [1, 2, 5, 8, 13])
def test_matches_loop_reference(hidden_act: str, seq_len: int) -> None:
    torch.manual_seed(0)
    layer = LocalRecurrence(
        4, hidden_features=6, out_features=3, hidden_act=hidden_act, out_act="sigmoid"
    ).double()
    if hidden_act == "identity":
        # Keep the linear recurrence contractive so V^t stays O(1) over 13 steps.
        with torch.no_grad():
            layer.hidden_weight.mul_(0.5)
    x = torch.randn(3, seq_len, 4, dtype=torch.float64)
    torch.testing.assert_close(layer(x), loop_reference(layer, x))


def test_fused_path_only_for_tanh_and_relu() -> None:
    assert LocalRecurrence(4, hidden_act="tanh").rnn is not None
    assert LocalRecurrence(4, hidden_act="relu").rnn is not None
    for act in ("identity", "sigmoid", "gelu"):
        layer = LocalRecurrence(4, hidden_act=act)
        assert layer.rnn is None and layer.hidden_weight is not None


def test_causal_and_batched() -> None:
    """h_t depends on x_1..x_t only, and each example is processed independently."""
    torch.manual_seed(1)
    for act in ("tanh", "identity", "gelu"):
        layer = LocalRecurrence(3, hidden_act=act)
        x = torch.randn(4, 7, 3)
        y = layer(x)
        x2 = x.clone()
        x2[:, 4:] += 1.0
        torch.testing.assert_close(layer(x2)[:, :4], y[:, :4])
        assert not torch.allclose(layer(x2)[:, 4:], y[:, 4:])
        torch.testing.assert_close(layer(x[1:2]), y[1:2])


@pytest.mark.parametrize("hidden_act", ["tanh", "identity", "sigmoid"])
def test_gradcheck(hidden_act: str) -> None:
    torch.manual_seed(2)
    layer = LocalRecurrence(2, hidden_features=3, hidden_act=hidden_act).double()
    x = torch.randn(2, 5, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,))
    layer(x).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown hidden activation 'softsign'"):
        LocalRecurrence(4, hidden_act="softsign")
    with pytest.raises(ValueError, match="unknown output activation"):
        LocalRecurrence(4, out_act="nope")
    with pytest.raises(ValueError, match="in_features must be an integer >= 1"):
        LocalRecurrence(0)
    with pytest.raises(ValueError, match=r"expected a sequence \[B, N, 4\]"):
        LocalRecurrence(4)(torch.randn(2, 3, 5))
