"""Token-pooling reducers, the method registry and their wiring into the DeiT family."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models.vision_transformer import Block as TimmBlock
from torch import nn

import leanformer
from leanformer.models.registry import create_model
from leanformer.patch.adapter import pooled_block_forward
from leanformer.patch.timm import block_parts
from leanformer.pooling.methods.clustering import ClusterPooling
from leanformer.pooling.methods.conv import ConvDownsample
from leanformer.pooling.methods.selection import TokenSelection
from leanformer.pooling.reducer import reduce_tokens
from leanformer.pooling.registry import build_reducers, list_methods

METHODS = [m for m in list_methods() if m != "none"]


def _tokens(b: int = 2, n: int = 16, c: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, n, c, generator=g), torch.rand(b, n, generator=g) + 0.1


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("carry", [False, True])
def test_every_method_in_deit(method: str, carry: bool) -> None:
    torch.manual_seed(0)
    model = create_model("deit_test", pool=method, keep=[12, 0.5, 3], carry=carry)
    x = torch.randn(2, 3, 16, 16)
    out = model(x)
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def _block_outputs(model: nn.Module, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each block's output tokens (class token included) and the sizes it hands on."""
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    pooling = getattr(model, "token_pooling", None)

    def record(module: nn.Module, args: object, output: torch.Tensor) -> None:
        out.append((output, None if pooling is None else pooling.sizes))

    hooks = [blk.register_forward_hook(record) for blk in model.blocks]
    try:
        model.forward_features(x)
    finally:
        for hook in hooks:
            hook.remove()
    return out


