"""Loading trained tensors into a model that options may have reshaped or extended."""

from __future__ import annotations

from torch import Tensor, nn


def load_state_lenient(
    model: nn.Module, state: dict[str, Tensor], *, mismatch: str
) -> tuple[list[str], list[str]]:
    """``model.load_state_dict(state, strict=False)`` -> ``(missing, unexpected)`` keys.

    A tensor whose shape an option changed raises ``ValueError(f"{mismatch} ({detail})")``
    naming the first mismatched tensor, instead of torch's multi-line RuntimeError.
    """
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        detail = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), "")
        raise ValueError(f"{mismatch} ({detail})") from None
    return list(missing), list(unexpected)
