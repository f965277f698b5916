"""Attention received without the whole attention matrix: equal to the explicit column sums."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leanformer.bench.memory import cpu_peak_mb
from leanformer.ops.attention import attention
from leanformer.ops.received import blocked_attention_received


def _qkv(b: int, h: int, n: int, d: int, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    # One qkv projection viewed per head, as the hosts do: q, k, v are strided views.
    qkv = torch.randn(b, n, 3, h, d, generator=g, dtype=dtype).mul(2.0).permute(2, 0, 3, 1, 4)
    return qkv.unbind(0)


def _sizes(b: int, n: int, num_prefix: int, *, seed: int = 1) -> torch.Tensor:
    """Sizes as pooling leaves them: prefix tokens stand for themselves, others for several."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 9, (b, n), generator=g).float()
    sizes[:, :num_prefix] = 1.0
    return sizes


def _explicit_float64(q, k, v, sizes=None, mask=None):
    """Obviously correct: softmax over the whole float64 logits, then column sums."""
    q, k, v = (t.double() for t in (q, k, v))
    logits = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if sizes is not None:
        logits = logits + sizes.double().log()[:, None, None, :]
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    probs = logits.softmax(dim=-1)
    return probs @ v, probs.sum(dim=(1, 2))


@pytest.mark.parametrize("n", [1, 7, 64, 197, 250])
@pytest.mark.parametrize("with_sizes", [False, True])
def test_received_equals_explicit_computation(n: int, with_sizes: bool) -> None:
    """Default blocks (64 rows at head size 16): one block up to 64 tokens, several above."""
    q, k, v = _qkv(3, 4, n, 16, seed=n)
    sizes = _sizes(3, n, num_prefix=min(2, n)) if with_sizes else None
    out, received = attention(q, k, v, sizes=sizes, return_received=True)
    ref_out, ref_received = _explicit_float64(q, k, v, sizes)
    assert received is not None and received.dtype == torch.float32
    torch.testing.assert_close(received.double(), ref_received, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-5, atol=1e-5)
    # Every query hands out mass 1 per head.
    torch.testing.assert_close(received.sum(-1), torch.full((3,), 4.0 * n), rtol=1e-5, atol=0)


@pytest.mark.parametrize("block_rows", [1, 3, 16, 61, 100])
def test_any_block_size_gives_the_same_result_in_float64(block_rows: int) -> None:
    q, k, v = _qkv(2, 3, 61, 8, dtype=torch.float64)
    sizes = _sizes(2, 61, num_prefix=1).double()
    bias = sizes.log()[:, None, None, :]
    out, received = blocked_attention_received(
        q, k, v, mask=bias, dropout_p=0.0, scale=8**-0.5, block_rows=block_rows
    )
    ref_out, ref_received = _explicit_float64(q, k, v, sizes)
    torch.testing.assert_close(received, ref_received, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)


def test_masks_with_a_query_dimension_are_cut_with_the_blocks() -> None:
    q, k, v = _qkv(2, 3, 37, 8, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(2, 1, 37, 37, generator=g) > 0.3
    keep |= torch.eye(37, dtype=torch.bool)  # every query sees at least itself
    out, received = attention(q, k, v, attn_mask=keep, return_received=True)  # blocks of 32 rows
    ref_out, ref_received = _explicit_float64(q, k, v, mask=keep)
    torch.testing.assert_close(received, ref_received)
    torch.testing.assert_close(out, ref_out)


def test_masked_keys_receive_nothing() -> None:
    q, k, v = _qkv(2, 3, 20, 2)  # head size 2: blocks of 8 rows
    keep = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    keep[0, ..., 15:] = False
    out, received = attention(q, k, v, attn_mask=keep, return_received=True)
    ref_out, ref_received = _explicit_float64(q, k, v, mask=keep)
    assert received is not None
    assert torch.all(received[0, 15:] == 0)
    torch.testing.assert_close(received.double(), ref_received, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-5, atol=1e-5)


def test_the_whole_attention_matrix_is_never_stored() -> None:
    b, h, n, d = 2, 4, 640, 16  # blocks of 64 rows: a tenth of the matrix
    q, k, v = _qkv(b, h, n, d)
    bias = _sizes(b, n, num_prefix=1).log()[:, None, None, :]
    matrix_mb = b * h * n * n * 4 / 2**20
    with torch.no_grad():
        blocked = cpu_peak_mb(
            lambda: blocked_attention_received(q, k, v, mask=bias, dropout_p=0.0, scale=0.25)
        )
        whole = cpu_peak_mb(
            lambda: blocked_attention_received(q, k, v, mask=bias, dropout_p=0.0, scale=0.25, block_rows=n)
        )
    assert whole >= matrix_mb  # the measurement sees the matrix when there is one
    # One block (the softmax overwrites the logits outside autograd) and O(N D).
    assert blocked < 0.2 * matrix_mb
    with torch.enable_grad():
        graphed = cpu_peak_mb(
            lambda: blocked_attention_received(
                q.requires_grad_(), k, v, mask=bias, dropout_p=0.0, scale=0.25
            )[1].sum()
        )
    assert graphed >= matrix_mb  # autograd keeps every block's probabilities for the backward


def test_gradients_through_blocks() -> None:
    q, k, v = (t.detach().requires_grad_() for t in _qkv(2, 2, 9, 4, dtype=torch.float64))
    bias = _sizes(2, 9, num_prefix=1).double().log()[:, None, None, :].requires_grad_()
    weights = torch.randn(2, 9, dtype=torch.float64)

    def loss(q, k, v, bias):
        out, received = blocked_attention_received(q, k, v, mask=bias, dropout_p=0.0, scale=0.5, block_rows=4)
        return out.square().sum() + (received * weights).sum()

    assert torch.autograd.gradcheck(loss, (q, k, v, bias))


def test_zero_queries_or_blocks_are_clear_errors() -> None:
    q, k, v = _qkv(1, 2, 5, 4)
    with pytest.raises(ValueError, match="at least one query"):
        attention(q[:, :, :0], k, v, return_received=True)
    with pytest.raises(ValueError, match="block_rows"):
        blocked_attention_received(q, k, v, mask=None, dropout_p=0.0, scale=0.5, block_rows=0)


@pytest.mark.slow
def test_compiles_without_graph_breaks_and_matches_eager() -> None:
    q, k, v = _qkv(2, 3, 50, 8)  # blocks of 32 rows: 32 + 18
    sizes = _sizes(2, 50, num_prefix=1)

    def fn(q, k, v, sizes):
        return attention(q, k, v, sizes=sizes, return_received=True)

    with torch.no_grad():
        eager = fn(q, k, v, sizes)
        compiled = torch.compile(fn, fullgraph=True)(q, k, v, sizes)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-5, atol=1e-5)
    fused = F.scaled_dot_product_attention(q, k, v, attn_mask=sizes.log()[:, None, None])
    torch.testing.assert_close(eager[0], fused)


def test_default_block_rows_bound_memory_and_shrink_with_many_keys() -> None:
    from leanformer.ops.received import default_block_rows

    assert default_block_rows(64, 197) == 256  # few keys: at most 4 * head_dim rows
    assert default_block_rows(64, 785) == 83  # many keys: a [83, 785] slab per head
    assert default_block_rows(32, 300) == 128
    assert default_block_rows(64, 10**6) == 16  # never fewer than 16 rows
