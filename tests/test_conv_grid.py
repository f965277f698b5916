"""``conv`` on a host that takes other image sizes reads the grid of the image at hand.

A 2x2 window needs the raster, which the token count does not give: an 8x32 image on a
model built for 16x16 (patch 4) has 16 patches on a 2x8 grid, the count of the model's
own 4x4. The patched host records the grid where it embeds the patches, so conv reads
2x8. References: conv on the true grid by hand (the layer starts as 2x2 average
pooling), and a host built for 8x32 holding the same weights.
"""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed
from torch import Tensor, nn

import leanformer
from leanformer.apps.cluster_maps import patch_assignment, trace_token_sources
from leanformer.layers.host_adapter import pooled_block_forward
from leanformer.layers.timm_host import block_parts

transformers = pytest.importorskip("transformers")

WIDE = (8, 32)  # 2x8 patches of 4x4: the count of the built 4x4 grid


def _timm_host(img_size: int | tuple[int, int] = 16, dynamic: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        depth=3,
        img_size=img_size,
        patch_size=4,
        embed_dim=16,
        num_heads=2,
        num_classes=3,
        dynamic_img_size=dynamic,
    ).eval()


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


def _first_conv_io(model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """The tokens the first conv layer received and gave, on one forward of ``x``."""
    seen: dict[str, Tensor] = {}

    def spy(module: nn.Module, args: tuple[Tensor, ...], kwargs: dict, out: tuple[Tensor, Tensor]) -> None:
        seen.setdefault("in", args[0])
        seen.setdefault("out", out[0])

    reducer = model.token_pooling.reducer(0)
    handle = reducer.register_forward_hook(spy, with_kwargs=True)
    try:
        with torch.no_grad():
            _run(model, x)
    finally:
        handle.remove()
    return seen["in"], seen["out"]


def _pooled_by_hand(tokens: Tensor, grid: tuple[int, int]) -> Tensor:
    """2x2 average pooling of ``tokens [B, h*w, C]`` on their ``h x w`` raster."""
    B, _, C = tokens.shape
    raster = tokens.transpose(1, 2).reshape(B, C, *grid)
    return F.avg_pool2d(raster, 2).flatten(2).transpose(1, 2)


@pytest.mark.parametrize("host", ["timm", "hf"])
def test_conv_pools_the_grid_of_a_non_square_image(host: str) -> None:
    model = leanformer.apply_token_pooling(
        _timm_host() if host == "timm" else _hf_host(), keep=[0.5, 1.0, 1.0], method="conv", carry=True
    )
    tokens, pooled = _first_conv_io(model, torch.randn(2, 3, *WIDE))
    assert tokens.shape[1] == 16
    torch.testing.assert_close(pooled, _pooled_by_hand(tokens, (2, 8)))
    # Read once: nothing stale is left for blocks run later on tokens of their own.
    assert model.token_pooling.embedded_grid is None and model.token_pooling.grid == (1, 4)


def test_a_dynamic_host_agrees_with_one_built_for_the_image() -> None:
    """The same weights, the position embeddings resampled as the dynamic host resamples
    them: the host built for 8x32 reads its own grid, the dynamic one the recorded grid."""
    dynamic = _timm_host()
    built = _timm_host(img_size=WIDE, dynamic=False)
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
    model = leanformer.apply_token_pooling(_timm_host(), keep=[0.5, 0.5, 1.0], method="conv", carry=True)
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
        _timm_host(), keep=[0.25, 1.0, 1.0], method="conv", reduce_at="entry", carry=True
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
    model = leanformer.apply_token_pooling(_timm_host(), keep=[0.5, 1.0, 1.0], method="conv", carry=True)
    trace = trace_token_sources(model, torch.randn(2, 3, *WIDE))
    assign = patch_assignment(trace, 0, 16, 2)
    expected = (torch.arange(8) // 2).repeat(2)
    assert torch.equal(assign, expected.expand(2, 16))


def test_a_copy_records_into_its_own_pooling_and_removal_restores_the_projection() -> None:
    model = leanformer.apply_token_pooling(_timm_host(), keep=[0.5, 1.0, 1.0], method="conv", carry=True)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied(torch.randn(1, 3, *WIDE))
    assert copied.token_pooling.grid == (1, 4) and model.token_pooling.grid is None
    leanformer.remove_token_pooling(model)
    assert "forward" not in model.patch_embed.proj.__dict__


def test_a_block_run_on_tokens_of_its_own_reads_the_count() -> None:
    """Without a recorded grid (a block called directly) conv reads the count, as before."""
    model = leanformer.apply_token_pooling(_timm_host(), keep=[0.5, 1.0, 1.0], method="conv", carry=True)
    x = torch.randn(2, 17, 16)
    with torch.no_grad():
        out = model.blocks[0](x)
    assert out.shape == (2, 1 + 4, 16) and model.token_pooling.grid is None
    with pytest.raises(ValueError, match=r"got 16 tokens on a 2x4 grid"):
        pooled_block_forward(
            block_parts(model.blocks[0]), x, None, model.token_pooling.reducer(0), 1, "attn", grid=(2, 4)
        )


@pytest.mark.slow
def test_compiled_conv_matches_eager_at_two_image_sizes() -> None:
    """fullgraph compiles read the recorded grid, and a second image size recompiles."""
    model = leanformer.apply_token_pooling(_timm_host(), keep=[0.5, 0.5, 1.0], method="conv", carry=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for size in (WIDE, (16, 16), WIDE):
            x = torch.randn(2, 3, *size)
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-5)
