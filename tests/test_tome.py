"""``method="tome"`` against a slow reference written from the ToMe paper's description
(Bolya et al., ICLR 2023, section 3 and its public code's conventions), on a timm ViT, a
timm distilled DeiT (two protected tokens) and a Hugging Face ViT, all tiny and random.

The reference runs each block token by token in float64: attention with ``log(size)``
added to every key's logit (proportional attention), the keys averaged over heads as the
similarity, the alternate A/B split over the whole sequence (class token first, in A), each
A token linked to its most similar B token (prefix tokens link to nothing and take no
link), the ``r`` best links merged as size-weighted averages, and the output laid out as
the unmerged A tokens then the B tokens (prefix tokens first). Embedding and head are the
host's own modules. The library's model runs in float64 too, so the comparison is of the
algorithm, not of rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import timm
import torch
from torch import Tensor, nn

from leanformer.models.registry import create_model
from leanformer.ops.tome import tome_merge_plan
from leanformer.patch.api import apply_token_pooling
from leanformer.pooling.budgets import parse_keep, parse_r, tome_schedule

transformers = pytest.importorskip("transformers")

IMAGES = 2
DEPTH = 4
PATCHES = 64  # 32x32 images, patch 4


@dataclass
class RefBlock:
    """One pre-norm block as float64 functions of ``[N, C]`` token matrices."""

    norm1: Callable[[Tensor], Tensor]
    qkv: Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]  # -> q, k, v [N, C]
    heads: int
    proj: Callable[[Tensor], Tensor]  # attention output projection (+ LayerScale)
    mlp_half: Callable[[Tensor], Tensor]  # x -> mlp(norm2(x)) (+ LayerScale)


def reference_attention(
    block: RefBlock, x: Tensor, sizes: list[float], proportional: bool
) -> tuple[Tensor, Tensor]:
    """The attention half's output ``[N, C]`` and its keys averaged over heads ``[N, D]``."""
    q, k, v = block.qkv(block.norm1(x))
    n, c = x.shape
    d = c // block.heads
    out = torch.zeros(n, c, dtype=torch.float64)
    for h in range(block.heads):
        cols = slice(h * d, (h + 1) * d)
        for i in range(n):
            logits = [float(q[i, cols] @ k[j, cols]) / math.sqrt(d) for j in range(n)]
            if proportional:
                logits = [z + math.log(s) for z, s in zip(logits, sizes, strict=True)]
            top = max(logits)
            weights = [math.exp(z - top) for z in logits]
            total = sum(weights)
            for j in range(n):
                out[i, cols] += weights[j] / total * v[j, cols]
    keys = sum(k[:, h * d : (h + 1) * d] for h in range(block.heads)) / block.heads
    return block.proj(out), keys


def cosine(a: Tensor, b: Tensor) -> float:
    return float(a @ b) / (float(a.norm()) * float(b.norm()))


