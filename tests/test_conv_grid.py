"""``conv`` on a host that takes other image sizes reads the grid of the image at hand.

A 2x2 window needs the raster, which the token count does not give: an 8x32 image on a
model built for 16x16 (patch 4) has 16 patches on a 2x8 grid, the count of the model's
own 4x4. The patched host records the grid where it embeds the patches, so conv reads
2x8. References: conv on the true grid by hand (the layer starts as 2x2 average
pooling), and a host built for 8x32 holding the same weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed
from torch import Tensor, nn

import leanformer
from leanformer.apps.cluster_maps import patch_assignment, trace_token_sources
from leanformer.patch.adapter import UnsupportedHostError, installed, pooled_block_forward
from leanformer.patch.api import apply_reducers
from leanformer.patch.timm import block_parts
from leanformer.pooling.methods.conv import ConvDownsample
from leanformer.pooling.methods.selection import TokenSelection
from tiny_vit import tiny_vit

transformers = pytest.importorskip("transformers")

WIDE = (8, 32)  # 2x8 patches of 4x4: the count of the built 4x4 grid


def _hf_host() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        image_size=16,
        patch_size=4,
        num_labels=3,
    )
    return transformers.ViTForImageClassification(config).eval()


def _run(model: nn.Module, x: Tensor) -> Tensor:
    if type(model).__module__.startswith("transformers."):
        return model(pixel_values=x, interpolate_pos_encoding=True).logits
    return model(x)


def _conv_io(model: nn.Module, block: int, run: Callable[[], object]) -> tuple[Tensor, Tensor]:
    """The tokens the conv layer of ``block`` received and gave (its first call) in ``run()``."""
    seen: dict[str, Tensor] = {}

    def spy(module: nn.Module, args: tuple[Tensor, ...], kwargs: dict, out: tuple[Tensor, Tensor]) -> None:
        seen.setdefault("in", args[0])
        seen.setdefault("out", out[0])

    handle = model.token_pooling.reducer(block).register_forward_hook(spy, with_kwargs=True)
    try:
        with torch.no_grad():
            run()
    finally:
        handle.remove()
    return seen["in"], seen["out"]


def _first_conv_io(model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """The tokens the first block's conv layer received and gave, on one forward of ``x``."""
    return _conv_io(model, 0, lambda: _run(model, x))


def _pooled_by_hand(tokens: Tensor, grid: tuple[int, int]) -> Tensor:
    """2x2 average pooling of ``tokens [B, h*w, C]`` on their ``h x w`` raster."""
    B, _, C = tokens.shape
    raster = tokens.transpose(1, 2).reshape(B, C, *grid)
    return F.avg_pool2d(raster, 2).flatten(2).transpose(1, 2)


@pytest.mark.parametrize("host", ["timm", "hf"])
def test_conv_pools_the_grid_of_a_non_square_image(host: str) -> None:
    model = leanformer.apply_token_pooling(
        tiny_vit() if host == "timm" else _hf_host(), keep=[0.5, 1.0, 1.0], method="conv", carry=True
    )
    tokens, pooled = _first_conv_io(model, torch.randn(2, 3, *WIDE))
    assert tokens.shape[1] == 16
    torch.testing.assert_close(pooled, _pooled_by_hand(tokens, (2, 8)))
    # Read once: nothing stale is left for blocks run later on tokens of their own.
    assert model.token_pooling.embedded_grid is None


