"""SReT: sliced recursive transformers (Shen, Liu and Xing, ECCV 2022).

Structure (supplement table 7 and the official configurations):

* stem: three 3x3 stride-2 conv + BatchNorm + ReLU (``in -> stem_chs[0] -> stem_chs[1]
  -> embed_dims[0]``), so a 224x224 image becomes a 28x28 grid of tokens;
* a learned position embedding on that grid, resized bicubically for other sizes;
* three recursive stages (:class:`~leanformer.layers.recursive.RecursiveStage`) of
  ``unique[s]`` sliced-attention blocks each applied ``loops`` times, with an NLL after
  every application; between stages a depthwise-grouped 3x3 stride-2 conv halves the
  grid and doubles the channels;
* no class token: global average pool -> LayerNorm -> linear head.

Sliced attention: ``groups[s] = (g_pass0, g_pass1, ...)`` per stage, default
``[8, 2][4, 1][1, 1]``. Only passes after the first permute (as in the official code);
``permutation`` selects the ablation mode of supplement table 2:

* ``"P+I-L"`` (default): permutation + inverse, none in the last stage;
* ``"P+I"``: permutation + inverse in every stage;
* ``"P"``: permutation without inverse (token order stays shuffled);
* ``"none"``: plain contiguous groups.

Token counts must be divisible by the groups of their stage; other sizes raise a
``ValueError`` before any computation (no padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, cast, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leanformer.layers.checks import check_positive, check_positive_number, check_rates, check_sizes, head_dim
from leanformer.layers.classifier import classifier
from leanformer.layers.init import init_vit_weights
from leanformer.layers.norm import LAYER_NORM
from leanformer.layers.patch_embed import to_2tuple
from leanformer.layers.recursive import RecursiveStage
from leanformer.layers.residual_coeffs import LRCMode, check_lrc_mode
from leanformer.layers.sliced_attention import SlicedBlock
from leanformer.models.registry import register

Permutation = Literal["P+I-L", "P+I", "P", "none"]
PERMUTATIONS: tuple[str, ...] = get_args(Permutation)


def conv_out(size: int, stride: int) -> int:
    """Output side of a 3x3 conv with padding 1 and ``stride``."""
    return (size - 1) // stride + 1


class ConvStem(nn.Module):
    """Three 3x3 conv + BN + ReLU: ``[B, in, H, W] -> [B, out, H/s, W/s]`` (``s`` = product of strides)."""

    def __init__(self, *, in_chans: int, widths: Sequence[int], strides: Sequence[int]) -> None:
        super().__init__()
        check_positive(in_chans=in_chans)
        if len(widths) != len(strides):
            raise ValueError(f"stem has {len(widths)} widths but {len(strides)} strides")
        layers: list[nn.Module] = []
        c = in_chans
        for w, s in zip(widths, strides):
            layers += [nn.Conv2d(c, w, 3, stride=s, padding=1), nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
            c = w
        self.layers = nn.Sequential(*layers)
        self.strides = tuple(strides)

    def grid(self, img_size: tuple[int, int]) -> tuple[int, int]:
        h, w = img_size
        for s in self.strides:
            h, w = conv_out(h, s), conv_out(w, s)
        return h, w

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class SReT(nn.Module):
    """Sliced recursive transformer; see the module docstring.

    ``forward(x [B, in_chans, H, W]) -> logits [B, num_classes]``;
    ``forward_features -> tokens [B, N_last, C_last]``.
    """

    def __init__(
        self,
        *,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        stem_chs: Sequence[int] = (32, 64),
        stem_strides: Sequence[int] = (2, 2, 2),
        embed_dims: Sequence[int] = (64, 128, 256),
        num_heads: Sequence[int] = (2, 4, 8),
        unique: Sequence[int] = (2, 5, 3),
        loops: int = 2,
        groups: Sequence[Sequence[int]] = ((8, 2), (4, 1), (1, 1)),
        permutation: Permutation = "P+I-L",
        mlp_ratio: float = 3.6,
        nll_ratio: float = 1.0,
        lrc: LRCMode = "both",
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if permutation is None:  # --opt permutation=none reads as YAML's null
            permutation = "none"
        groups = self._validate(
            stem_chs,
            stem_strides,
            embed_dims,
            num_heads,
            unique,
            loops,
            groups,
            permutation,
            lrc,
        )
        check_positive_number(mlp_ratio=mlp_ratio)  # nll_ratio: RecursiveStage checks it
        check_rates(drop_rate=drop_rate, attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate)
        self.img_size = to_2tuple(img_size)
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.embed_dims = tuple(embed_dims)
        self.num_features = self.embed_dims[-1]
        self.groups = groups
        self.permutation = permutation

        self.stem = ConvStem(in_chans=in_chans, widths=[*stem_chs, embed_dims[0]], strides=stem_strides)
        self.pos_grid = self.stem.grid(self.img_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, embed_dims[0], *self.pos_grid))
        self.pos_drop = nn.Dropout(drop_rate)

        num_stages = len(embed_dims)
        total = sum(unique) * loops
        stages, pools = [], []
        offset = 0
        for s in range(num_stages):
            last = s == num_stages - 1
            permute = permutation != "none" and not (permutation == "P+I-L" and last)
            blocks = [
                SlicedBlock(
                    embed_dims[s],
                    num_heads=num_heads[s],
                    groups=self.groups[s],
                    # Only the passes after the first permute, as in the official code.
                    permute=[permute and p > 0 for p in range(loops)],
                    inverse=permutation != "P",
                    mlp_ratio=mlp_ratio,
                    qkv_bias=qkv_bias,
                    lrc=lrc,
                    proj_drop=drop_rate,
                    attn_drop=attn_drop_rate,
                    # Linear in the layer index, block b of a stage at its first application.
                    drop_path=drop_path_rate * (offset + b) / max(total, 1),
                    perm_seed=100 * s + b,
                )
                for b in range(unique[s])
            ]
            offset += unique[s] * loops
            stages.append(
                RecursiveStage(
                    blocks, dim=embed_dims[s], loops=loops, nll_ratio=nll_ratio, lrc=lrc, drop=drop_rate
                )
            )
            if not last:
                # Depthwise-grouped: each input channel yields out/in channels.
                pools.append(
                    nn.Conv2d(embed_dims[s], embed_dims[s + 1], 3, stride=2, padding=1, groups=embed_dims[s])
                )
        self.stages = nn.ModuleList(stages)
        self.pools = nn.ModuleList(pools)
        self.norm = LAYER_NORM(self.num_features)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = classifier(self.num_features, num_classes)
        self._init_weights()

    @staticmethod
    def _validate(
        stem_chs: Sequence[int],
        stem_strides: Sequence[int],
        embed_dims: Sequence[int],
        num_heads: Sequence[int],
        unique: Sequence[int],
        loops: int,
        groups: Sequence[Sequence[int]],
        permutation: str,
        lrc: str,
    ) -> tuple[tuple[int, ...], ...]:
        """Check every option; return ``groups`` as integers."""
        per_stage = {"embed_dims": embed_dims, "num_heads": num_heads, "unique": unique, "groups": groups}
        for name, value in per_stage.items():
            if not isinstance(value, list | tuple):
                raise ValueError(f"{name} must be a list with one entry per stage, got {value!r}")
        # Integer sizes first: the checks below compare and count them. Floats are refused,
        # not truncated (groups 8.5 would silently run as 8).
        for name, value in {"embed_dims": embed_dims, "num_heads": num_heads, "unique": unique}.items():
            check_sizes(name, value)
        check_sizes("stem_chs", stem_chs)
        check_sizes("stem_strides", stem_strides)
        check_positive(loops=loops)
        checked_groups = tuple(check_sizes(f"groups[{s}]", gs) for s, gs in enumerate(groups))
        n = len(embed_dims)
        if n < 1 or not (len(num_heads) == len(unique) == len(groups) == n):
            raise ValueError(
                f"embed_dims, num_heads, unique and groups need one entry per stage; got lengths "
                f"{len(embed_dims)}, {len(num_heads)}, {len(unique)}, {len(groups)}"
            )
        if len(stem_chs) + 1 != len(stem_strides):
            raise ValueError(
                f"stem_chs lists the stem's hidden widths (its last conv outputs embed_dims[0]): "
                f"expected {len(stem_strides) - 1} widths for {len(stem_strides)} strides, "
                f"got {len(stem_chs)}"
            )
        for s in range(n):
            head_dim(embed_dims[s], num_heads[s], dim_name=f"stage {s} dim")
            if len(checked_groups[s]) != loops:
                raise ValueError(f"stage {s}: groups {checked_groups[s]} needs one entry per loop ({loops})")
            if s + 1 < n and embed_dims[s + 1] % embed_dims[s]:
                raise ValueError(
                    f"the grouped pooling conv needs embed_dims[{s + 1}] ({embed_dims[s + 1]}) to be a "
                    f"multiple of embed_dims[{s}] ({embed_dims[s]})"
                )
        if permutation not in PERMUTATIONS:
            raise ValueError(f"permutation must be one of {', '.join(PERMUTATIONS)}; got {permutation!r}")
        check_lrc_mode(lrc)
        return checked_groups

    def _init_weights(self) -> None:
        init_vit_weights(self, self.pos_embed)

    def stage_grids(self, img_size: tuple[int, int]) -> list[tuple[int, int]]:
        """Token grid of every stage for an input of ``img_size`` (H, W)."""
        grids = [self.stem.grid(img_size)]
        for _ in self.pools:
            h, w = grids[-1]
            grids.append((conv_out(h, 2), conv_out(w, 2)))
        return grids

    def input_size_ok(self, img_size: tuple[int, int]) -> bool:
        """Whether every stage's token count splits into that stage's groups."""
        grids = self.stage_grids(img_size)
        return all((h * w) % g == 0 for (h, w), gs in zip(grids, self.groups) for g in gs)

    def check_input_size(self, img_size: tuple[int, int]) -> None:
        """Raise ``ValueError`` naming the stage (and a square size that works) if the groups do not fit."""
        if self.input_size_ok(img_size):
            return
        for s, (h, w) in enumerate(self.stage_grids(img_size)):
            if any((h * w) % g for g in self.groups[s]):
                side = max(img_size)
                ok = next((n for n in range(side, 8 * side + 64) if self.input_size_ok((n, n))), None)
                hint = f" (e.g. {ok}x{ok})" if ok is not None else ""
                raise ValueError(
                    f"input {img_size[0]}x{img_size[1]} gives a {h}x{w} token grid ({h * w} tokens) in stage "
                    f"{s + 1}, which does not split into groups {self.groups[s]}; use an input size whose "
                    f"stage grids divide evenly{hint} or other groups"
                )

    def _pos_embed(self, grid: tuple[int, int]) -> Tensor:
        if grid == self.pos_grid:
            return self.pos_embed
        # The official code fixes the grid at 28x28; resizing lets any input size work.
        return F.interpolate(self.pos_embed, size=grid, mode="bicubic", align_corners=False)

    def forward_features(self, x: Tensor) -> Tensor:
        """Images ``[B, in_chans, H, W]`` -> last-stage tokens ``[B, N, C]``."""
        if x.ndim != 4:
            raise ValueError(f"expected images [B, C, H, W], got shape {tuple(x.shape)}")
        self.check_input_size((x.shape[-2], x.shape[-1]))
        x = self.stem(x)
        x = self.pos_drop(x + self._pos_embed((x.shape[-2], x.shape[-1])))
        tokens = x.flatten(2).transpose(1, 2)
        for s, stage in enumerate(self.stages):
            if s > 0:
                # Back to the image layout for the pooling conv: [B, N, C] -> [B, C, h, w].
                B, _, C = tokens.shape
                x = tokens.transpose(1, 2).reshape(B, C, *x.shape[-2:])
                x = self.pools[s - 1](x)
                tokens = x.flatten(2).transpose(1, 2)
            tokens = stage(tokens)
        return tokens

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Tokens ``[B, N, C]`` -> global average pool -> LayerNorm -> logits ``[B, classes]``."""
        x = self.norm(x.mean(dim=1))
        if pre_logits:
            return x
        return self.head(self.head_drop(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def reset_classifier(self, num_classes: int) -> None:
        self.head = classifier(self.num_features, num_classes)  # raises before the model changes
        self.num_classes = num_classes

    def attention_cost_ratio(self) -> float:
        """Attention-matrix cost relative to the same model with every group count 1.

        Each pass over ``N`` tokens with ``G`` groups costs ``N^2 / G`` (supplement eq. 4).
        """
        sliced = full = 0.0
        for s, (h, w) in enumerate(self.stage_grids(self.img_size)):
            n2 = float(h * w) ** 2 * self.embed_dims[s]
            reps = len(self._stage(s).blocks)
            sliced += reps * sum(n2 / g for g in self.groups[s])
            full += reps * n2 * len(self.groups[s])
        return sliced / full if full else 1.0

    def _stage(self, index: int) -> RecursiveStage:
        return cast(RecursiveStage, self.stages[index])

    def bench_extras(self) -> dict[str, object]:
        return {
            "groups": [list(g) for g in self.groups],
            "permutation": self.permutation,
            "attention_cost_ratio": round(self.attention_cost_ratio(), 4),
            "depth": sum(self._stage(s).depth for s in range(len(self.stages))),
        }


_UNSLICED = ((1, 1), (1, 1), (1, 1))
_TINY: dict[str, Any] = dict(
    stem_chs=(32, 64), embed_dims=(64, 128, 256), num_heads=(2, 4, 8), unique=(2, 5, 3)
)
_SMALL: dict[str, Any] = dict(
    stem_chs=(63, 126), embed_dims=(126, 252, 504), num_heads=(3, 6, 12), mlp_ratio=3.0, nll_ratio=2.0
)
# SReT-B is not in the public code. Table 7's row (widths 336/672/1344, 2/5/3 unique
# blocks, FFN 3.0, NLL 2.0) adds up to 144.7M parameters, twice the 71.2M the paper
# reports, so that row cannot be what was counted. We keep its stem, widths and ratios
# and use 2/4/1 unique blocks, the closest structure to 71.2M with those (71.48M, +0.4%).
# 56 channels per head is our choice (heads do not change the parameter count).
_BASE: dict[str, Any] = dict(
    stem_chs=(96, 168),
    embed_dims=(336, 672, 1344),
    num_heads=(6, 12, 24),
    unique=(2, 4, 1),
    mlp_ratio=3.0,
    nll_ratio=2.0,
)
_PAPER = "depth 4/10/6 (2/5/3 unique blocks x 2), groups [8,2][4,1][1,1], 224x224"

register(
    "sret_tiny", SReT, family="sret", description=f"SReT-T, 4.76M params, {_PAPER}", **_TINY, mlp_ratio=3.6
)
register(
    "sret_tiny_large",
    SReT,
    family="sret",
    description=f"SReT-TL (mlp ratio 4), 4.99M params, {_PAPER}",
    **_TINY,
    mlp_ratio=4.0,
)
register("sret_small", SReT, family="sret", description=f"SReT-S, 20.9M params, {_PAPER}", **_SMALL)
register(
    "sret_base",
    SReT,
    family="sret",
    description="SReT-B, 71.5M params (paper 71.2M), widths 336/672/1344, depth 4/8/2 (2/4/1 unique x 2)",
    **_BASE,
)
register(
    "sret_tiny_unsliced",
    SReT,
    family="sret",
    description="SReT-*T: SReT-T without slicing (groups all 1), 224x224",
    **_TINY,
    mlp_ratio=3.6,
    groups=_UNSLICED,
)
register(
    "sret_tiny_large_unsliced",
    SReT,
    family="sret",
    description="SReT-*TL: SReT-TL without slicing (groups all 1), 224x224",
    **_TINY,
    mlp_ratio=4.0,
    groups=_UNSLICED,
)
# 32x32 inputs (CIFAR): one stride-2 stem conv keeps a 16x16 grid (256 tokens) in stage 1,
# so [8,2][4,1] still leaves 32 and 16 tokens per group.
register(
    "sret_tiny_32",
    SReT,
    family="sret",
    description="SReT-T widths on 32x32 inputs, stem strides 2/1/1 (16x16 tokens), 10 classes",
    **_TINY,
    mlp_ratio=3.6,
    img_size=32,
    num_classes=10,
    stem_strides=(2, 1, 1),
)
_DIGITS: dict[str, Any] = dict(
    img_size=32,
    in_chans=1,
    num_classes=10,
    stem_chs=(16, 32),
    stem_strides=(2, 1, 1),
    embed_dims=(48, 96, 192),
    num_heads=(2, 4, 8),
    unique=(1, 1, 1),
    mlp_ratio=2.0,
    nll_ratio=0.5,
)
register(
    "sret_digits",
    SReT,
    family="sret",
    description="small SReT on 32x32 1-channel digits (16x16 tokens in stage 1), groups [8,2][4,1][1,1]",
    **_DIGITS,
)
register(
    "sret_digits_unsliced",
    SReT,
    family="sret",
    description="sret_digits without slicing (groups all 1)",
    **_DIGITS,
    groups=_UNSLICED,
)
# Real photographs: 28x28 Fashion-MNIST, one stride-2 stem conv -> 14x14 tokens (196, as
# deit_fashion's), then 7x7 and 4x4. Slicing keeps the paper's smallest group, 49 tokens:
# [4,2] in stage 1 (49 and 98 tokens per group); stage 2's 49 tokens are one group, as
# in the paper's last stage. 2/2/1 unique blocks x 2 (depth 10) at head width 32 give
# 295,986 parameters, under deit_fashion's 313,674, and 0.027 GMACs (0.033 unsliced)
# against its 0.088.
_FASHION: dict[str, Any] = dict(
    img_size=28,
    in_chans=1,
    num_classes=10,
    stem_chs=(16, 32),
    stem_strides=(2, 1, 1),
    embed_dims=(32, 64, 128),
    num_heads=(1, 2, 4),
    unique=(2, 2, 1),
    mlp_ratio=2.0,
    nll_ratio=0.5,
)
register(
    "sret_fashion",
    SReT,
    family="sret",
    description="SReT on 28x28 Fashion-MNIST (14x14 tokens in stage 1), groups [4,2][1,1][1,1], "
    "params <= deit_fashion's",
    **_FASHION,
    groups=((4, 2), (1, 1), (1, 1)),
)
register(
    "sret_fashion_unsliced",
    SReT,
    family="sret",
    description="sret_fashion without slicing (groups all 1)",
    **_FASHION,
    groups=_UNSLICED,
)
register(
    "sret_test",
    SReT,
    family="sret",
    tiny=True,
    description="tiny SReT for tests (16x16 inputs, 8x8 tokens in stage 1, dims 16/32/64)",
    img_size=16,
    num_classes=5,
    stem_chs=(8, 8),
    stem_strides=(2, 1, 1),
    embed_dims=(16, 32, 64),
    num_heads=(2, 2, 4),
    unique=(1, 1, 1),
    mlp_ratio=2.0,
    nll_ratio=1.0,
    groups=((8, 2), (4, 1), (1, 1)),
)

__all__ = ["PERMUTATIONS", "ConvStem", "SReT", "conv_out"]
