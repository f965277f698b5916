"""EntropyClusteredAttention: dense parity, slow reference, padding, batching, pre-projection path, errors."""

from __future__ import annotations

import math

import pytest
import torch

from leanformer.layers.enact_attention import DenseSelfAttention, EntropyClusteredAttention
from leanformer.ops.regions import RegionPlan

D, HEADS = 16, 4


def padded_inputs(seed=0, B=3, H=4, W=5, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H * W, D, generator=gen, dtype=dtype)
    pos = torch.randn(B, H * W, D, generator=gen, dtype=dtype)
    mask = torch.zeros(B, H, W, dtype=torch.bool)
    mask[1, 3:, :] = True
    mask[2, :, 3:] = True
    return x, pos, mask.flatten(1), (H, W)


def make(cls=EntropyClusteredAttention, seed=0, **kw):
    torch.manual_seed(seed)
    m = cls(D, HEADS, **kw).double().eval()
    if isinstance(m, EntropyClusteredAttention):
        # Sharpen the entropy so the within-region weights are far from uniform.
        torch.nn.init.normal_(m.entropy_proj.weight, std=2.0)
    return m


def test_singleton_regions_equal_dense_attention():
    x, pos, mask, shape = padded_inputs()
    dense = make(DenseSelfAttention)
    enact = make(regions="single")
    missing = enact.load_state_dict(dense.state_dict(), strict=False)
    assert set(missing.missing_keys) == {"entropy_proj.weight"}
    valid = ~mask
    torch.testing.assert_close(enact(x, pos, shape, mask)[valid], dense(x, pos, shape, mask)[valid])
    torch.testing.assert_close(enact(x, pos, shape), dense(x, pos, shape))
    # Padded queries attend to the valid keys in both, so the whole output agrees too.
    torch.testing.assert_close(enact(x, pos, shape, mask), dense(x, pos, shape, mask))


def test_regions_option_is_checked():
    with pytest.raises(ValueError, match="regions must be one of curvature, single"):
        EntropyClusteredAttention(D, HEADS, regions="chunks")


def reference_forward(m: EntropyClusteredAttention, x, pos, shape, mask):
    """Per map, loops: regions from the module's plan, softmax-weighted means, explicit attention."""
    valid = ~mask
    qk = x + pos
    entropy = m.entropy(qk, valid)
    plan: RegionPlan = m.plan(entropy, shape, valid)
    C, h, d = m.d_model, m.num_heads, m.head_dim
    Wq, Wk, Wv = m.in_proj_weight.split(C)
    bq, bk, bv = m.in_proj_bias.split(C)
    outs = []
    for b in range(x.shape[0]):
        ks, vs = [], []
        for j in range(int(plan.counts[b])):
            members = (plan.region_id[b] == j).nonzero().flatten().tolist()
            w = torch.softmax(entropy[b, members], dim=0)
            k_in = sum(w[t] * qk[b, i] for t, i in enumerate(members))
            v_in = sum(w[t] * x[b, i] for t, i in enumerate(members))
            ks.append(k_in @ Wk.T + bk)
            vs.append(v_in @ Wv.T + bv)
        K, V = torch.stack(ks), torch.stack(vs)  # [L_b, C]
        Q = qk[b] @ Wq.T + bq  # [N, C]
        heads = []
        for i in range(h):
            s = slice(i * d, (i + 1) * d)
            a = torch.softmax(Q[:, s] @ K[:, s].T / math.sqrt(d), dim=-1)
            heads.append(a @ V[:, s])
        outs.append(m.out_proj(torch.cat(heads, dim=-1)))
    return torch.stack(outs)


@pytest.mark.parametrize("sigma", [0.0, 1.5])
def test_matches_slow_reference(sigma):
    x, pos, mask, shape = padded_inputs(seed=1)
    m = make(sigma=sigma)
    out = m(x, pos, shape, mask)
    ref = reference_forward(m, x, pos, shape, mask)
    valid = ~mask
    torch.testing.assert_close(out[valid], ref[valid])
    counts = m.last_cluster_counts
    assert counts is not None and (counts >= 1).all() and (counts < valid.sum(1)).any()
    assert m.last_valid_counts.tolist() == valid.sum(1).tolist()


def test_cluster_before_projection_equals_after():
    x, pos, mask, shape = padded_inputs(seed=2)
    before = make(cluster_inputs=True)
    after = make(cluster_inputs=False)
    after.load_state_dict(before.state_dict())
    xs = [t.clone().requires_grad_(True) for t in (x, pos)]
    ys = [t.clone().requires_grad_(True) for t in (x, pos)]
    out_b, out_a = before(*xs, shape, mask), after(*ys, shape, mask)
    valid = ~mask
    torch.testing.assert_close(out_b[valid], out_a[valid])
    g_b = torch.autograd.grad(out_b[valid].sum(), [*xs, *before.parameters()])
    g_a = torch.autograd.grad(out_a[valid].sum(), [*ys, *after.parameters()])
    for a, b in zip(g_b, g_a):
        torch.testing.assert_close(a, b)


def test_padded_positions_never_influence_valid_outputs():
    x, pos, mask, shape = padded_inputs(seed=3)
    m = make()
    out = m(x, pos, shape, mask)
    x2, pos2 = x.clone(), pos.clone()
    x2[mask] = 1e4 * torch.randn_like(x2[mask])
    pos2[mask] = -7.0
    x2.requires_grad_(True)
    out2 = m(x2, pos2, shape, mask)
    valid = ~mask
    torch.testing.assert_close(out2[valid], out[valid])
    (g,) = torch.autograd.grad(out2[valid].sum(), x2)
    assert (g[mask] == 0).all()


