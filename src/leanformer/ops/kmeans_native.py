"""K-Means iterations in C++ for eager CPU runs (``kmeans_cpu.cpp``), when built.

The batched plan in :mod:`leanformer.ops.clustering` runs a dozen small tensor
operations per iteration, whose fixed cost outweighs the arithmetic on small models.
The kernel runs the same algorithm (seeds as the first centres, assign to the nearest
centre, move every centre with weight to its members' weighted mean, stop at the fixed
point) one example at a time, examples in parallel, the distances to the centres one
BLAS product per assignment. It computes the same products as the batched plan, so a
FLOP counter is given the batched plan instead (the counts would be equal). Plans equal
the batched code's up to the float rounding of the distances.
"""

from __future__ import annotations

from torch import Tensor

from leanformer.ops.native import MissingKernelNotice, counting, load

_kernel = load("_kmeans_cpu")
_missing = MissingKernelNotice(
    "K-Means kernel (leanformer.ops._kmeans_cpu), so K-Means runs its batched PyTorch code "
    "on the CPU: the same plans, slower",
)


def kernel_available() -> bool:
    """Whether the package was built with the C++ K-Means iterations."""
    return _kernel is not None


def applies() -> bool:
    """Whether eager CPU K-Means may run the kernel: built, and no FLOP counter watching.
    Says once per process when the package was built without it."""
    if _kernel is None:
        _missing.warn_once(stacklevel=4)  # past applies, kmeans_plan and its no_grad wrapper
        return False
    return not counting()


def iterate_on_cpu(x: Tensor, weights: Tensor, seeds: Tensor, max_iters: int) -> tuple[Tensor, Tensor]:
    """Up to ``max_iters`` centre updates from the tokens ``seeds [B, K]`` ->
    ``(assign [B, N], centres [B, K, C])``.

    ``x [B, N, C]`` CPU tokens (each example's rows contiguous, as in ``x[:, 1:]``; other
    layouts are copied) and ``weights [B, N]``, one floating type, float32 or wider. The
    kernel centres each example on its mean token, as
    :func:`leanformer.ops.token_distances.centred` does; the centres are in the tokens'
    coordinates.
    """
    if _kernel is None:
        raise RuntimeError("leanformer was installed without its C++ K-Means kernel")
    return _kernel.kmeans_iterate(x, weights, seeds, max_iters)