def reference_merge(
    x: Tensor, sizes: list[float], groups: list[list[int]], metric: Tensor, r: int, prefix: int
) -> tuple[Tensor, list[float], list[list[int]]]:
    """One ToMe step, token by token: returns the merged tokens, their sizes and the
    original tokens each stands for."""
    n = x.shape[0]
    r = min(r, (n - prefix) // 2)
    if r <= 0:
        return x, sizes, groups
    set_a = [i for i in range(n) if i % 2 == 0]
    set_b = [i for i in range(n) if i % 2 == 1]
    links = []  # (score, position in A, partner in B)
    for pos, a in enumerate(set_a):
        if a < prefix:  # a protected token links to nothing
            links.append((-math.inf, pos, None))
            continue
        best, partner = -math.inf, None
        for b in set_b:
            if b < prefix:  # ... and takes no link
                continue
            score = cosine(metric[a], metric[b])
            if score > best:
                best, partner = score, b
        links.append((best, pos, partner))
    ranked = sorted(links, key=lambda link: (-link[0], link[1]))  # best first, earlier first on ties
    merged, unmerged = ranked[:r], ranked[r:]
    unmerged_a = [set_a[pos] for _, pos, _ in unmerged]
    if prefix > 0:
        unmerged_a.sort()  # the class token stays first
    into = {b: [b] for b in set_b}
    for _, pos, partner in merged:
        into[partner].append(set_a[pos])
    layout = (
        [a for a in unmerged_a if a < prefix]
        + [b for b in set_b if b < prefix]
        + [a for a in unmerged_a if a >= prefix]
        + [b for b in set_b if b >= prefix]
    )
    out, out_sizes, out_groups = [], [], []
    for token in layout:
        members = into.get(token, [token])
        size = sum(sizes[m] for m in members)
        out.append(sum(sizes[m] * x[m] for m in members) / size)
        out_sizes.append(size)
        out_groups.append(sorted(g for m in members for g in groups[m]))
    return torch.stack(out), out_sizes, out_groups


def reference_forward(
    blocks: list[RefBlock], x: Tensor, rs: list[int], prefix: int, proportional: bool = True
) -> tuple[Tensor, list[float], list[list[int]]]:
    """The blocks with ToMe between each attention and MLP, on one image's tokens ``[N, C]``."""
    sizes = [1.0] * x.shape[0]
    groups = [[i] for i in range(x.shape[0])]
    for block, r in zip(blocks, rs, strict=True):
        attended, keys = reference_attention(block, x, sizes, proportional)
        x = x + attended
        x, sizes, groups = reference_merge(x, sizes, groups, keys, r, prefix)
        x = x + block.mlp_half(x)
    return x, sizes, groups


# --------------------------------------------------------------------------- hosts


@dataclass
class Host:
    model: nn.Module
    blocks: list[RefBlock]
    first_block: nn.Module  # its input is the embedded tokens
    head: Callable[[Tensor], Tensor]  # tokens [B, N, C] after the last block -> logits
    prefix: int


def _spread(model: nn.Module) -> nn.Module:
    """Weights at std 0.3 (at their initialisation attention is nearly uniform and links
    nearly tie), in float64."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.double().eval()


def _timm_host(name: str) -> Host:
    torch.manual_seed(0)
    model = timm.create_model(
        name,
        pretrained=False,
        img_size=32,
        patch_size=4,
        embed_dim=32,
        depth=DEPTH,
        num_heads=2,
        num_classes=5,
    )
    _spread(model)
    blocks = []
    for blk in model.blocks:

        def qkv(h: Tensor, blk: nn.Module = blk) -> tuple[Tensor, Tensor, Tensor]:
            q, k, v = blk.attn.qkv(h).chunk(3, dim=-1)
            return q, k, v

        blocks.append(
            RefBlock(
                norm1=blk.norm1,
                qkv=qkv,
                heads=blk.attn.num_heads,
                proj=lambda o, blk=blk: blk.ls1(blk.attn.proj(o)),
                mlp_half=lambda x, blk=blk: blk.ls2(blk.mlp(blk.norm2(x))),
            )
        )

    def head(tokens: Tensor) -> Tensor:
        return model.forward_head(model.norm(tokens))

    return Host(model, blocks, model.blocks[0], head, int(model.num_prefix_tokens))


def _hf_host() -> Host:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=DEPTH,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=5,
    )
    model = _spread(transformers.ViTForImageClassification(config))
    blocks = []
    for layer in model.vit.layers:
        attn = layer.attention

        def qkv(h: Tensor, attn: nn.Module = attn) -> tuple[Tensor, Tensor, Tensor]:
            return attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)

        blocks.append(
            RefBlock(
                norm1=layer.layernorm_before,
                qkv=qkv,
                heads=config.num_attention_heads,
                proj=attn.o_proj,
                mlp_half=lambda x, layer=layer: layer.mlp(layer.layernorm_after(x)),
            )
        )

    def head(tokens: Tensor) -> Tensor:
        return model.classifier(model.vit.layernorm(tokens)[:, 0])

    return Host(model, blocks, model.vit.layers[0], head, 1)


HOSTS: dict[str, Callable[[], Host]] = {
    "timm_vit": lambda: _timm_host("vit_tiny_patch16_224"),
    "timm_deit_distilled": lambda: _timm_host("deit_tiny_distilled_patch16_224"),
    "hf_vit": _hf_host,
}


def _embedded(host: Host, images: Tensor) -> Tensor:
    """The tokens the first block receives (embedding, positions, prefix tokens: the host's)."""
    seen: list[Tensor] = []
    handle = host.first_block.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            host.model(images)
    finally:
        handle.remove()
    return seen[0]


def _logits(model: nn.Module, images: Tensor) -> Tensor:
    out = model(images)
    return out if isinstance(out, Tensor) else out.logits


def _groups(source: Tensor) -> list[list[int]]:
    return [row.nonzero().flatten().tolist() for row in source]


@pytest.mark.parametrize("host_name", list(HOSTS))
@pytest.mark.parametrize("r", [1, 8, 16, "max"])
def test_tome_matches_the_reference(host_name: str, r: int | str) -> None:
    host = HOSTS[host_name]()
    torch.manual_seed(1)
    images = torch.randn(IMAGES, 3, 32, 32, dtype=torch.float64)
    tokens = _embedded(host, images)
    r_value = PATCHES // 2 if r == "max" else int(r)
    with torch.no_grad():
        expected = []
        for b in range(IMAGES):
            x, sizes, groups = reference_forward(host.blocks, tokens[b], [r_value] * DEPTH, host.prefix)
            expected.append((host.head(x[None])[0], sizes, groups))
        apply_token_pooling(host.model, method="tome", r=r_value)
        host.model.token_pooling.trace_source = True
        logits = _logits(host.model, images)
    pooling = host.model.token_pooling
    for b, (ref_logits, ref_sizes, ref_groups) in enumerate(expected):
        assert (logits[b] - ref_logits).abs().max() <= 1e-5
        assert _groups(pooling.source[b]) == ref_groups
        assert pooling.sizes[b].tolist() == ref_sizes
    # Every original token is in exactly one group, and a token's size counts its group.
    source = pooling.source
    assert torch.equal(source.sum(dim=1), torch.ones_like(source.sum(dim=1)))
    assert torch.equal(source.sum(dim=2), pooling.sizes.float())
    n = PATCHES
    for _ in range(DEPTH):
        n -= min(r_value, n // 2)  # ToMe's cap: half of the patch tokens a block receives
    assert source.shape[1] == host.prefix + n


def test_without_proportional_attention_sizes_still_weigh_the_merges() -> None:
    """``carry=False`` is ToMe's ``prop_attn=False``: no log(size) in the attention, but the
    merges stay size-weighted averages."""
    host = HOSTS["timm_vit"]()
    images = torch.randn(IMAGES, 3, 32, 32, dtype=torch.float64)
    tokens = _embedded(host, images)
    with torch.no_grad():
        x, sizes, _ = reference_forward(host.blocks, tokens[0], [8] * DEPTH, host.prefix, proportional=False)
        expected = host.head(x[None])[0]
        apply_token_pooling(host.model, method="tome", r=8, carry=False)
        logits = _logits(host.model, images)
    assert (logits[0] - expected).abs().max() <= 1e-5
    assert host.model.token_pooling.sizes[0].tolist() == sizes


def test_r_schedules_and_their_spellings() -> None:
    # ToMe's (r, inflection): a straight line from r (1 - i) to r (1 + i), rounded down.
    assert tome_schedule(16, 0.0, 4) == [16, 16, 16, 16]
    assert tome_schedule(8, 0.5, 5) == [4, 6, 8, 10, 12]
    assert tome_schedule(8, -0.5, 3) == [12, 8, 4]
    assert parse_r(16) == parse_keep("r16") == parse_keep({"r": 16})
    assert (
        parse_r((8, 0.5)) == parse_keep({"r": 8, "inflection": 0.5}) == parse_keep("{r: 8, inflection: 0.5}")
    )
    assert parse_r([4, 2, 0]) == parse_keep({"r": [4, 2, 0]})
    assert parse_r([4, 2, 0]).per_block(depth=3, num_tokens=10) == [6, 4, 4]
    for schedule in (parse_r((8, 0.5)), parse_r([4, 2, 0]), parse_r(16)):
        assert parse_keep(str(schedule)) == schedule == parse_keep(schedule.to_value())
    for bad, message in (
        (-1, "r needs a token count"),
        ([3, "x"], r"r\[1\] \(block 1\)"),
        ((8, 2.0), r"inflection must lie in \[-1, 1\]"),
        ((8,), "takes two values"),
        ([], "needs one entry per block"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_r(bad)
    model = _timm_host("vit_tiny_patch16_224").model
    with pytest.raises(ValueError, match="3 values of r for a model of 4 blocks"):
        apply_token_pooling(model, method="tome", r=[1, 2, 3])
    with pytest.raises(ValueError, match="not both"):
        apply_token_pooling(model, method="tome", r=2, keep=0.5)


def test_r_changes_at_run_time_and_equals_a_fresh_patch() -> None:
    images = torch.randn(IMAGES, 3, 32, 32, dtype=torch.float64)
    model = apply_token_pooling(_timm_host("vit_tiny_patch16_224").model, method="tome", r=16)
    model.token_pooling.r = (8, 0.5)
    assert model.token_pooling.r == (8, 0.5) and model.token_pooling.keep == parse_r((8, 0.5))
    fresh = apply_token_pooling(_timm_host("vit_tiny_patch16_224").model, method="tome", r=(8, 0.5))
    with torch.no_grad():
        torch.testing.assert_close(model(images), fresh(images), rtol=0, atol=0)
    model.token_pooling.keep = "r4"
    assert model.token_pooling.r == 4
    with pytest.raises(ValueError, match="needs a token count"):
        model.token_pooling.r = -2
    assert model.token_pooling.r == 4  # a refused value leaves the budget as it was


def test_counts_and_ratios_within_tomes_reach() -> None:
    """A count or ratio budget removes at most half of a block's tokens, or is refused;
    within that it is the same ToMe step as the r that removes as many."""
    images = torch.randn(IMAGES, 3, 32, 32, dtype=torch.float64)
    by_ratio = apply_token_pooling(_timm_host("vit_tiny_patch16_224").model, method="tome", keep=0.5)
    by_r = apply_token_pooling(_timm_host("vit_tiny_patch16_224").model, method="tome", r=[32, 16, 8, 4])
    with torch.no_grad():
        torch.testing.assert_close(by_ratio(images), by_r(images), rtol=0, atol=0)
    with pytest.raises(
        ValueError, match="tome removes at most half of a block's tokens: block 0 receives 64"
    ):
        apply_token_pooling(_timm_host("vit_tiny_patch16_224").model, method="tome", keep=0.4)
    with pytest.raises(ValueError, match="reduces between each block's attention and MLP"):
        apply_token_pooling(_timm_host("vit_tiny_patch16_224").model, method="tome", r=4, reduce_at="mlp")
    with pytest.raises(ValueError, match="ToMe merges 1 to 2 of these 5 tokens"):
        tome_merge_plan(torch.randn(1, 5, 4), 3, num_prefix=1)


def test_our_deit_takes_tome() -> None:
    model = create_model("deit_test", pool="tome", keep={"r": 4}, carry=True).eval()
    model.token_pooling.trace_source = True
    with torch.no_grad():
        model(torch.randn(2, 3, 16, 16))
    assert model.token_pooling.sizes.shape == (2, 1 + 16 - 4 - 4 - 4)
    assert model.token_pooling.source.shape == (2, 5, 17)
