"""DRRT and DRT: classifiers for a pair of inputs from two modalities.

Pipeline (Belanger Nzakimuena, 2022, after Song et al.'s Deep Relation Transformer):

1. feature extraction per modality (:mod:`leanformer.layers.pair_embed`):
   ``A [B, N, D]``, ``B [B, M, D]``;
2. DRRT only: local recurrence along each token sequence (eqs. 1-2) -> ``A'``, ``B'``
   (DRT: ``A' = A``, ``B' = B``);
3. global relation maps (eqs. 3-5) and guided regional maps for ``K`` region pairs
   (eqs. 6-9), ``[B, N, M]`` / ``[B, K, N, M]``;
4. DRRT only: local recurrence over each relation map (section 3);
5. interaction transformer (eqs. 10-15) -> ``Z_ab [B, N, D]``, ``Z_ba [B, M, D]``;
6. head: mean-pool each side (after a LayerNorm), average the two, three-layer MLP.

Inputs: ``forward(a, b, region_a=None, region_b=None)``. Region labels are fixed by
the data layout in the usual case, so the model holds them as buffers (default: the
token grids of both sides cut into ``region_grid`` blocks, quadrants for ``(2, 2)``,
which puts corresponding areas of the two inputs in the same region). Per-example
labels can be passed instead: per token ``[B, T]``/``[T]``, or for an image side a
pixel map ``[B, H, W]``/``[H, W]`` (a patch takes its majority label).

DRRT's map recurrence reads whole rows/columns of the relation maps, so a DRRT is
built for one pair of token counts; DRT accepts other image sizes (with explicit
region labels, as the default ones are made for the built size).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from timm.layers import trunc_normal_
from torch import Tensor, nn

from leanformer.layers.checks import check_positive, check_positive_number, check_rates
from leanformer.layers.classifier import classifier
from leanformer.layers.interaction import FUSIONS, InteractionTransformer, RelationMapRecurrence
from leanformer.layers.local_recurrence import LocalRecurrence
from leanformer.layers.pair_embed import ImagePatchTokens, PointTokens, grid_regions
from leanformer.layers.patch_embed import to_2tuple
from leanformer.layers.relation import RELATION_FORMS, GlobalRelation, RegionalRelation, check_region_labels
from leanformer.models.registry import register

Extractor = ImagePatchTokens | PointTokens  # what turns one side's input into tokens

Modality = Literal["image", "points"]
Inputs = Literal["both", "a", "b"]
Relations = Literal["both", "global", "regional"]


class DRRT(nn.Module):
    """Deep (recurrent) relation transformer; ``recurrence=False`` is the plain DRT.

    Args (all keyword-only):
        num_classes: classifier outputs.
        modality_a, modality_b: "image" (patch tokens) or "points" (point measurements).
        img_size, patch_size, in_chans: shape of an image modality.
        points_grid, point_features: layout of a points modality (``rows x cols`` locations).
        dim: token width ``D`` of both sides (the shared ``W_t`` and the residuals of
            eqs. 12-15 need one width).
        extractor_depth, num_heads, mlp_ratio: transformer blocks in each extractor.
        recurrence: local recurrence on the features (eqs. 1-2); False gives DRT.
        map_recurrence: recurrence on the relation maps (default: same as ``recurrence``).
        rnn_hidden, rnn_act, rnn_out_act: hidden width of the feature recurrences (default
            ``D``), and activations of all recurrences; a relation-map recurrence's hidden
            width is always the map's row length (the other side's token count).
        relation: pairwise score form, "additive" (default), "linear" (literal, degenerate)
            or "dot"; see :mod:`leanformer.layers.relation`.
        relation_dim: width of the score's projections (default ``D``).
        relations: "both", or "global"/"regional" alone (ablations).
        fusion: "sum", "maxout" or "concat" (eqs. 12-13).
        region_grid: default regions, each token grid cut into ``rows x cols`` blocks.
        region_a, region_b, num_regions: explicit default labels per token instead.
        inputs: "both", or "a"/"b" alone (single-modality baselines: extractor,
            recurrence and head of that side only; the other input is ignored).
        head_hidden: width of the classifier's two hidden layers (default ``D``).
        drop_rate: dropout in the extractors and the classifier.
    """

    NUM_INPUTS = 2  # forward(a, b): one example is a pair

    def __init__(
        self,
        *,
        num_classes: int = 10,
        modality_a: Modality = "image",
        modality_b: Modality = "points",
        img_size: int | tuple[int, int] = 32,
        patch_size: int = 4,
        in_chans: int = 1,
        points_grid: int | tuple[int, int] = (4, 4),
        point_features: int = 1,
        dim: int = 64,
        extractor_depth: int = 1,
        num_heads: int = 4,
        mlp_ratio: float = 2.0,
        recurrence: bool = True,
        map_recurrence: bool | None = None,
        rnn_hidden: int | None = None,
        rnn_act: str = "tanh",
        rnn_out_act: str = "identity",
        relation: str = "additive",
        relation_dim: int | None = None,
        relations: Relations = "both",
        fusion: str = "sum",
        region_grid: int | tuple[int, int] = (2, 2),
        region_a: Any = None,
        region_b: Any = None,
        num_regions: int | None = None,
        inputs: Inputs = "both",
        head_hidden: int | None = None,
        drop_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if inputs not in ("both", "a", "b"):
            raise ValueError(f"inputs must be 'both', 'a' or 'b', got {inputs!r}")
        if relations not in ("both", "global", "regional"):
            raise ValueError(f"relations must be 'both', 'global' or 'regional', got {relations!r}")
        if fusion not in FUSIONS:
            raise ValueError(f"unknown fusion {fusion!r}; choose from {', '.join(FUSIONS)}")
        if relation not in RELATION_FORMS:
            raise ValueError(f"unknown relation form {relation!r}; choose from {', '.join(RELATION_FORMS)}")
        if fusion == "concat" and relations != "both":
            raise ValueError("fusion='concat' needs relations='both'")
        # Checked here, not only in the layers: the model reads `x or dim`, which would
        # silently take 0 for "the default", and the layers' errors name their own arguments.
        check_positive(dim=dim)
        check_positive(
            optional=True,
            rnn_hidden=rnn_hidden,
            relation_dim=relation_dim,
            head_hidden=head_hidden,
            num_regions=num_regions,
        )
        check_positive_number(mlp_ratio=mlp_ratio)
        check_rates(drop_rate=drop_rate)
        self.num_classes = num_classes
        self.inputs = inputs
        self.relations = relations
        self.recurrence = recurrence
        self.map_recurrence = recurrence if map_recurrence is None else map_recurrence
        self.embed_dim = self.num_features = dim
        self.img_size = to_2tuple(img_size)
        self.in_chans = in_chans
        extractor_kw: dict[str, Any] = dict(
            dim=dim, depth=extractor_depth, num_heads=num_heads, mlp_ratio=mlp_ratio, drop=drop_rate
        )
        shape_kw: dict[str, Any] = dict(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, points_grid=points_grid,
            point_features=point_features,
        )  # fmt: skip
        rnn_kw = dict(hidden_features=rnn_hidden, hidden_act=rnn_act, out_act=rnn_out_act)

        sides = {"both": ("a", "b"), "a": ("a",), "b": ("b",)}[inputs]
        self.sides = sides
        self.modalities = {"a": modality_a, "b": modality_b}
        self.extractors = nn.ModuleDict(
            {s: _build_extractor(self.modalities[s], **shape_kw, **extractor_kw) for s in sides}
        )
        self.feature_rnns = nn.ModuleDict(
            {s: LocalRecurrence(dim, **rnn_kw) for s in sides} if recurrence else {}  # type: ignore[arg-type]
        )

        self.global_relation: GlobalRelation | None = None
        self.regional_relation: RegionalRelation | None = None
        self.map_rnns = nn.ModuleDict()
        self.interaction: InteractionTransformer | None = None
        if inputs == "both":
            ext_a, ext_b = self._extractor("a"), self._extractor("b")
            n, m = ext_a.num_tokens, ext_b.num_tokens
            rel_kw: dict[str, Any] = dict(relation_dim=relation_dim or dim, form=relation)
            kinds = {"both": ("global", "regional"), "global": ("global",), "regional": ("regional",)}[
                relations
            ]
            if "global" in kinds:
                self.global_relation = GlobalRelation(dim, dim, **rel_kw)
            if "regional" in kinds:
                ra, rb, k = _default_regions(ext_a, ext_b, region_a, region_b, num_regions, region_grid)
                self.regional_relation = RegionalRelation(dim, dim, num_regions=k, **rel_kw)
                self.register_buffer("region_a", ra, persistent=False)
                self.register_buffer("region_b", rb, persistent=False)
            elif region_a is not None or region_b is not None:
                raise ValueError(
                    "region_a/region_b need the regional relation (relations='both' or 'regional')"
                )
            if self.map_recurrence:
                map_kw = dict(hidden_act=rnn_act, out_act=rnn_out_act)
                for kind in kinds:
                    # Separate recurrences for global and regional maps: their scales differ
                    # (rows sum to 1 vs. 1 / C_r); each is shared by the K regions.
                    self.map_rnns[f"{kind}_alpha"] = RelationMapRecurrence(n, m, axis="rows", **map_kw)  # type: ignore[arg-type]
                    self.map_rnns[f"{kind}_beta"] = RelationMapRecurrence(n, m, axis="cols", **map_kw)  # type: ignore[arg-type]
            self.interaction = InteractionTransformer(dim, fusion=fusion)
        elif region_a is not None or region_b is not None:
            raise ValueError("region labels need both inputs (inputs='both')")

        self.norms = nn.ModuleDict({s: nn.LayerNorm(dim) for s in sides})
        self.head_hidden = head_hidden or dim
        self.drop_rate = drop_rate
        self.head = _classifier(dim, self.head_hidden, num_classes, drop_rate)
        self._init_weights()

    def _init_weights(self) -> None:
        for name, m in self.named_modules():
            # Transformer-style init for token-wise layers. Recurrent layers keep PyTorch's RNN
            # init, and the classifier keeps PyTorch's fan-in init: three layers at std 0.02
            # would shrink the signal ~200x and stall the start of training.
            if isinstance(m, nn.Linear) and "rnn" not in name and not name.startswith("head"):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    # -- the interface every model has --------------------------------------------------

    def forward_features(
        self,
        a: Tensor | None,
        b: Tensor | None = None,
        region_a: Tensor | None = None,
        region_b: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        """Inputs -> per-side tokens ``(Z_ab [B, N, D], Z_ba [B, M, D])`` (one side: ``(A' [B, T, D],)``)."""
        raw = {"a": a, "b": b}
        tokens: dict[str, Tensor] = {}
        for s in self.sides:
            x = raw[s]
            if x is None:
                raise ValueError(f"this model needs input {s!r} ({self.modalities[s]})")
            t = self.extractors[s](x)
            tokens[s] = self.feature_rnns[s](t) if self.recurrence else t
        if self.inputs != "both":
            if region_a is not None or region_b is not None:
                raise ValueError("region labels need a two-input model")
            return (tokens[self.sides[0]],)
        return self._relate(tokens["a"], tokens["b"], region_a, region_b)

    def forward_head(self, features: tuple[Tensor, ...], pre_logits: bool = False) -> Tensor:
        """Per-side tokens -> logits ``[B, classes]``: pool each side, average, three-layer MLP."""
        # Pool, then normalise (timm's fc_norm for average pooling): the normalisation
        # brings the small differences between examples' token means to a usable scale.
        pooled = torch.stack([norm(z.mean(1)) for norm, z in zip(self.norms.values(), features, strict=True)])
        x = pooled.mean(0)  # average fusion of the two sides: [B, D]
        return x if pre_logits else self.head(x)

    def forward(
        self,
        a: Tensor | None,
        b: Tensor | None = None,
        region_a: Tensor | None = None,
        region_b: Tensor | None = None,
    ) -> Tensor:
        return self.forward_head(self.forward_features(a, b, region_a, region_b))

    def reset_classifier(self, num_classes: int) -> None:
        """New output layer for ``num_classes`` (the two hidden layers are kept)."""
        self.head[-1] = classifier(self.head_hidden, num_classes)  # raises before the model changes
        self.num_classes = num_classes

    def example_inputs(
        self, batch_size: int, *, img_size: int | None = None, feature_size: Any = None
    ) -> tuple[Tensor, ...]:
        """Random inputs ``(a, b)`` of the built shapes (``img_size`` resizes an image side)."""
        if feature_size is not None:
            raise ValueError(
                "DRRT inputs are an image and/or point measurements; feature_size does not apply"
            )
        device = next(self.parameters()).device
        out: list[Tensor | None] = []
        for s in ("a", "b"):
            if s not in self.sides:
                out.append(None)
                continue
            ext = self._extractor(s)
            if isinstance(ext, ImagePatchTokens):
                size = to_2tuple(img_size) if img_size is not None else ext.img_size
                out.append(torch.randn(batch_size, ext.in_chans, *size, device=device))
            else:
                out.append(torch.randn(batch_size, ext.num_tokens, ext.point_features, device=device))
        if out[1] is None:
            return (out[0],)  # type: ignore[return-value]
        # An "b"-only model still takes (a, b): a placeholder goes in front.
        return tuple(torch.zeros(batch_size, 0, device=device) if t is None else t for t in out)

    # -- internals ------------------------------------------------------------------------

    def _extractor(self, side: str) -> Extractor:
        extractor = self.extractors[side]
        assert isinstance(extractor, ImagePatchTokens | PointTokens)
        return extractor

    def _relate(
        self, a: Tensor, b: Tensor, region_a: Tensor | None, region_b: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """``A' [B, N, D], B' [B, M, D] -> (Z_ab, Z_ba)`` through the relation modules."""
        assert self.interaction is not None
        alpha_g = beta_g = alpha_r = beta_r = None
        if self.global_relation is not None:
            alpha_g, beta_g = self.global_relation(a, b)
            if self.map_recurrence:
                alpha_g = self.map_rnns["global_alpha"](alpha_g)
                beta_g = self.map_rnns["global_beta"](beta_g)
        if self.regional_relation is not None:
            ra, rb, explicit = self._region_labels(a, b, region_a, region_b)
            if self.map_recurrence:
                alpha_r, beta_r, mask = self.regional_relation(a, b, ra, rb, check_values=explicit)
                alpha_r = self.map_rnns["regional_alpha"](alpha_r, mask)
                beta_r = self.map_rnns["regional_beta"](beta_r, mask)
            else:
                alpha_r, beta_r = self.regional_relation.summed(a, b, ra, rb, check_values=explicit)
        elif region_a is not None or region_b is not None:
            raise ValueError("region labels were given but this model has no regional relation")
        return self.interaction(a, b, alpha_g, beta_g, alpha_r, beta_r)

    def _region_labels(
        self, a: Tensor, b: Tensor, region_a: Tensor | None, region_b: Tensor | None
    ) -> tuple[Tensor, Tensor, bool]:
        """Token labels for both sides, and whether they came from the caller (so need a range check)."""
        assert self.regional_relation is not None
        k = self.regional_relation.num_regions
        if (region_a is None) != (region_b is None):
            raise ValueError("pass both region_a and region_b, or neither (to use the model's own)")
        if region_a is not None and region_b is not None:
            ra = self._extractor("a").token_regions(region_a, k)
            rb = self._extractor("b").token_regions(region_b, k)
            return ra, rb, True
        ra, rb = self.get_buffer("region_a"), self.get_buffer("region_b")
        if ra.shape[-1] != a.shape[1] or rb.shape[-1] != b.shape[1]:
            raise ValueError(
                f"the model's region labels are for {ra.shape[-1]} x {rb.shape[-1]} tokens, the inputs gave "
                f"{a.shape[1]} x {b.shape[1]}: pass region_a/region_b for inputs of another size"
            )
        return ra, rb, False


def _build_extractor(
    modality: str,
    *,
    img_size: int | tuple[int, int],
    patch_size: int,
    in_chans: int,
    points_grid: int | tuple[int, int],
    point_features: int,
    **kw: Any,
) -> Extractor:
    if modality == "image":
        return ImagePatchTokens(img_size=img_size, patch_size=patch_size, in_chans=in_chans, **kw)
    if modality == "points":
        return PointTokens(grid=points_grid, point_features=point_features, **kw)
    raise ValueError(f"unknown modality {modality!r}; choose 'image' or 'points'")


def _default_regions(
    ext_a: Extractor,
    ext_b: Extractor,
    region_a: Any,
    region_b: Any,
    num_regions: int | None,
    region_grid: int | tuple[int, int],
) -> tuple[Tensor, Tensor, int]:
    """Default token labels for both sides and ``K``: explicit ones, or the grids cut into blocks."""
    if (region_a is None) != (region_b is None):
        raise ValueError(
            "give both region_a and region_b, or neither (to cut the token grids by region_grid)"
        )
    if region_a is None:
        rg = to_2tuple(region_grid, name="region_grid")
        k = rg[0] * rg[1]
        if num_regions is not None and num_regions != k:
            raise ValueError(f"num_regions={num_regions} does not match region_grid {rg} ({k} regions)")
        return grid_regions(ext_a.grid, rg), grid_regions(ext_b.grid, rg), k
    ra, rb = torch.as_tensor(region_a), torch.as_tensor(region_b)
    k = num_regions if num_regions is not None else int(max(ra.max(), rb.max())) + 1
    ra = check_region_labels(ext_a.token_regions(ra, k), ext_a.num_tokens, k, "region_a")[0]
    rb = check_region_labels(ext_b.token_regions(rb, k), ext_b.num_tokens, k, "region_b")[0]
    return ra, rb, k


def _classifier(dim: int, hidden: int, num_classes: int, drop: float) -> nn.Sequential:
    """The three-layer fully connected classifier: ``[B, D] -> [B, classes]``."""
    return nn.Sequential(
        nn.Linear(dim, hidden),
        nn.GELU(),
        nn.Dropout(drop),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Dropout(drop),
        classifier(hidden, num_classes),
    )


# Defaults are sized for the bundled digits_pairs task (32x32 image + 4x4 point grid).
_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "drrt": ("DRRT: image patches + point grid, global + regional relations, sum fusion", {}),
    "drt": ("DRT: DRRT without local recurrence", {"recurrence": False}),
    "drrt_maxout": ("DRRT with maxout fusion", {"fusion": "maxout"}),
    "drrt_concat": ("DRRT with concat fusion", {"fusion": "concat"}),
    "drt_maxout": ("DRT with maxout fusion", {"fusion": "maxout", "recurrence": False}),
    "drt_concat": ("DRT with concat fusion", {"fusion": "concat", "recurrence": False}),
    "drrt_image_only": ("single-modality baseline: image side of DRRT", {"inputs": "a"}),
    "drrt_points_only": ("single-modality baseline: point side of DRRT", {"inputs": "b"}),
    "drrt_global_only": ("DRRT ablation: global relation only", {"relations": "global"}),
    "drrt_regional_only": ("DRRT ablation: guided regional relation only", {"relations": "regional"}),
}
for _name, (_desc, _opts) in _VARIANTS.items():
    register(_name, DRRT, family="drrt", description=_desc, **_opts)

# fashion_pairs (28x28 photograph + 7x7 point grid): patch 4 gives a 7x7 token grid, so
# image token (i, j) and point (i, j) cover the same 4x4 pixels and the default quadrant
# regions of both sides coincide. Two extractor blocks per side (the garments need more
# than digits' one). DRT is the same model without recurrence, trained the same way.
# GMACs (0.015 and 0.010 per pair) understate the cost: the additive relation's tanh over
# [B, N, M, D] is not counted (nor is the map recurrence's sequential run), and here
# N x M is 49 x 49 against digits' 64 x 16, 2.3 times as many pairs.
_FASHION: dict[str, Any] = dict(
    img_size=28, patch_size=4, in_chans=1, points_grid=(7, 7), dim=64, extractor_depth=2, num_heads=4,
    num_classes=10,
)  # fmt: skip
register(
    "drrt_fashion",
    DRRT,
    family="drrt",
    description="DRRT on fashion_pairs: 28x28 image (patch 4, 7x7 tokens) + 7x7 point grid, dim 64",
    **_FASHION,
)
register(
    "drt_fashion",
    DRRT,
    family="drrt",
    description="DRT on fashion_pairs: drrt_fashion without local recurrence",
    **_FASHION,
    recurrence=False,
)

# Regions of 2+ tokens on each side, or a softmax over one entry gives the score no gradient.
_TINY: dict[str, Any] = dict(
    img_size=8, patch_size=4, points_grid=(2, 3), region_grid=(1, 2), dim=16, extractor_depth=1, num_heads=2,
    num_classes=3,
)  # fmt: skip
_TINY_VARIANTS: dict[str, dict[str, Any]] = {
    "drrt_test": {},
    "drt_test": {"recurrence": False},
    "drrt_test_concat": {"fusion": "concat", "rnn_act": "identity"},
}
for _name, _tiny_opts in _TINY_VARIANTS.items():
    register(
        _name, DRRT, family="drrt", tiny=True, description=f"tiny {_name} for tests", **_TINY, **_tiny_opts
    )
