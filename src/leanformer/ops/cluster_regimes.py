"""Where a clustering runs, and what each place allows: shared by :mod:`leanformer.ops.kmeans`
and :mod:`leanformer.ops.kmedoids`.

A converged example needs no masking: a K-Means or K-Medoids state that no longer changes
is a fixed point of the next iteration too, so the iterations may stop there, where
knowing it costs no device sync (:func:`repeat_while_changing`), with the plan of all
``max_iters``. Reading a value back is free only on the CPU, and only in eager code. So
each algorithm has these regimes, each a function named for when it is chosen:

- **eager on the CPU, kernel built** (``*_eager_cpu_kernel``): the iterations in C++, one
  example at a time (the custom ops of :mod:`leanformer.ops.kmeans_native` and
  :mod:`leanformer.ops.kmedoids_native`), where the gate
  (:func:`leanformer.ops.native.use_kernel`) lets them run;
- **batched** (``*_batched_plan``): every example at once in tensor operations. Eager on
  the CPU (the kernel not built) it stops at the fixed point; compiled for the CPU each
  iteration is a :func:`torch.cond` branch skipped once an iteration changed nothing; on
  an accelerator, and under a FLOP counter, every iteration runs;
- **compiled for the CPU, many tokens** (``*_opaque_compiled``): one opaque custom op
  (``torch.ops.leanformer.kmedoids_plan`` / ``kmeans_plan`` / ``kmedoids_pooled``) that
  runs the eager code, so it costs what it costs eager (:func:`opaque_when_compiled`).
  Either way the graph stays whole (``torch.compile(fullgraph=True)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from leanformer.ops.native import counting

# Compiled for the CPU, plans of at least this many tokens (batch x tokens) are opaque
# calls into the eager code (see opaque_when_compiled).
OPAQUE_FROM_TOKENS = 512


def reads_back(t: Tensor) -> bool:
    """Whether reading a value of ``t`` on the host is free: in eager mode on CPU. Elsewhere
    it would be a device sync on every call, or a graph break under ``torch.compile``."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def compiling_for_cpu(t: Tensor) -> bool:
    """Whether ``t`` is being traced for the CPU (where a graph branch costs no device sync)."""
    return t.device.type == "cpu" and torch.compiler.is_compiling()


def opaque_when_compiled(x: Tensor) -> bool:
    """Whether the plan for tokens ``x [B, N, C]``, traced for the CPU, is one opaque call
    into the eager code (which may read values back), rather than traced itself.

    Traced, the iterations run the plain step in fused kernels, skipped after the fixed
    point by :func:`torch.cond`; the eager code (the C++ iterations) does less work, plus
    the call's own overhead. Timed as compiled plans alone, the two are close below a few
    hundred tokens and the opaque call wins clearly from ``OPAQUE_FROM_TOKENS`` on
    (docs/BENCHMARKS.md, "Compiled and eager, small models and batch 1").
    """
    B, N, _ = x.shape
    return compiling_for_cpu(x) and B * N >= OPAQUE_FROM_TOKENS


def repeat_while_changing(
    step: Callable[..., tuple[Tensor, ...]], state: tuple[Tensor, ...], max_iters: int
) -> tuple[Tensor, ...]:
    """``max_iters`` times ``state = step(*state)``; ``step`` returns the new state and, last,
    whether it changed (a 0-d bool tensor).

    Once a step changes nothing the state is a fixed point, so the remaining steps are
    skipped where that costs no device sync, with the result of running them all: eager on
    the CPU by reading the flag, and compiled for the CPU by a branch in the graph
    (:func:`torch.cond`, which then skips the remaining steps' work). Elsewhere (an
    accelerator, where the branch would read the flag back) and under a FLOP counter every
    step runs.
    """
    if max_iters < 1:
        return state
    # Under a FLOP counter every step runs, as on an accelerator: a counted cost is then a
    # function of the token counts alone, not of where these images happened to converge
    # (the solver of GFLOPs budgets counts other images than the user's).
    if reads_back(state[0]) and not counting():
        for _ in range(max_iters):
            *new, changed = step(*state)
            state = tuple(new)
            if not bool(changed):
                break
        return state
    if not compiling_for_cpu(state[0]):
        for _ in range(max_iters):
            state = step(*state)[:-1]
        return state

    def run(*state_and_flag: Tensor) -> tuple[Tensor, ...]:
        return step(*state_and_flag[:-1])

    def stay(*state_and_flag: Tensor) -> tuple[Tensor, ...]:
        # A branch's outputs may not alias its inputs.
        return tuple(t.clone() for t in state_and_flag)

    active = torch.ones((), dtype=torch.bool, device=state[0].device)
    for _ in range(max_iters):
        *new, active = torch.cond(active, run, stay, (*state, active))
        state = tuple(new)
    return state


