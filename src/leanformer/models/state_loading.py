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


def first_nonfinite(state: dict[str, Tensor]) -> str | None:
    """The name of the first floating-point tensor of ``state`` holding a NaN or an inf."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
            return name
    return None


def check_finite_state(state: dict[str, Tensor], *, source: str, allow_nonfinite: bool = False) -> None:
    """Refuse weights with a NaN or an inf, naming ``source`` and the first such tensor: such a
    model evaluates to a number (a chance-level top-1, a null loss) instead of failing."""
    if allow_nonfinite:
        return
    name = first_nonfinite(state)
    if name is not None:
        raise ValueError(
            f"{source}: tensor {name} holds NaN or inf values; refusing to use these weights "
            "(--allow-nonfinite, allow_nonfinite=True, loads them anyway)"
        )
