"""The attention op: fused path with sizes equals attending to repeated keys; scores are correct."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leanformer.ops import attention as attention_module
from leanformer.ops.attention import attention, reference_attention


def _qkv(b: int = 2, h: int = 3, nq: int = 5, nk: int = 7, d: int = 8):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for n in (nq, nk, nk))


@pytest.mark.parametrize("return_received", [False, True])
def test_sizes_equal_repeated_keys(return_received: bool) -> None:
    q, k, v = _qkv()
    sizes = torch.randint(1, 4, (2, 7)).double()
    out, received = attention(q, k, v, sizes=sizes, return_received=return_received)
    ref_out, ref_received = reference_attention(q, k, v, sizes=sizes)
    torch.testing.assert_close(out, ref_out)
    if return_received:
        torch.testing.assert_close(received, ref_received)
    else:
        assert received is None


def test_received_is_column_sum_over_heads_and_queries() -> None:
    q, k, v = _qkv()
    _, received = attention(q, k, v, return_received=True)
    probs = torch.softmax(q @ k.transpose(-2, -1) / 8**0.5, dim=-1)
    torch.testing.assert_close(received, probs.sum(dim=(1, 2)))
    # every query distributes mass 1 over the keys, per head
    torch.testing.assert_close(received.sum(-1), torch.full((2,), 3.0 * 5, dtype=torch.float64))


def test_fused_kernel_used_unless_scores_requested(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("attn_mask") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", spy)
    q, k, v = _qkv()
    attention(q, k, v, sizes=torch.ones(2, 7, dtype=torch.float64))
    assert calls == [True]
    attention(q, k, v, return_received=True)
    assert calls == [True]  # scores: probabilities a block of queries at a time, no fused call


def test_boolean_mask_blocks_keys() -> None:
    q, k, v = _qkv()
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    mask[..., -2:] = False
    out, received = attention(q, k, v, attn_mask=mask, return_received=True)
    fused, _ = attention(q, k, v, attn_mask=mask)
    ref, _ = attention(q, k[:, :, :5], v[:, :, :5])
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(fused, ref)
    assert torch.all(received[:, -2:] == 0)


def test_mask_broadcasting_beyond_the_logits_with_scores() -> None:
    """A mask with a larger batch than q/k/v broadcasts (the in-place bias add must not break it)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(3, 1, 1, 5, generator=g, dtype=torch.float64)
    out, received = attention(q, k, v, attn_mask=bias, return_received=True)
    expanded = [t.expand(3, -1, -1, -1) for t in (q, k, v)]
    ref_out, ref_received = attention(*expanded, attn_mask=bias, return_received=True)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(received, ref_received)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(*expanded, attn_mask=bias))
