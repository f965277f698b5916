"""Attention received without the whole attention matrix: equal to the explicit column sums."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leanformer.bench.memory import cpu_peak_mb
from leanformer.ops.attention import attention
from leanformer.ops.received import BlockShape, blocked_attention_received, default_block


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


@pytest.mark.parametrize(
    "block",
    [
        (2, 3, 1),
        (2, 3, 16),
        (2, 3, 61),
        (2, 3, 100),
        (1, 1, 3),
        (1, 2, 61),
        (1, 3, 16),
        (2, 1, 7),
        (3, 4, 61),
    ],
)
def test_any_block_shape_gives_the_same_result_in_float64(block: tuple[int, int, int]) -> None:
    """Blocks across items, heads and queries, including ones that do not divide them."""
    q, k, v = _qkv(2, 3, 61, 8, dtype=torch.float64)
    sizes = _sizes(2, 61, num_prefix=1).double()
    bias = sizes.log()[:, None, None, :]
    out, received = blocked_attention_received(
        q, k, v, mask=bias, dropout_p=0.0, scale=8**-0.5, block=BlockShape(*block)
    )
    ref_out, ref_received = _explicit_float64(q, k, v, sizes)
    torch.testing.assert_close(received, ref_received, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block", [None, (2, 3, 32), (1, 2, 10), (1, 1, 37)])
@pytest.mark.parametrize("mask_shape", [(2, 1, 37, 37), (2, 3, 37, 37), (1, 3, 37, 37), (37, 37), (3, 1, 37)])
def test_masks_are_cut_with_the_blocks(
    block: tuple[int, int, int] | None, mask_shape: tuple[int, ...]
) -> None:
    """A mask's item, head and query axes are cut with each block; size-1 axes broadcast."""
    q, k, v = _qkv(2, 3, 37, 8, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(mask_shape, generator=g) > 0.3
    keep[..., 0] = True  # every query sees at least one key
    mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, float("-inf"))
    out, received = blocked_attention_received(
        q, k, v, mask=mask, dropout_p=0.0, scale=8**-0.5, block=None if block is None else BlockShape(*block)
    )
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


@pytest.mark.parametrize("layout", ["eager_cpu", "compiled"])
def test_the_whole_attention_matrix_is_never_stored(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager on the CPU a block is one head (a sixteenth of the matrix); traced for an
    accelerator, or with autograd, 64 rows of every head (a tenth). (Compiled for the CPU
    without autograd the blocks are the eager ones, in one opaque call.)"""
    b, h, n, d = 2, 8, 640, 16
    if layout == "compiled":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, v = _qkv(b, h, n, d)
    bias = _sizes(b, n, num_prefix=1).log()[:, None, None, :]
    matrix_mb = b * h * n * n * 4 / 2**20
    expected = BlockShape(1, 1, n) if layout == "eager_cpu" else BlockShape(b, h, 64)
    block = default_block(q, n)
    assert block == expected
    with torch.no_grad():
        blocked = cpu_peak_mb(
            lambda: blocked_attention_received(q, k, v, mask=bias, dropout_p=0.0, scale=0.25, block=block)
        )
        whole = cpu_peak_mb(
            lambda: blocked_attention_received(
                q, k, v, mask=bias, dropout_p=0.0, scale=0.25, block=BlockShape(b, h, n)
            )
        )
    assert whole >= matrix_mb  # the measurement sees the matrix when there is one
    # One block (the softmax overwrites the logits outside autograd) and O(N D).
    assert blocked < 0.2 * matrix_mb
    with torch.enable_grad():
        graphed = cpu_peak_mb(
            lambda: blocked_attention_received(
                q.requires_grad_(), k, v, mask=bias, dropout_p=0.0, scale=0.25, block=block
            )[1].sum()
        )
    assert graphed >= matrix_mb  # autograd keeps every block's probabilities for the backward


def test_gradients_through_blocks() -> None:
    q, k, v = (t.detach().requires_grad_() for t in _qkv(2, 2, 9, 4, dtype=torch.float64))
    bias = _sizes(2, 9, num_prefix=1).double().log()[:, None, None, :].requires_grad_()
    weights = torch.randn(2, 9, dtype=torch.float64)

    def loss(q, k, v, bias):
        out, received = blocked_attention_received(
            q, k, v, mask=bias, dropout_p=0.0, scale=0.5, block=BlockShape(1, 1, 4)
        )
        return out.square().sum() + (received * weights).sum()

    assert torch.autograd.gradcheck(loss, (q, k, v, bias))


def test_zero_queries_or_blocks_are_clear_errors() -> None:
    q, k, v = _qkv(1, 2, 5, 4)
    with pytest.raises(ValueError, match="at least one query"):
        attention(q[:, :, :0], k, v, return_received=True)
    with pytest.raises(ValueError, match="at most 4 dimensions"):
        attention(q, k, v, attn_mask=torch.zeros(2, 1, 2, 5, 5), return_received=True)
    for block in [(0, 2, 5), (1, 0, 5), (1, 2, 0)]:
        with pytest.raises(ValueError, match="every side of a block must be >= 1"):
            blocked_attention_received(q, k, v, mask=None, dropout_p=0.0, scale=0.5, block=BlockShape(*block))


@pytest.mark.slow
@pytest.mark.parametrize("opaque", [True, False], ids=["opaque", "traced"])
def test_compiles_without_graph_breaks_and_matches_eager(
    opaque: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled for the CPU without autograd, the blocks are one opaque call into the eager
    code (``leanformer.attention_received``, from ``_OPAQUE_FROM_LOGITS``) or traced, in
    the one graph."""
    from leanformer.ops import received

    monkeypatch.setattr(received, "_OPAQUE_FROM_LOGITS", 1 if opaque else 10**9)
    q, k, v = _qkv(2, 3, 50, 8)  # traced: blocks of 32 rows, 32 + 18
    sizes = _sizes(2, 50, num_prefix=1)

    def fn(q, k, v, sizes):
        return attention(q, k, v, sizes=sizes, return_received=True)

    graphs: list[str] = []

    def recording(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm.code)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, inputs)

    with torch.no_grad():
        eager = fn(q, k, v, sizes)
        compiled = torch.compile(fn, fullgraph=True, backend=recording)(q, k, v, sizes)
    assert len(graphs) == 1 and ("leanformer.attention_received" in graphs[0]) == opaque
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-5, atol=1e-5)
    fused = F.scaled_dot_product_attention(q, k, v, attn_mask=sizes.log()[:, None, None])
    torch.testing.assert_close(eager[0], fused)


