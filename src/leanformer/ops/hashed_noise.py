"""Uniform noise from a generator, or counter-based from a seed.

A ``torch.Generator`` is a stateful object: creating or re-seeding one inside a forward
pass stops ``torch.compile(fullgraph=True)``. Counter-based noise needs no state: every
entry is a hash of ``(seed, example, token)``, so the same seed always gives the same
noise, on any device, compiled or not, and no host synchronisation is involved.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

_Int = TypeVar("_Int", Tensor, int)

_MASK = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit state times one stays below 2**63, so the
# products are exact in int64 and the low 32 bits are the wrapped 32-bit product.
_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)


def _mix(h: _Int) -> _Int:
    """A 32-bit integer finaliser (xorshift-multiply rounds) on values in ``[0, 2**32)``:
    int64 tensors or Python ints, with the same result."""
    h = h ^ (h >> 16)
    h = (h * _MULTIPLIERS[0]) & _MASK
    h = h ^ (h >> 15)
    h = (h * _MULTIPLIERS[1]) & _MASK
    return h ^ (h >> 16)


def hashed_uniform(
    batch: int, num_tokens: int, *, seed: int, device: torch.device | None = None, dtype=torch.float64
) -> Tensor:
    """``[B, N]`` noise in ``(0, 1)`` from ``seed``: entry ``(b, i)`` depends on ``(seed, b, i)`` only."""
    counter = torch.arange(batch * num_tokens, device=device, dtype=torch.int64).view(batch, num_tokens)
    seed_key = _mix(int(seed) & _MASK)
    h = _mix(_mix(counter) ^ seed_key)
    # Centre of one of 2**32 equal bins: never exactly 0 or 1.
    return (h.to(dtype) + 0.5) / 2.0**32


def uniform_noise(
    batch: int,
    num_tokens: int,
    *,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    device: torch.device | None = None,
    dtype=torch.float32,
) -> Tensor:
    """``[B, N]`` uniform noise: counter-based from ``seed`` when given, else from ``generator``
    (the global generator when None too)."""
    if seed is not None:
        return hashed_uniform(batch, num_tokens, seed=seed, device=device, dtype=dtype)
    return torch.rand(batch, num_tokens, generator=generator, device=device, dtype=dtype)
