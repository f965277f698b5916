"""Minimal reproduction: inductor miscompiles ``as_strided`` over a view of an intermediate.

``ops/segment_sum.row_table`` once read the class-token-stripped tokens ``x[:, 1:]`` of a
contiguous ``x [B, N + 1, C]`` as one 2-D table of rows with ``as_strided`` (no copy).
Eager PyTorch and ``backend="aot_eager"`` give the table; ``inductor`` reads other
memory (the intermediate is laid out differently, so the strides point elsewhere), and
an explicit ``storage_offset`` is taken relative to the view instead of the storage.
``row_table`` therefore returns a plain ``reshape`` while compiling.

Run: ``python benchmarks/repro_inductor_as_strided.py`` (prints the largest difference
between eager and each backend, for the default and an explicit storage offset).
"""

from __future__ import annotations

import torch


def rows_without_first(y: torch.Tensor, explicit_offset: bool) -> torch.Tensor:
    x = y * 2.0  # an intermediate, not a graph input
    v = x[:, 1:]  # each example without its first row: a view
    B, N, D = v.shape
    step = v.stride(0) // D  # rows between examples in x
    size, stride = ((B - 1) * step + N, D), (D, 1)
    if explicit_offset:
        return v.as_strided(size, stride, D)  # x[:, 1:] starts one row into x's storage
    return v.as_strided(size, stride)  # default: the view's own storage offset


def main() -> None:
    y = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    print(f"torch {torch.__version__}")
    for explicit in (False, True):
        eager = rows_without_first(y, explicit)
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            compiled = torch.compile(rows_without_first, fullgraph=True, backend=backend)(y, explicit)
            diff = (eager - compiled).abs().max().item()
            offset = "explicit" if explicit else "default"
            print(f"{offset:>8} storage offset, {backend:>9}: max |eager - compiled| = {diff:g}")


if __name__ == "__main__":
    main()