def test_a_dynamic_host_agrees_with_one_built_for_the_image() -> None:
    """The same weights, the position embeddings resampled as the dynamic host resamples
    them: the host built for 8x32 reads its own grid, the dynamic one the recorded grid."""
    dynamic = tiny_vit()
    built = tiny_vit(img_size=WIDE, dynamic=False)
    state = dynamic.state_dict()
    state["pos_embed"] = resample_abs_pos_embed(
        state["pos_embed"], new_size=[2, 8], old_size=[4, 4], num_prefix_tokens=1
    )
    built.load_state_dict(state)
    x = torch.randn(2, 3, *WIDE)
    with torch.no_grad():
        torch.testing.assert_close(built(x), dynamic(x), rtol=0, atol=1e-5)
        for model in (dynamic, built):
            leanformer.apply_token_pooling(model, keep=[0.5, 0.5, 1.0], method="conv", carry=True)
        out = dynamic(x)
        torch.testing.assert_close(out, built(x), rtol=0, atol=1e-5)
    assert dynamic.token_pooling.sizes.shape == (2, 1 + 2)  # 2x8 -> 1x4 -> 1x2


def test_a_grid_whose_count_is_no_square_is_read_and_not_refused() -> None:
    """12x20 gives a 3x5 grid: once refused (15 tokens are neither 4x4 nor a square), now
    padded and pooled as 3x5 -> 2x3 -> 1x2, each output's size the patches it holds."""
    model = leanformer.apply_token_pooling(tiny_vit(), keep=[0.5, 0.5, 1.0], method="conv", carry=True)
    x = torch.randn(2, 3, 12, 20)
    tokens, pooled = _first_conv_io(model, x)
    padded = F.pad(tokens.transpose(1, 2).reshape(2, 16, 3, 5), (0, 1, 0, 1), mode="replicate")
    torch.testing.assert_close(pooled, F.avg_pool2d(padded, 2).flatten(2).transpose(1, 2))
    with torch.no_grad():
        model(x)
    sizes = model.token_pooling.sizes
    torch.testing.assert_close(sizes[:, 1:], torch.tensor([[12.0, 3.0]] * 2))  # columns 0-3 / 4


def test_the_entry_step_halves_the_recorded_grid() -> None:
    """Entry step, then the first block's own layer: 2x8 -> 1x4 -> 1x2 (the count alone
    reads 4x4 -> 2x2 -> 1x1)."""
    model = leanformer.apply_token_pooling(
        tiny_vit(), keep=[0.25, 1.0, 1.0], method="conv", reduce_at="entry", carry=True
    )
    with torch.no_grad():
        model(torch.randn(2, 3, *WIDE))
    sizes = model.token_pooling.sizes
    torch.testing.assert_close(sizes[:, 1:], torch.full((2, 2), 8.0))
    # The entry step is sized on the grid too: 3x5 (no count reading takes 15) -> 2x3,
    # then 1x2 and 1x1 in the first two blocks.
    leanformer.remove_token_pooling(model)
    leanformer.apply_token_pooling(model, keep=[0.25, 0.5, 1.0], method="conv", reduce_at="entry", carry=True)
    with torch.no_grad():
        model(torch.randn(2, 3, 12, 20))
    torch.testing.assert_close(model.token_pooling.sizes[:, 1:], torch.full((2, 1), 15.0))