def test_batched_equals_per_image():
    x, pos, mask, (H, W) = padded_inputs(seed=4)
    m = make(sigma=1.0)
    out = m(x, pos, (H, W), mask)
    for b in range(x.shape[0]):
        valid = ~mask[b].view(H, W)
        hv, wv = int(valid[:, 0].sum()), int(valid[0].sum())

        def crop(t, b=b, hv=hv, wv=wv):
            return t[b].view(H, W, D)[:hv, :wv].reshape(1, hv * wv, D)

        alone = m(crop(x), crop(pos), (hv, wv))
        torch.testing.assert_close(crop(out), alone)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiles_with_graph_breaks_and_matches_eager(dynamic: bool) -> None:
    """The region count is read on the host (the output size depends on it): graph
    breaks, not an error, and the compiled layer gives the eager output at two map sizes."""
    m = make(sigma=1.0)
    torch._dynamo.reset()
    compiled = torch.compile(m, dynamic=dynamic, backend="aot_eager")
    for seed, (H, W) in ((6, (4, 5)), (7, (5, 6))):
        x, pos, mask, shape = padded_inputs(seed=seed, H=H, W=W)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, pos, shape, mask), m(x, pos, shape, mask))


def test_gradient_reaches_entropy_projection():
    x, pos, mask, shape = padded_inputs(seed=5)
    m = make(sigma=0.0)
    out = m(x, pos, shape, mask)
    out[~mask].pow(2).sum().backward()
    assert m.entropy_proj.weight.grad is not None and m.entropy_proj.weight.grad.abs().sum() > 0


def test_bad_inputs_raise():
    x, pos, mask, shape = padded_inputs()
    m = make()
    with pytest.raises(ValueError, match="spatial shape"):
        m(x, pos, (3, 3), mask)
    with pytest.raises(ValueError, match="pos"):
        m(x, pos[:, :-1], shape, mask)
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(x, pos, shape, mask[:, :-1])
    with pytest.raises(ValueError, match="bool"):
        m(x, pos, shape, mask.long())
    with pytest.raises(ValueError, match="spatial_shape"):
        m(x, pos, None, mask)
    # Negative or float sides with the right product, three sides, one number: refused up
    # front, not inside a view.
    H, W = shape
    for bad in ((-H, -W), (float(H), float(W)), (H, W, 1), H * W):
        with pytest.raises(ValueError, match=r"spatial_shape must be two integers \(H, W\) >= 1"):
            m(x, pos, bad, mask)
    import numpy as np

    reference = m(x, pos, shape, mask)  # NumPy integers and integer 0-d tensors are sides too
    for sides in ((np.int64(H), np.int64(W)), (torch.tensor(H), torch.tensor(W))):
        torch.testing.assert_close(m(x, pos, sides, mask), reference)
    with pytest.raises(ValueError, match="cluster_inputs must be True or False"):
        EntropyClusteredAttention(D, HEADS, cluster_inputs="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"x must be \[B, HW, 16\]"):
        m(x[..., :8], None, shape, mask)
    holey = mask.clone()
    holey[0, 0] = True  # not a top-left rectangle
    with pytest.raises(ValueError, match="top-left rectangle"):
        m(x, pos, shape, holey)
    with pytest.raises(ValueError, match="sigma"):
        EntropyClusteredAttention(D, HEADS, sigma=-1.0)
    with pytest.raises(ValueError, match="divisible"):
        EntropyClusteredAttention(D, 3)


def test_checkpoint_with_the_old_projection_bias_still_loads():
    """The projection once had a bias, which the softmax over positions cancels: such a
    state dict loads strictly, the bias is dropped, and the output is unchanged."""
    x, pos, _, shape = padded_inputs()
    enact = make()
    old = {**enact.state_dict(), "entropy_proj.bias": torch.tensor([3.0], dtype=torch.float64)}
    again = make(seed=1)
    again.load_state_dict(old)
    torch.testing.assert_close(again(x, pos, shape), enact(x, pos, shape))


def test_an_empty_batch_gives_an_empty_output():
    """Dense attention returns [0, HW, D]; the region plan's maximum over no maps failed."""
    x = torch.randn(0, 20, D, requires_grad=True)
    out = make()(x, None, (4, 5), None)
    assert out.shape == (0, 20, D)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("cls", [DenseSelfAttention, EntropyClusteredAttention])
def test_the_explicit_matrix_gives_the_fused_result_and_gradients(cls):
    """``matrix="explicit"`` (the memory baseline) is the same attention as the fused kernel,
    padded positions and ENACT's masked cluster slots included."""
    x, pos, mask, shape = padded_inputs()
    outputs = []
    for matrix in ("fused", "explicit"):
        module = make(cls, matrix=matrix)
        xg = x.clone().requires_grad_(True)
        out = module(xg, pos, shape, mask)
        out.square().sum().backward()
        outputs.append((out, xg.grad))
    (fused, fused_grad), (explicit, explicit_grad) = outputs
    assert torch.isfinite(explicit).all()
    torch.testing.assert_close(explicit, fused)
    torch.testing.assert_close(explicit_grad, fused_grad)
    with pytest.raises(ValueError, match="matrix must be one of fused, explicit"):
        cls(D, HEADS, matrix="eager")
