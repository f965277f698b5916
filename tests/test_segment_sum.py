"""segment_sum against a per-example loop, with empty segments, dtypes and gradients;
the sums without gradient with and without the C++ kernel that eager CPU inference takes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from leanformer.ops import segment_sum_native
from leanformer.ops.native import kernel_available
from leanformer.ops.segment_sum import flat_rows, marked_first, row_table, segment_sum
from native_kernels import without_kernel


@pytest.fixture(params=["kernel", "embedding_bag"])
def eager_sums(request, monkeypatch) -> Iterator[None]:
    """A test that uses it runs twice: with the C++ sums (where they apply) and without them."""
    if request.param == "embedding_bag":
        with without_kernel(monkeypatch, segment_sum_native):
            yield
    else:
        assert kernel_available(segment_sum_native.OP), "the package was built without its C++ kernels"
        yield


def _ref(values: torch.Tensor, segment: torch.Tensor, s: int, weights: torch.Tensor | None) -> torch.Tensor:
    B, N, D = values.shape
    out = torch.zeros(B, s, D, dtype=values.dtype)
    for b in range(B):
        for i in range(N):
            w = 1.0 if weights is None else weights[b, i]
            out[b, segment[b, i]] += w * values[b, i]
    return out


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_loop_reference_with_empty_segments(weighted: bool, dtype: torch.dtype, eager_sums) -> None:
    g = torch.Generator().manual_seed(0)
    B, N, D, S = 3, 11, 5, 7
    values = torch.randn(B, N, D, generator=g, dtype=dtype)
    segment = torch.randint(0, S - 2, (B, N), generator=g)  # the last two segments stay empty
    segment[1] = 3  # one example with a single segment
    weights = torch.rand(B, N, generator=g, dtype=dtype) if weighted else None
    out = segment_sum(values, segment, S, weights)
    assert out.shape == (B, S, D) and out.dtype == dtype
    torch.testing.assert_close(out, _ref(values, segment, S, weights))
    assert torch.equal(out[:, S - 2 :], torch.zeros(B, 2, D, dtype=dtype))


def test_non_contiguous_values(eager_sums) -> None:
    g = torch.Generator().manual_seed(1)
    values = torch.randn(2, 6, 8, generator=g)[:, :, ::2]
    segment = torch.randint(0, 3, (2, 6), generator=g)
    torch.testing.assert_close(segment_sum(values, segment, 3), _ref(values, segment, 3, None))


@pytest.mark.parametrize(("b", "n", "d"), [(0, 4, 3), (2, 0, 3), (2, 4, 0), (3, 1, 5), (3, 6, 1)])
def test_empty_and_single_row_or_channel_shapes(b: int, n: int, d: int, eager_sums) -> None:
    g = torch.Generator().manual_seed(4)
    values = torch.randn(b, n, d, generator=g)
    segment = torch.randint(0, 3, (b, n), generator=g)
    weights = torch.rand(b, n, generator=g)
    out = segment_sum(values, segment, 3, weights)
    assert out.shape == (b, 3, d)
    torch.testing.assert_close(out, _ref(values, segment, 3, weights))


def test_gradcheck_values_and_weights() -> None:
    g = torch.Generator().manual_seed(2)
    values = torch.randn(2, 7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weights = (torch.rand(2, 7, generator=g, dtype=torch.float64) + 0.1).requires_grad_()
    segment = torch.randint(0, 4, (2, 7), generator=g)
    assert torch.autograd.gradcheck(lambda v, w: segment_sum(v, segment, 4, w), (values, weights))


def test_examples_selects_rows_in_place() -> None:
    """``examples``: the same sums as on ``values[examples]``, in the order given."""
    g = torch.Generator().manual_seed(3)
    values = torch.randn(5, 9, 4, generator=g)
    examples = torch.tensor([3, 0, 4])
    segment = torch.randint(0, 3, (3, 9), generator=g)
    weights = torch.rand(3, 9, generator=g)
    out = segment_sum(values, segment, 3, weights, examples=examples)
    torch.testing.assert_close(out, _ref(values[examples], segment, 3, weights))


def test_row_table_reads_a_prefix_stripped_view_in_place() -> None:
    base = torch.randn(3, 8, 4)
    x = base[:, 1:]  # as a block hands tokens without the class token to a reducer
    table, step = row_table(x)
    assert step == 8 and table.data_ptr() == x.data_ptr()  # a view, not a copy
    idx = torch.tensor([[0, 6], [3, 2], [5, 5]])
    torch.testing.assert_close(
        table.index_select(0, flat_rows(idx, step)).view(3, 2, 4), x.gather(1, idx[..., None].expand(3, 2, 4))
    )
    # Layouts whose rows are not contiguous are copied into the plain [B * N, D] table.
    strided = base[:, :, ::2]
    table, step = row_table(strided)
    assert step == 8 and torch.equal(table.view(3, 8, 2), strided)
    assert row_table(base)[1] == 8


def test_prefix_stripped_view_sums_and_gradients() -> None:
    g = torch.Generator().manual_seed(4)
    base = torch.randn(2, 8, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weights = (torch.rand(2, 7, generator=g, dtype=torch.float64) + 0.1).requires_grad_()
    segment = torch.randint(0, 4, (2, 7), generator=g)
    out = segment_sum(base[:, 1:], segment, 4, weights)
    torch.testing.assert_close(out, _ref(base[:, 1:].detach(), segment, 4, weights.detach()))
    assert torch.autograd.gradcheck(lambda v, w: segment_sum(v[:, 1:], segment, 4, w), (base, weights))
    examples = torch.tensor([1])
    torch.testing.assert_close(
        segment_sum(base[:, 1:], segment[:1], 4, weights[:1], examples=examples),
        _ref(base[1:, 1:].detach(), segment[:1], 4, weights[:1].detach()),
    )


def test_marked_first_lists_marked_entries_then_the_rest_each_in_order() -> None:
    g = torch.Generator().manual_seed(0)
    marked = torch.rand(6, 17, generator=g) < 0.3
    marked[0] = False  # a row with none marked
    marked[1] = True  # and one with all
    for count in (0, 5, 17):
        got = marked_first(marked, count)
        for row, flags in zip(got.tolist(), marked.tolist(), strict=True):
            ref = [i for i, f in enumerate(flags) if f] + [i for i, f in enumerate(flags) if not f]
            assert row == ref[:count]
