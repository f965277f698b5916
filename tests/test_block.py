"""Block (the Perceiver's and DRRT's transformer block): parity with timm's Block."""

from __future__ import annotations

import torch
from timm.models.vision_transformer import Block as TimmBlock

from leanformer.layers.block import Block


def test_matches_timm_block() -> None:
    ours = Block(32, num_heads=4, init_values=0.1, qk_norm=True).eval()
    theirs = TimmBlock(32, num_heads=4, init_values=0.1, qk_norm=True, qkv_bias=True).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(ours(x), theirs(x))


def test_attention_mask_hides_padded_tokens() -> None:
    block = Block(16, num_heads=2).eval()
    x = torch.randn(1, 6, 16)
    mask = torch.tensor([True] * 4 + [False] * 2)[None, None, None, :]
    torch.testing.assert_close(block(x, attn_mask=mask)[:, :4], block(x[:, :4]))


def test_forward_peak_memory_is_timms() -> None:
    """The attention output is freed before the MLP, as in timm's block: the MLP's hidden
    layer is the peak, and no more is live than in timm's forward."""
    from leanformer.bench.memory import cpu_peak_mb

    ours = Block(64, num_heads=2).eval()
    theirs = TimmBlock(64, num_heads=2, qkv_bias=True).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(8, 256, 64)
    with torch.inference_mode():
        ours(x), theirs(x)  # one-time allocations stay out of the figures
        assert cpu_peak_mb(lambda: ours(x)) <= cpu_peak_mb(lambda: theirs(x))
