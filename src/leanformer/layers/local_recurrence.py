"""Local recurrence over a token sequence (DRRT eqs. 1-2).

``h_t = act_h(U x_t + V h_{t-1} + b_h)`` and ``y_t = act_o(W h_t + b_o)`` for
``t = 1..N`` with ``h_0 = 0``. The paper writes the same ``b_h`` in both equations;
the two live in different spaces (hidden and output) whenever their widths differ, so
each gets its own bias here.

Three execution paths, all computing the same function:

- ``act_h`` in {"tanh", "relu"}: PyTorch's fused ``nn.RNN`` kernel (its two biases
  ``b_ih + b_hh`` together are ``b_h``).
- ``act_h == "identity"``: the recurrence is linear, so ``h_t = sum_{s<=t} V^{t-s} x'_s``
  is a prefix scan; computed in ``ceil(log2 N)`` batched steps (Hillis-Steele doubling
  with ``V, V^2, V^4, ...``) instead of ``N`` sequential ones.
- any other ``act_h`` (sigmoid, gelu, silu): the input projections for all steps are one
  matmul; only the ``[B, H] x [H, H]`` product that each step needs from the previous
  one remains sequential, since a non-linear recurrence has no parallel form.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leanformer.layers.checks import check_positive

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "identity": lambda x: x,
    "tanh": torch.tanh,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "gelu": F.gelu,
    "silu": F.silu,
}
FUSED = ("tanh", "relu")  # the nonlinearities nn.RNN implements


def get_activation(name: str, what: str = "activation") -> Callable[[Tensor], Tensor]:
    """The elementwise function called ``name`` (ValueError listing the choices otherwise)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(ACTIVATIONS)}") from None


class LocalRecurrence(nn.Module):
    """Elman recurrence along the tokens: ``[B, N, C_in] -> [B, N, C_out]``.

    Args:
        in_features: ``C_in``, width of ``x_t``.
        hidden_features: width of ``h_t`` (default ``C_in``).
        out_features: ``C_out``, width of ``y_t`` (default ``C_in``).
        hidden_act: ``act_h``; "tanh"/"relu" use the fused kernel.
        out_act: ``act_o``.
    """

    def __init__(
        self,
        in_features: int,
        *,
        hidden_features: int | None = None,
        out_features: int | None = None,
        hidden_act: str = "tanh",
        out_act: str = "identity",
    ) -> None:
        super().__init__()
        check_positive(in_features=in_features)
        check_positive(optional=True, hidden_features=hidden_features, out_features=out_features)
        hidden = hidden_features or in_features
        out = out_features or in_features
        self.hidden_act_name = hidden_act
        self.hidden_act = get_activation(hidden_act, "hidden activation")
        self.out_act_name = out_act
        self.out_act = get_activation(out_act, "output activation")
        self.in_features, self.hidden_features, self.out_features = in_features, hidden, out
        if hidden_act in FUSED:
            self.rnn: nn.RNN | None = nn.RNN(in_features, hidden, nonlinearity=hidden_act, batch_first=True)
            self.input_proj: nn.Linear | None = None
            self.hidden_weight: nn.Parameter | None = None
        else:
            self.rnn = None
            self.input_proj = nn.Linear(in_features, hidden)  # U, b_h
            self.hidden_weight = nn.Parameter(torch.empty(hidden, hidden))  # V
            # nn.RNN's default init, so every path starts from the same distribution.
            bound = 1.0 / math.sqrt(hidden)
            nn.init.uniform_(self.hidden_weight, -bound, bound)
        self.output_proj = nn.Linear(hidden, out)  # W, b_o

    def recurrence_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(U [H, C_in], V [H, H], b_h [H])`` whichever path holds them."""
        if self.rnn is not None:
            # nn.RNN creates these by name at run time: the type checker cannot see them.
            u, v, b_ih, b_hh = (
                cast(Tensor, getattr(self.rnn, n))
                for n in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")
            )
            return u, v, b_ih + b_hh
        assert self.input_proj is not None and self.hidden_weight is not None
        return self.input_proj.weight, self.hidden_weight, self.input_proj.bias

    def hidden_states(self, x: Tensor) -> Tensor:
        """``h_1..h_N``: ``[B, N, C_in] -> [B, N, H]``."""
        if x.ndim != 3 or x.shape[-1] != self.in_features:
            raise ValueError(f"expected a sequence [B, N, {self.in_features}], got shape {tuple(x.shape)}")
        if self.rnn is not None:
            return self.rnn(x)[0]
        assert self.input_proj is not None and self.hidden_weight is not None
        inputs = self.input_proj(x)  # U x_t + b_h for every t at once: [B, N, H]
        if self.hidden_act_name == "identity":
            return _linear_scan(inputs, self.hidden_weight)
        return _sequential(inputs, self.hidden_weight, self.hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        """``[B, N, C_in] -> [B, N, C_out]``."""
        return self.out_act(self.output_proj(self.hidden_states(x)))

    def extra_repr(self) -> str:
        return (
            f"{self.in_features} -> {self.hidden_features} -> {self.out_features}, "
            f"hidden_act={self.hidden_act_name}, out_act={self.out_act_name}"
        )


def _linear_scan(inputs: Tensor, weight: Tensor) -> Tensor:
    """Prefix scan of ``h_t = V h_{t-1} + u_t``: ``inputs [B, N, H]``, ``weight V [H, H]``.

    After the round with offset ``s`` every ``h_t`` holds ``sum_{t-2s < r <= t} V^{t-r} u_r``;
    doubling ``s`` until it covers ``N`` leaves the full sum.
    """
    h = inputs
    power = weight  # V^s for the current offset s
    n, offset = inputs.shape[1], 1
    while offset < n:
        # Row vectors: V^s h_{t-s} is h_{t-s} @ (V^s)^T.
        shifted = h[:, :-offset] @ power.T
        h = torch.cat([h[:, :offset], h[:, offset:] + shifted], dim=1)
        power = power @ power
        offset *= 2
    return h


def _sequential(inputs: Tensor, weight: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    """``h_t = act(u_t + V h_{t-1})`` step by step (batched over ``B``): ``[B, N, H]``."""
    h = act(inputs[:, 0])
    states = [h]
    for t in range(1, inputs.shape[1]):
        h = act(inputs[:, t] + h @ weight.T)
        states.append(h)
    return torch.stack(states, dim=1)


__all__ = ["ACTIVATIONS", "LocalRecurrence", "get_activation"]