def _token_counts(model: nn.Module, x: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """Tokens (and sizes) after each block, class token included."""
    return [(feats.shape[1], sizes) for feats, sizes in _block_outputs(model, x)]


@pytest.mark.parametrize(
    "method", ["kmedoids", "wkmeans", "wkmedoids", "powerbert", "random", "importance", "merge", "stepmerge"]
)
def test_counts_follow_the_schedule_and_class_token_is_kept(method: str) -> None:
    torch.manual_seed(0)
    model = create_model("deit_test", pool=method, keep=[12, 14, 5], carry=True).eval()
    x = torch.randn(2, 3, 16, 16)
    counts = _token_counts(model, x)
    assert [n for n, _ in counts] == [1 + 12, 1 + 12, 1 + 5]  # min(K_l, tokens so far)
    for _, sizes in counts:
        if method in ("powerbert", "random", "importance"):
            assert sizes is None  # a selection keeps tokens of size 1: sizes stay implicit
            continue
        assert sizes is not None and (sizes[:, 0] == 1).all()  # the class token stands for itself
        torch.testing.assert_close(sizes[:, 1:].sum(1), torch.full((2,), 16.0))  # mass is conserved
    # The class token goes through untouched by the reducer: compare with the unpooled first block.
    plain = create_model("deit_test").eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    pooled, _ = _block_outputs(model, x)[0]
    unpooled, _ = _block_outputs(plain, x)[0]
    torch.testing.assert_close(pooled[:, 0], unpooled[:, 0])


def test_budget_that_never_binds_is_the_plain_model() -> None:
    torch.manual_seed(0)
    plain = create_model("deit_test").eval()
    pooled = create_model("deit_test", pool="wkmedoids", keep=[16, 20, 16]).eval()
    pooled.load_state_dict(plain.state_dict())
    assert len(pooled.token_pooling.reducers) == 0  # fused attention kept everywhere
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(pooled(x), plain(x))


@pytest.mark.parametrize("method", ["kmeans", "wkmedoids", "powerbert", "random", "merge", "stepmerge"])
def test_reducer_k_at_least_n_is_identity(method: str) -> None:
    (reducer,) = build_reducers(method=method, keep=[0.5], depth=1, num_tokens=16, dim=8, grid_size=(4, 4))
    assert reducer is not None
    reducer.keep = 16
    x, rec = _tokens()
    out, sizes = reducer(x, None, rec)
    assert out is x and sizes is None
    reducer.keep = 0
    out, sizes = reducer(x, torch.ones(2, 16), rec)
    assert out.shape == (2, 0, 8) and sizes is not None and sizes.shape == (2, 0)


def test_batched_equals_per_sample_in_a_reducer() -> None:
    x, rec = _tokens(b=3)
    for method in ("kmeans", "wkmedoids", "powerbert", "importance", "merge", "stepmerge"):
        (reducer,) = build_reducers(method=method, keep=[5], depth=1, num_tokens=16, dim=8, grid_size=(4, 4))
        assert reducer is not None
        reducer.eval()
        full, _ = reducer(x, None, rec)
        if method == "importance":
            continue  # one random stream for the batch: rows differ from single-row calls
        for b in range(3):
            one, _ = reducer(x[b : b + 1], None, rec[b : b + 1])
            torch.testing.assert_close(full[b : b + 1], one)


def test_random_methods_are_seeded_and_deterministic_in_eval() -> None:
    x, rec = _tokens()
    for method in ("random", "importance"):
        (r,) = build_reducers(
            method=method, keep=[4], depth=1, num_tokens=16, dim=8, grid_size=(4, 4), seed=3
        )
        assert r is not None
        r.eval()
        torch.testing.assert_close(r(x, None, rec)[0], r(x, None, rec)[0])
        r.train()
        first, second = r(x, None, rec)[0], r(x, None, rec)[0]
        assert not torch.equal(first, second)  # the training stream advances
    a = ClusterPooling(keep=4, init="random", seed=1).eval()
    torch.testing.assert_close(a(x, None, rec)[0], a(x, None, rec)[0])


def test_significance_scores_only_where_needed() -> None:
    needs = {
        m: [
            r.needs_received
            for r in build_reducers(method=m, keep=0.5, depth=2, num_tokens=16, dim=8, grid_size=(4, 4))
            if r is not None
        ]
        for m in METHODS
    }
    assert needs["wkmedoids"] == [True, True] and needs["powerbert"] == [True, True]
    assert needs["random"] == [False, False] and needs["merge"] == [False, False]
    assert needs["stepmerge"] == [False, False]
    assert needs["conv"] == [False, False]
    assert not ClusterPooling(keep=4, weighted=False, init="random").needs_received
    with pytest.raises(ValueError, match="attention received"):
        TokenSelection(keep=2, mode="topk")(torch.randn(1, 4, 2), None, None)


def test_carry_sizes_through_a_block() -> None:
    blk = TimmBlock(8, num_heads=2).eval()
    reducer = TokenSelection(keep=3, mode="topk", carry=True)
    x = torch.randn(2, 1 + 6, 8)
    out, sizes, _ = pooled_block_forward(block_parts(blk), x, None, reducer, 1, "attn")
    # Selected tokens keep their size, 1: implicit sizes stay None even with carry.
    assert out.shape == (2, 4, 8) and sizes is None
    sizes = torch.ones(2, 4)
    kept, ksizes, _ = pooled_block_forward(block_parts(blk), x, torch.ones(2, 7), reducer, 1, "attn")
    torch.testing.assert_close(kept, out)
    torch.testing.assert_close(ksizes, sizes)
    merged, msizes, _ = reduce_tokens(
        TokenSelection(keep=2, mode="random", carry=True), out, sizes * 3, None, 1
    )
    assert merged.shape == (2, 3, 8) and msizes is not None
    torch.testing.assert_close(msizes, torch.tensor([[3.0, 3.0, 3.0]] * 2))


def test_conv_downsample() -> None:
    conv = ConvDownsample(dim=4, grid_size=(4, 4), carry=True)
    x = torch.randn(2, 16, 4)
    out, sizes = conv(x, None, None)
    grid = x.transpose(1, 2).reshape(2, 4, 4, 4)
    expected = torch.nn.functional.avg_pool2d(grid, 2).flatten(2).transpose(1, 2)
    torch.testing.assert_close(out, expected)  # starts as 2x2 average pooling
    assert sizes is not None
    torch.testing.assert_close(sizes, torch.full((2, 4), 4.0))
    # Odd grid (3x3): padded by repetition, padding carries no size.
    conv3 = ConvDownsample(dim=4, grid_size=(3, 3), carry=True)
    out3, sizes3 = conv3(torch.randn(2, 9, 4), None, None)
    assert out3.shape == (2, 4, 4) and sizes3 is not None
    torch.testing.assert_close(sizes3, torch.tensor([[4.0, 2.0, 2.0, 1.0]] * 2))
    # The message names the grid the layer was built for (it named the last halving, 1x1).
    with pytest.raises(
        ValueError, match=r"got 7 tokens, expected 4x4=16, a 2x2 halving of it.*conv can only"
    ):
        conv(torch.randn(2, 7, 4), None, None)


def test_conv_reads_its_grid_halved_on_a_non_square_grid() -> None:
    """After the entry step a layer built for 8x6 receives its own output, 4x3 (12 tokens,
    not a square): it must read it as 4x3, padded to 4x4, not refuse it."""
    conv = ConvDownsample(dim=4, grid_size=(8, 6), carry=True)
    assert [conv.grid_for(n) for n in (48, 12, 4, 1)] == [(8, 6), (4, 3), (2, 2), (1, 1)]
    x = torch.randn(2, 12, 4)
    out, sizes = conv(x, None, None)
    grid = torch.nn.functional.pad(x.transpose(1, 2).reshape(2, 4, 4, 3), (0, 1, 0, 0), mode="replicate")
    expected = torch.nn.functional.avg_pool2d(grid, 2).flatten(2).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    assert sizes is not None
    torch.testing.assert_close(sizes, torch.tensor([[4.0, 2.0, 4.0, 2.0]] * 2))
    with pytest.raises(ValueError, match="conv can only follow other conv layers"):
        conv(torch.randn(2, 24, 4), None, None)  # 8x3 or 6x4: no grid of this layer's
    # Through a timm host with the entry step: 48 -> 12 before the first block, then 4.
    host = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, depth=3, img_size=(64, 48), patch_size=8, embed_dim=48
    ).eval()
    model = leanformer.apply_token_pooling(
        host, keep=[0.25, 1.0, 1.0], method="conv", reduce_at="entry", carry=True
    )
    with torch.no_grad():
        model(torch.randn(2, 3, 64, 48))
    assert model.token_pooling.sizes.shape == (2, 1 + 4)
    torch.testing.assert_close(model.token_pooling.sizes[:, 1:].sum(1), torch.full((2,), 48.0))


