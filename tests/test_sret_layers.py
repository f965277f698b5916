"""Sliced group attention, learnable residual coefficients and the recursive stage (SReT)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor, nn

from leanformer import create_model
from leanformer.layers.attention import Attention
from leanformer.layers.recursive import NonLinearProjection, RecursiveStage
from leanformer.layers.residual_coeffs import LearnableResidual
from leanformer.layers.sliced_attention import SlicedBlock, SlicedGroupAttention, inverse_permutation


def reference_sliced(attn: SlicedGroupAttention, x: Tensor, groups: int) -> Tensor:
    """Plain loops: every sample, group and head attends within its own slice of consecutive tokens."""
    B, N, C = x.shape
    H, D = attn.num_heads, attn.head_dim
    n = N // groups
    qkv = attn.qkv(x)  # [B, N, 3C]
    out = torch.zeros(B, N, C, dtype=x.dtype)
    for b in range(B):
        for g in range(groups):
            rows = slice(g * n, (g + 1) * n)
            for h in range(H):
                q = qkv[b, rows, h * D : (h + 1) * D]
                k = qkv[b, rows, C + h * D : C + (h + 1) * D]
                v = qkv[b, rows, 2 * C + h * D : 2 * C + (h + 1) * D]
                p = torch.softmax(q @ k.T / math.sqrt(D), dim=-1)
                out[b, rows, h * D : (h + 1) * D] = p @ v
    return attn.proj(out)


@pytest.fixture
def attn() -> SlicedGroupAttention:
    torch.manual_seed(0)
    return SlicedGroupAttention(16, num_heads=2).double().eval()


def test_one_group_equals_standard_multi_head_attention(attn: SlicedGroupAttention) -> None:
    ref = Attention(16, num_heads=2).double().eval()
    ref.load_state_dict({k: v for k, v in attn.state_dict().items()}, strict=False)
    x = torch.randn(3, 12, 16, dtype=torch.float64)
    expected, _ = ref(x)
    torch.testing.assert_close(attn(x, groups=1), expected)
    torch.testing.assert_close(attn(x, groups=1), reference_sliced(attn, x, 1))


@pytest.mark.parametrize("groups", [2, 3, 4, 12])
def test_groups_match_loop_reference(attn: SlicedGroupAttention, groups: int) -> None:
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    torch.testing.assert_close(attn(x, groups=groups), reference_sliced(attn, x, groups))


def test_groups_do_not_see_each_other(attn: SlicedGroupAttention) -> None:
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    y = x.clone()
    y[:, 4:] += 1.0  # change only the second group
    a, b = attn(x, groups=2), attn(y, groups=2)
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_permute_and_inverse_equal_attention_on_permuted_sequence(attn: SlicedGroupAttention) -> None:
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    perm, inv = attn.permutation(16, x.device, seed=7)
    torch.testing.assert_close(inv, torch.argsort(perm))
    expected = reference_sliced(attn, x[:, perm], 4)[:, torch.argsort(perm)]
    torch.testing.assert_close(attn(x, groups=4, permute=True, inverse=True, seed=7), expected)


def test_permute_without_inverse_keeps_permuted_order(attn: SlicedGroupAttention) -> None:
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    perm, _ = attn.permutation(16, x.device, seed=3)
    expected = reference_sliced(attn, x[:, perm], 4)
    torch.testing.assert_close(attn(x, groups=4, permute=True, inverse=False, seed=3), expected)


def test_permutation_differs_from_contiguous_slices(attn: SlicedGroupAttention) -> None:
    x = torch.randn(1, 16, 16, dtype=torch.float64)
    assert not torch.allclose(attn(x, groups=4, permute=True, seed=1), attn(x, groups=4))


def test_permute_inverse_with_one_group_is_full_attention(attn: SlicedGroupAttention) -> None:
    attn.train()  # even a random permutation cannot change full attention
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    torch.testing.assert_close(attn(x, groups=1, permute=True, inverse=True), attn(x, groups=1))


def test_eval_is_deterministic_and_training_is_random(attn: SlicedGroupAttention) -> None:
    x = torch.randn(2, 64, 16, dtype=torch.float64)
    torch.manual_seed(1)
    a = attn(x, groups=8, permute=True, seed=5)
    torch.manual_seed(2)  # the eval permutation must not depend on the global RNG
    b = attn(x, groups=8, permute=True, seed=5)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # A fresh module gives the same eval permutation for the same seed.
    fresh = copy.deepcopy(attn)
    torch.testing.assert_close(fresh(x, groups=8, permute=True, seed=5), a, rtol=0, atol=0)
    assert not torch.allclose(attn(x, groups=8, permute=True, seed=6), a)
    attn.train()
    c, d = attn(x, groups=8, permute=True, seed=5), attn(x, groups=8, permute=True, seed=5)
    assert not torch.allclose(c, d)


def test_batched_equals_per_sample_in_eval(attn: SlicedGroupAttention) -> None:
    x = torch.randn(3, 16, 16, dtype=torch.float64)
    out = attn(x, groups=4, permute=True, seed=2)
    for b in range(3):
        torch.testing.assert_close(out[b : b + 1], attn(x[b : b + 1], groups=4, permute=True, seed=2))


def test_inverse_permutation() -> None:
    perm = torch.randperm(50)
    inv = inverse_permutation(perm)
    torch.testing.assert_close(perm[inv], torch.arange(50))
    torch.testing.assert_close(inv[perm], torch.arange(50))


def test_bad_group_counts_raise(attn: SlicedGroupAttention) -> None:
    x = torch.randn(1, 10, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="cannot split 10 tokens into 4"):
        attn(x, groups=4)
    with pytest.raises(ValueError, match=">= 1"):
        attn(x, groups=0)
    with pytest.raises(ValueError, match="divisible"):
        SlicedGroupAttention(10, num_heads=3)
    with pytest.raises(ValueError, match="entries"):
        SlicedBlock(16, num_heads=2, groups=(4, 2), permute=(True,))
    with pytest.raises(ValueError, match=r"groups\[0\] must be an integer >= 1, got 8.5"):
        SlicedBlock(16, num_heads=2, groups=(8.5, 2))  # used to run as 8 groups


def test_gradients_flow_through_permutation() -> None:
    torch.manual_seed(0)
    small = SlicedGroupAttention(4, num_heads=2).double().eval()
    x = torch.randn(1, 8, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: small(t, groups=2, permute=True, seed=0), (x,))


# --- learnable residual coefficients ---------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "has_alpha", "has_beta"),
    [("both", True, True), ("skip", True, False), ("branch", False, True), ("none", False, False)],
)
def test_lrc_modes(mode: str, has_alpha: bool, has_beta: bool) -> None:
    res = LearnableResidual(mode=mode)  # type: ignore[arg-type]
    assert (res.alpha is not None) == has_alpha and (res.beta is not None) == has_beta
    for p in res.parameters():
        torch.testing.assert_close(p, torch.ones(1))
    x, f = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    torch.testing.assert_close(res(x, f), x + f)  # at initialisation LRC is the plain residual
    with torch.no_grad():
        for p in res.parameters():
            p.fill_(0.5)
    a = 0.5 if has_alpha else 1.0
    b = 0.5 if has_beta else 1.0
    torch.testing.assert_close(res(x, f), a * x + b * f)


def test_lrc_bad_mode() -> None:
    with pytest.raises(ValueError, match="lrc must be one of"):
        LearnableResidual(mode="alpha")  # type: ignore[arg-type]


def test_block_lrc_initialised_to_one() -> None:
    blk = SlicedBlock(16, num_heads=2, groups=(2, 1))
    coeffs = [p for n, p in blk.named_parameters() if n.endswith(("alpha", "beta"))]
    assert len(coeffs) == 4  # skip and branch on attention and on the MLP
    assert all(torch.equal(c, torch.ones(1)) for c in coeffs)


# --- recursion ---------------------------------------------------------------------------


def make_stage(loops: int = 2, unique: int = 2) -> RecursiveStage:
    torch.manual_seed(0)
    blocks = [
        SlicedBlock(16, num_heads=2, groups=(4, 2)[:loops] + (1,) * max(0, loops - 2)) for _ in range(unique)
    ]
    return RecursiveStage(blocks, dim=16, loops=loops, nll_ratio=1.0).double().eval()


def test_stage_order_shares_blocks_and_not_nlls() -> None:
    stage = make_stage()
    order = stage.layers()
    assert [p for _, p in order] == [0, None, 1, None, 0, None, 1, None]
    blk0, nll0, blk0b, nll1, blk1, nll2, blk1b, nll3 = (m for m, _ in order)
    assert blk0 is blk0b and blk1 is blk1b and blk0 is not blk1
    nlls = [nll0, nll1, nll2, nll3]
    assert all(isinstance(m, NonLinearProjection) for m in nlls)
    assert len({id(m) for m in nlls}) == 4
    ptrs = {m.mlp.fc1.weight.data_ptr() for m in nlls}
    assert len(ptrs) == 4
    assert stage.depth == 4
    # Parameters: 2 blocks + 4 NLLs, nothing counted twice.
    expected = sum(p.numel() for b in stage.blocks for p in b.parameters()) + sum(
        p.numel() for m in nlls for p in m.parameters()
    )
    assert sum(p.numel() for p in stage.parameters()) == expected


def test_stage_matches_unrolled_reference() -> None:
    stage = make_stage()
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    ref = x
    for b, blk in enumerate(stage.blocks):
        for p in range(2):
            ref = blk(ref, p)
            ref = stage.nlls[2 * b + p](ref)
    torch.testing.assert_close(stage(x), ref)


def test_shared_block_gets_gradient_from_both_passes() -> None:
    """The shared weights' gradient is the sum of the two passes' gradients (unrolled copies)."""
    stage = make_stage(unique=1)
    blk = stage.blocks[0]
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    w = torch.randn(2, 16, 16, dtype=torch.float64)
    (stage(x) * w).sum().backward()
    # Unrolled: two independent copies of the block, one per pass.
    first, second = copy.deepcopy(blk), copy.deepcopy(blk)
    for m in (first, second):
        m.zero_grad()
    y = stage.nlls[1](second(stage.nlls[0](first(x, 0)), 1))
    (y * w).sum().backward()
    for (name, shared), p1, p2 in zip(blk.named_parameters(), first.parameters(), second.parameters()):
        assert p1.grad is not None and p2.grad is not None
        assert p1.grad.abs().sum() > 0 and p2.grad.abs().sum() > 0, name
        torch.testing.assert_close(shared.grad, p1.grad + p2.grad, msg=name)


def test_stage_without_nll_and_bad_options() -> None:
    blocks = [SlicedBlock(8, num_heads=2, groups=(1, 1))]
    stage = RecursiveStage(blocks, dim=8, loops=2, nll_ratio=0)
    assert stage.nlls is None and len(stage.layers()) == 2
    with pytest.raises(ValueError, match="loops"):
        RecursiveStage(blocks, dim=8, loops=0)
    with pytest.raises(ValueError, match="nll_ratio"):
        RecursiveStage(blocks, dim=8, nll_ratio=-1)
    with pytest.raises(ValueError, match="at least one block"):
        RecursiveStage([], dim=8)


def test_block_pass_index_out_of_range() -> None:
    blk = SlicedBlock(8, num_heads=2, groups=(2, 1))
    with pytest.raises(ValueError, match="pass_index 2"):
        blk(torch.randn(1, 4, 8), 2)


def test_block_uses_per_pass_groups() -> None:
    torch.manual_seed(0)
    blk = SlicedBlock(8, num_heads=2, groups=(4, 1)).double().eval()
    x = torch.randn(1, 8, 8, dtype=torch.float64)
    attn_in = blk.norm1(x)
    for p, g in enumerate((4, 1)):
        expected = reference_sliced(blk.attn, attn_in, g)
        h = blk.res1(x, expected)
        h = blk.res2(h, blk.mlp(blk.norm2(h)))
        torch.testing.assert_close(blk(x, p), h)


class _Doubler(nn.Module):
    def forward(self, x: Tensor, pass_index: int) -> Tensor:
        return x * 2 + pass_index


def test_stage_accepts_any_block_module() -> None:
    stage = RecursiveStage([_Doubler()], dim=4, loops=3, nll_ratio=0)
    x = torch.zeros(1, 2, 4)
    # ((0*2+0)*2+1)*2+2 = 4
    torch.testing.assert_close(stage(x), torch.full((1, 2, 4), 4.0))


def test_eval_after_inference_mode_still_takes_gradients() -> None:
    # Evaluation runs under torch.inference_mode(); a later eval-mode call with
    # gradients (saliency, adversarial inputs) must not meet an inference tensor.
    model = create_model("sret_test").eval()
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    with torch.inference_mode():
        expected = model(x)
    out = model(x)
    out.sum().backward()
    assert torch.equal(out.detach(), expected) and x.grad is not None and x.grad.abs().sum() > 0


def test_a_fresh_model_compiles_in_one_graph_and_matches_eager() -> None:
    torch._dynamo.reset()
    model = create_model("sret_test").eval()
    x = torch.randn(2, 3, 16, 16)
    compiled = torch.compile(model, fullgraph=True)  # first call compiled: nothing made eagerly before
    with torch.no_grad():
        got = compiled(x)
        torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
