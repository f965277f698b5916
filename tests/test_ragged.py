"""Packed variable-length batches: padding round trip and attention per bucket."""

from __future__ import annotations

import pytest
import torch

from leanformer.layers.block import Block
from leanformer.ops.ragged import RaggedBatch


def _pack(seqs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(seqs)


def test_padded_layout_and_round_trip() -> None:
    lengths = torch.tensor([2, 3, 3, 5, 1])
    ragged = RaggedBatch(lengths, [1, 2, 2])  # [2] | [3, 3] | [5, 1]
    x = torch.arange(14 * 2, dtype=torch.float32).reshape(14, 2)
    parts = ragged.padded(x)
    assert [tuple(p.shape) for p, _ in parts] == [(1, 2, 2), (2, 3, 2), (2, 5, 2)]
    assert parts[0][1] is None and parts[1][1] is None  # equal lengths: no mask ...
    assert parts[1][0].data_ptr() == x[2:].data_ptr()  # ... and a view, not a copy
    padded, bias = parts[2]
    assert bias is not None and bias.shape == (2, 1, 1, 5)
    inf = float("-inf")
    assert bias[:, 0, 0].tolist() == [[0.0] * 5, [0.0] + [inf] * 4]
    assert ragged.padded(x.double())[2][1].dtype == torch.float64  # the mask follows the dtype
    assert ragged.padded(x)[2][1] is bias  # built once per dtype
    torch.testing.assert_close(padded[0], x[8:13])  # sequence of 5 starts at row 2+3+3
    torch.testing.assert_close(padded[1, 0], x[13])
    torch.testing.assert_close(ragged.packed([p for p, _ in parts]), x)


def test_block_on_packed_sequences_equals_each_sequence_alone() -> None:
    torch.manual_seed(0)
    block = Block(16, num_heads=2).eval()
    lengths = [4, 4, 3, 7, 6, 1]
    seqs = [torch.randn(n, 16) for n in lengths]
    ragged = RaggedBatch(torch.tensor(lengths), [2, 1, 2, 1])
    out = block(_pack(seqs), ragged=ragged)
    expected = torch.cat([block(s[None])[0] for s in seqs])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_gradients_reach_every_packed_token() -> None:
    block = Block(8, num_heads=2)
    block.eval()
    x = torch.randn(9, 8, requires_grad=True)
    out = block(x, ragged=RaggedBatch(torch.tensor([2, 5, 2]), [1, 2]))
    out.sum().backward()
    assert x.grad is not None and bool((x.grad.abs().sum(1) > 0).all())


@pytest.mark.parametrize(
    ("lengths", "buckets", "message"),
    [
        (torch.tensor([2, 3]), [1], "add up to 2"),
        (torch.tensor([2, 0]), [2], "at least one token"),
        (torch.tensor([[2]]), [1], "1-D integer"),
        (torch.tensor([2.0]), [1], "1-D integer"),
        (torch.tensor([2, 3]), [2, 0], "positive"),
    ],
)
def test_bad_layouts_raise(lengths: torch.Tensor, buckets: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RaggedBatch(lengths, buckets)


def test_wrong_packed_shape_raises() -> None:
    ragged = RaggedBatch(torch.tensor([2, 3]), [2])
    with pytest.raises(ValueError, match=r"expected packed tokens \[5, D\]"):
        ragged.padded(torch.randn(4, 3))
    with pytest.raises(ValueError, match="expected 1 buckets"):
        ragged.packed([torch.randn(2, 3, 3), torch.randn(1, 1, 3)])


def test_ragged_refuses_attention_masks() -> None:
    block = Block(8, num_heads=2).eval()
    ragged = RaggedBatch(torch.tensor([2, 3]), [2])
    with pytest.raises(ValueError, match="ragged"):
        block.attn(torch.randn(5, 8), attn_mask=torch.ones(1, 1, 1, 5, dtype=torch.bool), ragged=ragged)