def test_conv_placement() -> None:
    reducers = build_reducers(
        method="conv", keep=None, depth=4, num_tokens=16, dim=8, grid_size=(4, 4), layers=[1, 3]
    )
    assert [r is not None for r in reducers] == [False, True, False, True]
    auto = build_reducers(method="conv", keep=[16, 8, 4, 1], depth=4, num_tokens=16, dim=8, grid_size=(4, 4))
    assert [r is not None for r in auto] == [False, True, False, True]
    model = create_model("deit_test", pool="conv", pool_options={"layers": [0, 1]})
    assert [n for n, _ in _token_counts(model, torch.randn(1, 3, 16, 16))] == [5, 2, 2]
    with pytest.raises(ValueError, match="block indices"):
        build_reducers(method="conv", keep=None, depth=4, num_tokens=16, dim=8, grid_size=(4, 4), layers=[4])


def test_bad_methods_and_options() -> None:
    with pytest.raises(ValueError, match="did you mean wkmedoids"):
        create_model("deit_test", pool="wkmedoid", keep=0.5)
    with pytest.raises(ValueError, match="unknown option"):
        create_model("deit_test", pool="powerbert", keep=0.5, pool_options={"max_iters": 3})
    with pytest.raises(ValueError, match="keep schedule has 12 entries but the model has 3 blocks"):
        create_model("deit_test", pool="wkmedoids", keep="deit_s_level3")
    with pytest.raises(ValueError, match="need a pooling method"):
        create_model("deit_test", keep=0.5)
    with pytest.raises(ValueError, match="max_iters"):
        create_model("deit_test", pool="kmeans", keep=0.5, pool_options={"max_iters": -1})
    with pytest.raises(ValueError, match="init must be"):
        create_model("deit_test", pool="kmeans", keep=0.5, pool_options={"init": "kmeans++"})


