"""FLOPs in the papers' convention: multiply-adds (MACs) per sample, in billions.

``torch.utils.flop_counter.FlopCounterMode`` counts 2 FLOPs per multiply-add and, in
torch 2.14, does not know the CPU fused attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``), so a DeiT-S would read 4.24 instead
of 4.6 GMACs. Our counter adds the same formula torch uses for the CUDA flash kernel and
a formula for matrix-vector products (``aten.mv``, which it does not count either).

The package's C++ kernels are custom ops (``torch.ops.leanformer.*``) that register their
own formulas with ``torch.utils.flop_counter.register_flop_formula``: any
``FlopCounterMode`` counts them as their PyTorch fallback's products are counted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

# The kernels' custom ops and their FLOP formulas, registered before any counter is made.
import leanformer.ops.attention_native
import leanformer.ops.kmeans_native
import leanformer.ops.kmedoids_native
import leanformer.ops.segment_sum_native  # noqa: F401

aten = torch.ops.aten


def _cpu_flash_forward(
    query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _matrix_vector(matrix: Any, vector: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    # ``[M, N] @ [N]``: M dot products of length N. FlopCounterMode has no formula for
    # aten.mv, which ``[..., d] @ [d]`` dispatches to (DRRT's additive relation score).
    return 2 * matrix[0] * matrix[1]


def _custom_mapping() -> dict[Any, Any]:
    mapping: dict[Any, Any] = {aten.mv: _matrix_vector}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_flash_forward
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_flash_backward
    return mapping


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also counts the CPU fused attention kernel."""
    return FlopCounterMode(display=False, custom_mapping=_custom_mapping())


def batch_input(inputs: Any, forward_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
    """The tensor that carries the batch: the first of ``inputs`` (a tuple or list), else
    the first tensor among ``forward_kwargs`` (``pixel_values=`` of a Hugging Face model).
    Checked before any work, so a bad call fails with a message, not inside the model."""
    if isinstance(inputs, torch.Tensor):
        raise TypeError("inputs must be a tuple of the model's positional inputs, e.g. (images,)")
    if not isinstance(inputs, tuple | list):
        raise TypeError(
            f"inputs must be a tuple of the model's positional inputs, got {type(inputs).__name__}"
        )
    candidates = [*inputs[:1], *(forward_kwargs or {}).values()]
    first = next((c for c in candidates if isinstance(c, torch.Tensor) and c.ndim > 0), None)
    if first is None:
        raise ValueError("no batched tensor among the inputs: the first input (or a keyword) must be one")
    if first.shape[0] == 0:
        raise ValueError("the batch is empty: per-sample figures need at least one sample")
    return first


@torch.no_grad()
def count_gflops(
    model: nn.Module, inputs: tuple[Any, ...], *, forward_kwargs: dict[str, Any] | None = None
) -> float:
    """Inference GMACs per sample (the papers' "GFLOPs"): total multiply-adds / batch / 1e9."""
    batch = int(batch_input(inputs, forward_kwargs).shape[0])
    was_training = model.training
    model.eval()
    try:
        with flop_counter() as counter:
            model(*inputs, **(forward_kwargs or {}))
    finally:
        model.train(was_training)
    return counter.get_total_flops() / 2 / batch / 1e9