def test_the_cluster_trace_follows_the_recorded_grid() -> None:
    """`visualize clusters`' trace passes the grid on: patch (r, c) of 2x8 lands in token
    c // 2 (one row of windows), not in the windows of a 4x4 reading."""
    model = leanformer.apply_token_pooling(tiny_vit(), keep=[0.5, 1.0, 1.0], method="conv", carry=True)
    trace = trace_token_sources(model, torch.randn(2, 3, *WIDE))
    assign = patch_assignment(trace, 0, 16, 2)
    expected = (torch.arange(8) // 2).repeat(2)
    assert torch.equal(assign, expected.expand(2, 16))


def test_a_copy_records_into_its_own_pooling_and_removal_restores_the_projection() -> None:
    model = leanformer.apply_token_pooling(tiny_vit(), keep=[0.5, 1.0, 1.0], method="conv", carry=True)
    copied = copy.deepcopy(model)
    tokens, pooled = _first_conv_io(copied, torch.randn(1, 3, *WIDE))
    torch.testing.assert_close(pooled, _pooled_by_hand(tokens, (2, 8)))
    with torch.no_grad():
        copied.patch_embed(torch.randn(1, 3, *WIDE))
    assert copied.token_pooling.embedded_grid == (2, 8) and model.token_pooling.embedded_grid is None
    leanformer.remove_token_pooling(model)
    assert "forward" not in model.patch_embed.proj.__dict__


def test_a_block_run_on_tokens_of_its_own_reads_the_count() -> None:
    """Without a recorded grid (a block called directly) conv reads the count, as before."""
    model = leanformer.apply_token_pooling(tiny_vit(), keep=[0.5, 1.0, 1.0], method="conv", carry=True)
    x = torch.randn(2, 17, 16)
    with torch.no_grad():
        out = model.blocks[0](x)
    assert out.shape == (2, 1 + 4, 16)
    with pytest.raises(ValueError, match=r"got 16 tokens on a 2x4 grid"):
        pooled_block_forward(
            block_parts(model.blocks[0]), x, None, model.token_pooling.reducer(0), 1, "attn", grid=(2, 4)
        )


def test_a_later_block_run_on_its_own_gets_no_grid_of_the_last_image() -> None:
    """A conv in block 1 called on the model's own 4x4 tokens after a forward of a 2x8
    image: the last block handed no grid on, so the layer reads the count, 4x4."""
    model = leanformer.apply_token_pooling(tiny_vit(), keep=None, method="conv", layers=[1])
    with torch.no_grad():
        model(torch.randn(1, 3, *WIDE))
    tokens, pooled = _conv_io(model, 1, lambda: model.blocks[1](torch.randn(1, 17, 16)))
    torch.testing.assert_close(pooled, _pooled_by_hand(tokens, (4, 4)))


def test_a_refused_call_leaves_no_grid_for_the_next() -> None:
    """A call the pooled block refuses (a mask) has read the grid all the same."""
    model = leanformer.apply_token_pooling(tiny_vit(), keep=[0.5, 1.0, 1.0], method="conv", carry=True)
    with pytest.raises(ValueError, match="mask"), torch.no_grad():
        model(torch.randn(1, 3, *WIDE), attn_mask=torch.zeros(1, 17, 17, dtype=torch.bool))
    assert model.token_pooling.embedded_grid is None


def test_conv_after_a_selection_is_refused_naming_why() -> None:
    """The tokens a selection keeps came from the grid but lie on none: conv used to read
    their count (16 tokens as 4x4) and pool tokens that are no neighbours."""
    host = tiny_vit(img_size=32)  # 8x8 patches
    model = apply_reducers(
        host, [TokenSelection(keep=16, mode="random"), ConvDownsample(dim=16, grid_size=(8, 8)), None]
    )
    with pytest.raises(ValueError, match="from a clustering, selection or merge before it"), torch.no_grad():
        model(torch.randn(1, 3, 32, 32))


def test_models_sharing_a_patch_projection_cannot_both_read_grids_from_it() -> None:
    first, second = tiny_vit(), tiny_vit()
    second.patch_embed = first.patch_embed
    leanformer.apply_token_pooling(first, keep=[0.5, 1.0, 1.0], method="conv")
    with pytest.raises(UnsupportedHostError, match="already records image grids for another model"):
        leanformer.apply_token_pooling(second, keep=[0.5, 1.0, 1.0], method="conv")
    assert not leanformer.is_patched(second)
    # Methods that do not read the grid leave the projection alone, so sharing it is fine.
    leanformer.apply_token_pooling(second, keep=0.5, method="merge")
    assert installed(second.patch_embed.proj.__dict__["forward"]).pooling is first.token_pooling


def test_a_forward_installed_on_the_projection_runs_and_comes_back() -> None:
    """Another library's instance ``forward`` on the projection (device-map hooks) still
    runs while patched, and is what removal puts back."""
    model = tiny_vit()
    proj = model.patch_embed.proj
    calls: list[int] = []

    def hooked(x: Tensor) -> Tensor:
        calls.append(1)
        return type(proj).forward(proj, x)

    proj.forward = hooked
    leanformer.apply_token_pooling(model, keep=[0.5, 1.0, 1.0], method="conv", carry=True)
    tokens, pooled = _first_conv_io(model, torch.randn(1, 3, *WIDE))
    assert calls == [1]
    torch.testing.assert_close(pooled, _pooled_by_hand(tokens, (2, 8)))
    leanformer.remove_token_pooling(model)
    assert proj.__dict__["forward"] is hooked


def test_a_wrapped_projection_is_read_and_a_host_without_one_refuses_conv() -> None:
    """A conv inside a wrapper of timm's projection (a low-rank adapter) records the grid;
    a host taking any image size with no patch conv at all refuses conv instead of
    reading the count."""

    class Wrapped(nn.Module):
        def __init__(self, conv: nn.Module) -> None:
            super().__init__()
            self.base = conv

        def forward(self, x: Tensor) -> Tensor:
            return self.base(x)

    model = tiny_vit()
    model.patch_embed.proj = Wrapped(model.patch_embed.proj)
    leanformer.apply_token_pooling(model, keep=[0.5, 1.0, 1.0], method="conv", carry=True)
    tokens, pooled = _first_conv_io(model, torch.randn(1, 3, *WIDE))
    torch.testing.assert_close(pooled, _pooled_by_hand(tokens, (2, 8)))

    class Linear(nn.Module):  # patches embedded by a linear layer: no grid to read
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(48, 16)

        def forward(self, x: Tensor) -> Tensor:
            B, _, H, W = x.shape
            patches = x.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5)
            return self.linear(patches.reshape(B, H // 4, W // 4, -1)).permute(0, 3, 1, 2)

    dynamic = tiny_vit()
    dynamic.patch_embed.proj = Linear()
    with pytest.raises(UnsupportedHostError, match="takes other image sizes"):
        leanformer.apply_token_pooling(dynamic, keep=[0.5, 1.0, 1.0], method="conv")
    fixed = tiny_vit(dynamic=False)
    fixed.patch_embed.proj = Linear()
    leanformer.apply_token_pooling(fixed, keep=[0.5, 1.0, 1.0], method="conv")  # one size: its own grid


@pytest.mark.slow
def test_compiled_conv_matches_eager_at_two_image_sizes() -> None:
    """fullgraph compiles read the recorded grid, and a second image size recompiles."""
    model = leanformer.apply_token_pooling(tiny_vit(), keep=[0.5, 0.5, 1.0], method="conv", carry=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for size in (WIDE, (16, 16), WIDE):
            x = torch.randn(2, 3, *size)
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-5)


def test_conv_may_share_a_projection_another_model_records_from_for_unpooling_only() -> None:
    """A merge patched first records grids (for unpooling) from the shared projection; conv
    patched second wraps that recorder and reads each image's grid as a model of its own
    projection does. A second conv on that projection is refused."""
    first, second = tiny_vit(), tiny_vit()
    second.patch_embed = first.patch_embed
    alone = copy.deepcopy(second)  # the same weights, its own projection
    leanformer.apply_token_pooling(first, keep=0.5, method="merge", unpool=True)
    torch.manual_seed(0)
    leanformer.apply_token_pooling(second, keep=[0.5, 1.0, 1.0], method="conv")
    torch.manual_seed(0)
    leanformer.apply_token_pooling(alone, keep=[0.5, 1.0, 1.0], method="conv")
    third = tiny_vit()
    third.patch_embed = first.patch_embed
    with pytest.raises(UnsupportedHostError, match="already records image grids for another model"):
        leanformer.apply_token_pooling(third, keep=[0.5, 1.0, 1.0], method="conv")
    x = torch.randn(2, 3, *WIDE)
    with torch.no_grad():
        torch.testing.assert_close(second(x), alone(x), rtol=0, atol=0)
        assert first.forward_features(x).shape[1] == 17  # unpooled: the class token and 16 patches