def test_compiled_with_autograd_traces_the_blocks_and_matches_eager_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With autograd the blocks are traced into the graph (the opaque call has no
    backward): outputs and gradients as eager."""
    from leanformer.ops import received

    monkeypatch.setattr(received, "_OPAQUE_FROM_LOGITS", 1)  # large enough for the op
    q, k, v = (t.requires_grad_() for t in _qkv(2, 3, 50, 8))
    sizes = _sizes(2, 50, num_prefix=1)
    weights = torch.randn(2, 50)

    def loss(q, k, v):
        out, received = attention(q, k, v, sizes=sizes, return_received=True)
        return out.square().sum() + (received * weights).sum()

    graphs: list[str] = []

    def recording(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm.code)
        return gm.forward

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend=recording)(q, k, v), (q, k, v))
    torch._dynamo.reset()
    assert len(graphs) == 1 and "attention_received" not in graphs[0]
    for c, e in zip(compiled, eager, strict=True):
        # Other blocks (every item and head at once), so other float rounding.
        torch.testing.assert_close(c, e, rtol=1e-4, atol=5e-5)


def test_the_attention_op_declares_what_it_returns() -> None:
    """The opaque op's fake kernel against its real outputs, with a mask that broadcasts
    q over more items and heads."""
    q, k, v = _qkv(1, 2, 30, 8)
    mask = torch.randn(4, 2, 1, 30)
    torch.library.opcheck(torch.ops.leanformer.attention_received, (q, k, v, mask, 0.3))
    torch.library.opcheck(torch.ops.leanformer.attention_received, (q, k, v, None, 0.3))


def test_default_block_rows_bound_memory_and_shrink_with_many_keys() -> None:
    """The layout across every item and head (compiled, or on an accelerator)."""
    from leanformer.ops.received import default_block_rows

    assert default_block_rows(64, 197) == 256  # few keys: at most 4 * head_dim rows
    assert default_block_rows(64, 785) == 83  # many keys: a [83, 785] slab per head
    assert default_block_rows(32, 300) == 128
    assert default_block_rows(64, 10**6) == 16  # never fewer than 16 rows


def test_eager_cpu_blocks_are_an_item_and_the_heads_whose_logits_fit_in_cache() -> None:
    assert torch.get_num_threads() == 1  # the suite's setting (conftest)

    def block(b: int, h: int, n: int, d: int = 64) -> BlockShape:
        return default_block(torch.empty(b, h, n, d), n)

    assert block(8, 6, 785) == BlockShape(1, 1, 785)  # one head: 616k numbers
    assert block(32, 6, 197) == BlockShape(1, 6, 197)  # six heads: 233k numbers
    assert block(32, 12, 197) == BlockShape(1, 6, 197)
    assert block(1, 3, 20) == BlockShape(1, 3, 20)
    assert block(2, 6, 4096) == BlockShape(1, 1, 256)  # 2**20 numbers: a head's queries split
    assert block(2, 6, 10**6) == BlockShape(1, 1, 16)  # never fewer than 16 rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # each thread its own heads
        assert block(8, 6, 785) == BlockShape(1, 2, 785)
        assert block(32, 6, 197) == BlockShape(1, 6, 197)
    finally:
        torch.set_num_threads(threads)