def fresh(t: Tensor) -> Tensor:
    """A contiguous tensor of its own: an opaque op's outputs may not alias its inputs (a
    plan can return its ``init``) nor be views with other strides than declared."""
    return t.clone(memory_format=torch.contiguous_format)


def register_plan_op(name: str, plan_fn: Callable[..., Any], *, medoids: bool) -> None:
    """Register ``plan_fn`` (a ``kmedoids_plan`` when ``medoids``, else a ``kmeans_plan``) as
    the custom op ``leanformer::<name>``: one opaque call, run eagerly, returning
    ``(assign [B, N], medoids [B, K])`` or ``(assign, centers [B, K, C])``."""

    def run(
        x: Tensor, k: int, weights: Tensor | None, init: Tensor | None, max_iters: int
    ) -> tuple[Tensor, Tensor]:
        plan = plan_fn(x, k, weights=weights, init=init, max_iters=max_iters)
        second = plan.medoids if medoids else plan.centers
        assert second is not None
        return fresh(plan.assign), fresh(second)

    def shapes(
        x: Tensor, k: int, weights: Tensor | None, init: Tensor | None, max_iters: int
    ) -> tuple[Tensor, Tensor]:
        B, N, C = x.shape
        second = x.new_empty(B, min(k, N), dtype=torch.int64) if medoids else x.new_empty(B, min(k, N), C)
        return x.new_empty(B, N, dtype=torch.int64), second

    torch.library.custom_op(f"leanformer::{name}", run, mutates_args=()).register_fake(shapes)


def detached(weights: Tensor | None) -> Tensor | None:
    return None if weights is None else weights.detach()


def weights_or_ones(x: Tensor, weights: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``weights [B, N]`` detached in ``dtype``, or ones when None."""
    if weights is None:
        return torch.ones(x.shape[:2], dtype=dtype, device=x.device)
    return weights.detach().to(dtype)


def kernel_tokens(x: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
    """What the C++ clusterings take: the tokens widened as
    :func:`leanformer.ops.token_distances.centred` widens them (the kernels centre them
    themselves), and the weights in the tokens' type."""
    tokens = x.detach().to(torch.promote_types(x.dtype, torch.float32))
    return tokens, weights_or_ones(x, weights, tokens.dtype)


def finite_examples(tokens: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(tokens, w, bad [B])``: the examples that hold a NaN or inf replaced by zeros of
    weight 1, and which they were.

    The kernels refuse non-finite values, which would fail the whole batch for one bad
    image: such an example is clustered as zeros of weight 1 instead (any plan will do),
    and the caller makes its float outputs NaN (:func:`poison`), so the NaN stays confined
    to its own example, as with every other method.
    """
    bad = ~(tokens.isfinite().flatten(1).all(dim=1) & w.isfinite().all(dim=1))
    tokens = torch.where(bad[:, None, None], torch.zeros((), dtype=tokens.dtype), tokens)
    w = torch.where(bad[:, None], torch.ones((), dtype=w.dtype), w)
    return tokens, w, bad


def poison(values: Tensor, bad: Tensor) -> Tensor:
    """``values [B, ...]`` with the examples ``bad [B]`` set to NaN (see :func:`finite_examples`)."""
    nan = torch.full((), float("nan"), dtype=values.dtype)
    return torch.where(bad.view(-1, *([1] * (values.dim() - 1))), nan, values)