def test_reduce_after_mlp_option() -> None:
    torch.manual_seed(0)
    model = create_model("deit_test", pool="wkmedoids", keep=[8, 4, 2], reduce_at="mlp")
    assert model.token_pooling.reduce_at == "mlp"
    assert model(torch.randn(1, 3, 16, 16)).shape == (1, 5)


@pytest.mark.slow
def test_deit_small_gflops_match_the_paper(monkeypatch: pytest.MonkeyPatch) -> None:
    from leanformer.bench.flops import count_gflops
    from leanformer.ops import kmedoids_native, medoid_distances, token_distances
    from leanformer.pooling.methods import clustering as clustering_methods

    x = torch.randn(1, 3, 224, 224)

    def gflops(**kw: object) -> float:
        return count_gflops(create_model("deit_small", **kw), (x,))

    # Appendix G, DeiT-S level 3: PoWER-BERT 2.3 GFLOPs (2.27 computed with the reduction
    # between attention and MLP; 2.50 after the MLP).
    powerbert = gflops(pool="powerbert", keep="deit_s_level3")
    assert powerbert == pytest.approx(2.27, abs=0.01)
    assert gflops(pool="powerbert", keep="deit_s_level3", reduce_at="mlp") == pytest.approx(2.50, abs=0.01)

    # WK-Medoids: the same transformer plus the clustering's distances: the initial medoid
    # table's products, and the distances the C++ iterations recompute where medoids move.
    # The paper adds 0.08 for N x N distances in every block (0.063 here); the
    # medoid-token distances cost less.
    products: list[tuple[int, int, int]] = []
    real = token_distances.pairwise_sq_dists

    def recording(x: torch.Tensor, y: torch.Tensor | None = None, **kw: object) -> torch.Tensor:
        products.append((x.shape[1], x.shape[1] if y is None else y.shape[1], x.shape[2]))
        return real(x, y, **kw)  # type: ignore[arg-type]

    shapes: list[tuple[int, int, int]] = []
    real_plan = clustering_methods.kmedoids_pooled

    def recording_plan(tokens: torch.Tensor, k: int, **kw: object) -> object:
        shapes.append((tokens.shape[1], k, tokens.shape[2]))
        return real_plan(tokens, k, **kw)  # type: ignore[arg-type]

    real_kernel = kmedoids_native.kmedoids_iterate_cpu

    def recording_kernel(xc: torch.Tensor, *args: object) -> tuple[torch.Tensor, ...]:
        out = real_kernel(xc, *args)  # type: ignore[arg-type]
        products.append((int(out[2].sum()), 1, xc.shape[2]))  # the distances it computed
        return out

    monkeypatch.setattr(kmedoids_native, "kmedoids_iterate_cpu", recording_kernel)
    monkeypatch.setattr(token_distances, "pairwise_sq_dists", recording)
    monkeypatch.setattr(medoid_distances, "pairwise_sq_dists", recording)
    monkeypatch.setattr(clustering_methods, "kmedoids_pooled", recording_plan)
    clustering = gflops(pool="wkmedoids", keep="deit_s_level3") - powerbert
    assert clustering == pytest.approx(sum(n * m * c for n, m, c in products) / 1e9, rel=1e-6)
    all_pairs = sum(n * n * c for n, _, c in shapes) / 1e9
    assert all_pairs == pytest.approx(0.063, abs=0.005)
    assert sum(k * (n - k) * c for n, k, c in shapes) / 1e9 < clustering < all_pairs
