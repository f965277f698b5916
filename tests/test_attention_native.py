"""The C++ attention-with-received-scores kernel against the tensor blocks it stands in for."""

from __future__ import annotations

import warnings

import pytest
import torch

from leanformer.ops import attention_native
from leanformer.ops.attention import attention, combine_masks, size_bias
from leanformer.ops.native import KERNELS, MissingKernelWarning, extension
from leanformer.ops.received import BlockShape, blocked_attention_received


def _qkv(b: int, h: int, nq: int, nk: int, d: int, *, seed: int, dtype: torch.dtype):
    """q from one projection, k and v as strided views of another, as the hosts make them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, h, d, generator=g, dtype=dtype).mul(2.0).transpose(1, 2)
    kv = torch.randn(b, nk, 2, h, d, generator=g, dtype=dtype).mul(2.0).permute(2, 0, 3, 1, 4)
    return q, kv[0], kv[1]


def _plain(q, k, v, mask, scale=0.3):
    """The tensor blocks as one block: the plain computation through the whole matrix."""
    items, heads = torch.broadcast_shapes(q.shape[:2], (1, 1) if mask is None else mask.shape[:-2][-2:])
    block = BlockShape(items, heads, q.shape[2])
    return blocked_attention_received(q, k, v, mask=mask, dropout_p=0.0, scale=scale, block=block)


def _kernel(q, k, v, mask, scale=0.3):
    out, received = blocked_attention_received(q, k, v, mask=mask, dropout_p=0.0, scale=scale)
    return out, received


def _masks(b: int, h: int, nq: int, nk: int, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(7)
    sizes = torch.randint(1, 9, (b, nk), generator=g).to(dtype)
    keep = torch.rand(b, 1, nq, nk, generator=g) > 0.3
    keep[..., 0] = True  # every query may attend somewhere
    return {
        "none": None,
        "sizes": size_bias(sizes, dtype),
        "full": torch.randn(b, h, nq, nk, generator=g, dtype=dtype),
        "boolean": combine_masks(size_bias(sizes, dtype), keep, dtype),
        "transposed": torch.randn(b, h, nk, nq, generator=g, dtype=dtype).transpose(-2, -1),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("b", "h", "nq", "nk", "d"), [(2, 3, 197, 197, 16), (1, 2, 1, 9, 8), (3, 1, 40, 785, 32)]
)
@pytest.mark.parametrize("mask_name", ["none", "sizes", "full", "boolean", "transposed"])
def test_kernel_equals_the_plain_blocks(
    dtype: torch.dtype, b: int, h: int, nq: int, nk: int, d: int, mask_name: str
) -> None:
    q, k, v = _qkv(b, h, nq, nk, d, seed=nq + nk, dtype=dtype)
    mask = _masks(b, h, nq, nk, dtype)[mask_name]
    with torch.no_grad():
        out, received = _kernel(q, k, v, mask)
        ref_out, ref_received = _plain(q, k, v, mask)
    # float32: the kernel's exp is within 2 ulps of the library's; sums in another order.
    tol = {"rtol": 2e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-13, "atol": 1e-13}
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(received, ref_received, **tol)
    assert out.dtype == received.dtype == dtype


def test_masked_keys_receive_exactly_nothing() -> None:
    q, k, v = _qkv(2, 2, 30, 30, 8, seed=0, dtype=torch.float32)
    keep = torch.ones(2, 1, 1, 30, dtype=torch.bool)
    keep[..., 20:] = False
    with torch.no_grad():
        _, received = attention(q, k, v, attn_mask=keep, return_received=True)
    assert received is not None and torch.all(received[:, 20:] == 0)
    torch.testing.assert_close(received.sum(-1), torch.full((2,), 2.0 * 30))


def test_softmax_stays_exact_over_a_wide_range_of_logits() -> None:
    """Logits spread over hundreds (peaked attention): probabilities down to the smallest
    floats, and ones that underflow. Against float64, the kernel's float32 error is the
    float32 blocks' own (the logits' rounding), not more."""
    q, k, v = _qkv(1, 2, 50, 60, 16, seed=3, dtype=torch.float64)
    q = q * 8.0
    with torch.no_grad():
        exact = _plain(q, k, v, None)
        kernel = _kernel(q.float(), k.float(), v.float(), None)
        blocks = _plain(q.float(), k.float(), v.float(), None)
    for got, library, want in zip(kernel, blocks, exact, strict=True):
        kernel_error = (got.double() - want).abs().max().item()
        library_error = (library.double() - want).abs().max().item()
        assert library_error > 0 and kernel_error <= 1.5 * library_error + 1e-7


def test_a_row_with_every_key_masked_gives_nan_like_the_blocks() -> None:
    q, k, v = _qkv(1, 1, 4, 6, 8, seed=0, dtype=torch.float32)
    mask = torch.zeros(1, 1, 4, 6)
    mask[0, 0, 2] = float("-inf")
    with torch.no_grad():
        out, _ = _kernel(q, k, v, mask)
        ref_out, _ = _plain(q, k, v, mask)
    assert torch.isnan(out[0, 0, 2]).all() and torch.isnan(ref_out[0, 0, 2]).all()
    torch.testing.assert_close(out[0, 0, [0, 1, 3]], ref_out[0, 0, [0, 1, 3]])


def test_a_mask_with_more_heads_than_q_makes_as_many_outputs() -> None:
    q, k, v = _qkv(2, 1, 12, 12, 8, seed=1, dtype=torch.float32)
    mask = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        out, received = _kernel(q, k, v, mask)
        ref_out, ref_received = _plain(q, k, v, mask)
    assert out.shape == (2, 3, 12, 8)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(received, ref_received)


def test_query_blocks_and_threads_do_not_change_the_result(monkeypatch) -> None:
    """Tasks split the queries into blocks (the same up to rounding) and run on any thread
    (the same numbers)."""
    q, k, v = _qkv(2, 3, 100, 100, 16, seed=5, dtype=torch.float32)
    mask = _masks(2, 3, 100, 100, torch.float32)["sizes"]
    threads = torch.get_num_threads()
    with torch.no_grad():
        one_block = _kernel(q, k, v, mask)
        monkeypatch.setattr(attention_native, "_TASK_LOGITS", 100 * 16)  # 16-row blocks
        blocks = _kernel(q, k, v, mask)
        try:
            torch.set_num_threads(1)
            serial = _kernel(q, k, v, mask)
        finally:
            torch.set_num_threads(threads)
    # A BLAS product of other rows may round otherwise; the shares add in other groups.
    for got, want in zip(blocks, one_block, strict=True):
        torch.testing.assert_close(got, want)  # outputs up to about 8
    for got, want in zip(serial, blocks, strict=True):
        assert torch.equal(got, want)


def test_the_kernel_writes_nothing_it_reads() -> None:
    q, k, v = _qkv(2, 2, 20, 20, 8, seed=2, dtype=torch.float32)
    mask = torch.randn(2, 1, 1, 20)
    before = [t.clone() for t in (q, k, v, mask)]
    with torch.no_grad():
        _kernel(q, k, v, mask)
    for got, want in zip((q, k, v, mask), before, strict=True):
        assert torch.equal(got, want)


def test_autograd_and_dropout_take_the_blocks_and_flop_counters_count_the_kernel(monkeypatch) -> None:
    """The kernel has no backward and no dropout; a FLOP counter counts its two products
    through the op's formula, as it counts the blocks'."""
    calls: list[int] = []
    real = attention_native.attention_received
    monkeypatch.setattr(attention_native, "attention_received", lambda *a: calls.append(1) or real(*a))
    q, k, v = _qkv(1, 2, 10, 10, 8, seed=4, dtype=torch.float32)
    with torch.no_grad():
        _kernel(q, k, v, None)
    assert calls == [1]
    q.requires_grad_(True)
    out, received = _kernel(q, k, v, None)
    (out.sum() + received.square().sum()).backward()
    assert q.grad is not None and calls == [1]
    with torch.no_grad():
        blocked_attention_received(q, k, v, mask=None, dropout_p=0.5, scale=0.3)
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            _kernel(q, k, v, None)
    assert calls == [1, 1]
    assert counter.get_total_flops() == 2 * (2 * 2 * 10 * 10 * 8)  # both products seen


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")  # forward AD's import
def test_forward_tangents_take_the_blocks_and_negated_views_are_read_as_values() -> None:
    """The kernel reads values only: a forward-mode tangent must not be dropped in silence
    (the blocks take it, and say that their softmax has no forward AD), and a view stored
    negated (the imaginary part of a conjugate) must be read as the values it shows."""
    import torch.autograd.forward_ad as forward_ad

    q, k, v = _qkv(2, 2, 9, 11, 8, seed=8, dtype=torch.float64)
    mask = _masks(2, 2, 9, 11, torch.float64)["sizes"]
    with torch.no_grad():
        want = _plain(q, k, v, mask)
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(q, torch.randn_like(q))
            assert not attention_native.applies(dual, k, v, mask, 0.0)
            with pytest.raises(NotImplementedError, match="forward AD"):
                _kernel(dual, k, v, mask)

    def stored_negated(t: torch.Tensor) -> torch.Tensor:
        view = torch.complex(torch.zeros_like(t), -t).conj().imag
        assert view.is_neg() and torch.equal(view, t)
        return view

    with torch.no_grad():
        got = _kernel(stored_negated(q), stored_negated(k), stored_negated(v), stored_negated(mask))
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_without_the_kernel_attention_warns_once_and_still_computes(monkeypatch) -> None:
    q, k, v = _qkv(1, 2, 10, 10, 8, seed=6, dtype=torch.float32)
    with torch.no_grad():
        want = _kernel(q, k, v, None)
    monkeypatch.setattr(KERNELS[attention_native.OP], "extension", None)
    monkeypatch.setattr(KERNELS[attention_native.OP], "warned", False)
    with torch.no_grad():
        with pytest.warns(MissingKernelWarning, match="without its C\\+\\+ attention kernel"):
            first = _kernel(q, k, v, None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            second = _kernel(q, k, v, None)
    for got in (first, second):
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


def test_bad_inputs_to_the_kernel_are_clear_errors() -> None:
    q, k, v = _qkv(1, 2, 5, 6, 8, seed=0, dtype=torch.float32)
    kernel = extension(attention_native.OP)
    with pytest.raises(RuntimeError, match="k must be"):
        kernel.attention_received(q, k[:, :1], v, None, 0.3, 8)
    with pytest.raises(RuntimeError, match="v must be"):
        kernel.attention_received(q, k, v[..., :4], None, 0.3, 8)
    with pytest.raises(RuntimeError, match="one floating type"):
        kernel.attention_received(q, k.double(), v, None, 0.3, 8)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernel.attention_received(torch.randn(1, 2, 8, 5).transpose(-2, -1), k, v, None, 0.3, 8)
    with pytest.raises(RuntimeError, match="mask must be"):
        kernel.attention_received(q, k, v, torch.zeros(1, 1, 1, 6), 0.3, 8)
    with pytest.raises(RuntimeError, match="block_rows"):
        kernel.attention_received(q, k, v, None, 0.3, 0)


def test_one_query_with_a_narrow_row_stride_and_no_keys() -> None:
    """A single query row whose stride is below its width (a transposed view) is copied
    for the BLAS product; with no keys at all the tensor blocks answer."""
    q = torch.randn(2, 3, 8, 1).transpose(-1, -2)  # [2, 3, 1, 8], row stride 1
    _, k, v = _qkv(2, 3, 1, 5, 8, seed=8, dtype=torch.float32)
    with torch.no_grad():
        got = _kernel(q, k, v, None)
        want = _plain(q, k, v, None)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
        empty_k, empty_v = k[:, :, :0], v[:, :, :0]
        out, received = _kernel(q, empty_k, empty_v, None)
        ref_out, ref_received = _plain(q, empty_k, empty_v, None)
    torch.testing.assert_close(out, ref_out)
    assert received.shape == ref_received.shape == (2, 0)


def test_a_mask_on_another_device_is_refused_by_the_kernel() -> None:
    q, k, v = _qkv(1, 2, 4, 4, 8, seed=0, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        extension(attention_native.OP).attention_received(
            q, k, v, torch.zeros(1, 2, 4, 4, device="meta"), 0.3, 8
        )
