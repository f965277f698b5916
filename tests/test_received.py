"""Attention received without the attention matrix: equal to the explicit column sums."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leanformer.bench.memory import cpu_peak_mb
from leanformer.ops import received as received_module
from leanformer.ops.attention import attention
from leanformer.ops.received import fused_received_supported, key_bias_fits


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


def _explicit_float64(q, k, v, sizes=None, key_mask=None):
    """Obviously correct: softmax over the full float64 logits, then column sums."""
    q, k, v = (t.double() for t in (q, k, v))
    logits = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if sizes is not None:
        logits = logits + sizes.double().log()[:, None, None, :]
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask, float("-inf"))
    probs = logits.softmax(dim=-1)
    return probs @ v, probs.sum(dim=(1, 2))


@pytest.mark.parametrize("n", [1, 7, 64, 197, 250])
@pytest.mark.parametrize("with_sizes", [False, True])
def test_received_equals_explicit_computation(n: int, with_sizes: bool) -> None:
    q, k, v = _qkv(3, 4, n, 16, seed=n)
    sizes = _sizes(3, n, num_prefix=min(2, n)) if with_sizes else None
    with torch.no_grad():
        out, received = attention(q, k, v, sizes=sizes, return_received=True)
    ref_out, ref_received = _explicit_float64(q, k, v, sizes)
    assert received is not None and received.dtype == torch.float32
    torch.testing.assert_close(received.double(), ref_received, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-5, atol=1e-5)
    # Every query hands out mass 1 per head.
    torch.testing.assert_close(received.sum(-1), torch.full((3,), 4.0 * n), rtol=1e-5, atol=0)


def test_float64_inputs_are_exact_to_float64_rounding() -> None:
    q, k, v = _qkv(2, 3, 61, 8, dtype=torch.float64)
    sizes = _sizes(2, 61, num_prefix=1).double()
    with torch.no_grad():
        _, received = attention(q, k, v, sizes=sizes, return_received=True)
    _, ref = _explicit_float64(q, k, v, sizes)
    assert received is not None and received.dtype == torch.float64
    torch.testing.assert_close(received, ref, rtol=1e-12, atol=1e-12)


def test_masked_keys_receive_nothing() -> None:
    q, k, v = _qkv(2, 3, 20, 8)
    keep = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    keep[0, ..., 15:] = False
    with torch.no_grad():
        out, received = attention(q, k, v, attn_mask=keep, return_received=True)
    ref_out, ref_received = _explicit_float64(q, k, v, key_mask=keep)
    assert received is not None
    assert torch.all(received[0, 15:] == 0)
    torch.testing.assert_close(received.double(), ref_received, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-5, atol=1e-5)


def test_no_attention_matrix_is_stored() -> None:
    b, h, n, d = 2, 4, 300, 16
    q, k, v = _qkv(b, h, n, d)
    sizes = _sizes(b, n, num_prefix=1)
    matrix_mb = b * h * n * n * 4 / 2**20
    with torch.no_grad():
        fused = cpu_peak_mb(lambda: attention(q, k, v, sizes=sizes, return_received=True))
        explicit = cpu_peak_mb(lambda: attention(q, k, v, sizes=sizes, return_received=True, dropout_p=1e-9))
    assert explicit >= matrix_mb  # the measurement sees the matrix when there is one
    assert fused < matrix_mb / 4


def test_explicit_and_fused_paths_agree_where_both_apply() -> None:
    """A query-dependent mask (constant over queries here) takes the explicit path."""
    q, k, v = _qkv(2, 3, 33, 8)
    bias = torch.randn(2, 1, 1, 33)
    with torch.no_grad():
        out, received = attention(q, k, v, attn_mask=bias, return_received=True)
        out_x, received_x = attention(q, k, v, attn_mask=bias.expand(2, 1, 33, 33), return_received=True)
    assert not key_bias_fits(q, k, bias.expand(2, 1, 33, 33))
    torch.testing.assert_close(received, received_x)
    torch.testing.assert_close(out, out_x)


def test_scores_keep_their_gradient() -> None:
    """With a gradient through the scores, the explicit path runs and the gradient is right."""
    q, k, v = (t.detach().double().requires_grad_() for t in _qkv(2, 2, 9, 4))
    assert not fused_received_supported(q, k, v, None, 0.0)
    weights = torch.randn(2, 9, dtype=torch.float64)

    def loss(q, k, v):
        return (attention(q, k, v, return_received=True)[1] * weights).sum()

    assert torch.autograd.gradcheck(loss, (q, k, v))


def test_fused_path_taken_in_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = received_module.attention_with_received

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    import leanformer.ops.attention as attention_module

    monkeypatch.setattr(attention_module, "attention_with_received", spy)
    q, k, v = _qkv(1, 2, 5, 4)
    with torch.no_grad():
        attention(q, k, v, return_received=True)
        attention(q, k, v, return_received=True, dropout_p=0.1)  # dropout: explicit
    assert calls == [1]


@pytest.mark.slow
def test_compiles_without_graph_breaks_and_matches_eager() -> None:
    q, k, v = _qkv(2, 3, 50, 8)
    sizes = _sizes(2, 50, num_prefix=1)

    def fn(q, k, v, sizes):
        out, received = attention(q, k, v, sizes=sizes, return_received=True)
        return out, received

    with torch.no_grad():
        eager = fn(q, k, v, sizes)
        compiled = torch.compile(fn, fullgraph=True)(q, k, v, sizes)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        eager[0], F.scaled_dot_product_attention(q, k, v, attn_mask=sizes.log()[:, None, None])
    )
