"""DETR encoder self-attention, dense and with ENACT's entropy-clustered keys and values.

Both modules take ``x [B, HW, C]`` (the encoder input), ``pos [B, HW, C]`` (positional
embeddings), the spatial shape ``(H, W)`` and a key padding mask ``[B, HW]`` (True =
padding, as DETR and ``nn.MultiheadAttention``). As in DETR the queries and keys are
``x + pos`` and the values ``x``. Parameters are named like ``nn.MultiheadAttention``
(``in_proj_weight``, ``in_proj_bias``, ``out_proj``), so a DETR checkpoint's
``self_attn.*`` tensors load into either module (ENACT adds ``entropy_proj``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leanformer.layers.checks import check_rates, head_dim
from leanformer.ops.entropy_map import (
    check_sigma,
    curvature_signs,
    entropy_from_logits,
    is_top_left_rectangle,
    valid_extent,
)
from leanformer.ops.region_cluster import region_cluster
from leanformer.ops.regions import RegionPlan, plan_from_starts, region_starts, singleton_plan

REGION_MODES = ("curvature", "single")
# How the attention probabilities are held: inside the fused kernel, or as a tensor.
ATTENTION_MATRICES = ("fused", "explicit")


def check_attention_matrix(value: str, *, name: str = "matrix") -> str:
    """``value`` when it is one of :data:`ATTENTION_MATRICES`, else a ValueError naming ``name``."""
    if value not in ATTENTION_MATRICES:
        raise ValueError(f"{name} must be one of {', '.join(ATTENTION_MATRICES)}, got {value!r}")
    return value


def _is_side(side: Any) -> bool:
    """An integer >= 1: a Python or NumPy integer, an integer 0-d tensor, or a SymInt (the
    side of a feature map traced with dynamic shapes); not a bool or a float."""
    if isinstance(side, bool):
        return False
    if not isinstance(side, int | torch.SymInt):
        try:
            side = operator.index(side)
        except TypeError:
            return False
    return bool(side >= 1)


def check_inputs(
    x: Tensor,
    pos: Tensor | None,
    spatial_shape: tuple[int, int],
    key_padding_mask: Tensor | None,
    d_model: int,
) -> None:
    """Raise ``ValueError`` for inputs that do not fit together."""
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"x must be [B, HW, {d_model}], got {tuple(x.shape)}")
    shape_ok = isinstance(spatial_shape, tuple | list) and len(spatial_shape) == 2
    if not shape_ok or not all(_is_side(s) for s in spatial_shape):
        raise ValueError(f"spatial_shape must be two integers (H, W) >= 1, got {spatial_shape!r}")
    H, W = spatial_shape
    if x.shape[1] != H * W:
        raise ValueError(
            f"spatial shape {H}x{W} = {H * W} positions does not match x with {x.shape[1]} tokens"
        )
    if pos is not None and pos.shape != x.shape:
        raise ValueError(f"pos {tuple(pos.shape)} must have the shape of x {tuple(x.shape)}")
    if key_padding_mask is not None:
        if key_padding_mask.shape != x.shape[:2]:
            raise ValueError(
                f"key_padding_mask {tuple(key_padding_mask.shape)} must be [B, HW] = {tuple(x.shape[:2])}"
            )
        if key_padding_mask.dtype != torch.bool:
            raise ValueError(f"key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}")


class DenseSelfAttention(nn.Module):
    """Plain multi-head self-attention of a DETR encoder layer.

    ``forward(x [B, N, C], pos [B, N, C] | None, spatial_shape, key_padding_mask [B, N] | None)``
    returns ``[B, N, C]``.

    ``matrix="fused"`` (default) runs the fused SDPA kernel; ``"explicit"`` forms the
    ``[B, h, N, L]`` probabilities as tensors of their own, as DETR's public code and the
    ENACT paper's memory baseline do, so a training step keeps them for the backward
    (what the paper's memory saving is measured against). The two give the same result.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dropout: float = 0.0,
        bias: bool = True,
        matrix: str = "fused",
    ) -> None:
        super().__init__()
        self.head_dim = head_dim(d_model, num_heads, dim_name="d_model")
        check_rates(dropout=dropout)
        self.d_model = d_model
        self.num_heads = num_heads
        self.dropout = dropout
        self.matrix = check_attention_matrix(matrix)
        self._init_projections(d_model, bias)

    def _init_projections(self, d_model: int, bias: bool) -> None:
        """Create the packed q/k/v projection and the output projection.

        A subclass that runs on another model's own projection modules overrides this,
        :meth:`_proj` and :meth:`_out` (see ``leanformer.patch.transformers``).
        """
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d_model, d_model))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d_model)) if bias else None
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        nn.init.xavier_uniform_(self.in_proj_weight)
        if bias:
            nn.init.zeros_(self.out_proj.bias)

    def _proj(self, x: Tensor, which: int) -> Tensor:
        """Apply the q (0), k (1) or v (2) slice of the packed input projection to ``x [..., C]``."""
        C = self.d_model
        b = self.in_proj_bias[which * C : (which + 1) * C] if self.in_proj_bias is not None else None
        return F.linear(x, self.in_proj_weight[which * C : (which + 1) * C], b)

    def _out(self, x: Tensor) -> Tensor:
        """Output projection of the merged heads ``[B, N, C]``."""
        return self.out_proj(x)

    def _heads(self, t: Tensor) -> Tensor:
        """``[B, N, C] -> [B, h, N, C/h]``."""
        B, N, _ = t.shape
        return t.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None) -> Tensor:
        """``q [B, h, N, d]`` over ``k, v [B, h, L, d]``, ``key_mask [B, L]`` (True = attend) -> out."""
        mask = key_mask[:, None, None, :] if key_mask is not None else None
        drop = self.dropout if self.training else 0.0
        if self.matrix == "explicit":
            scores = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            out = F.dropout(scores.softmax(dim=-1), p=drop) @ v
        else:
            # scaled by 1/sqrt(d_head) before the softmax, inside the fused kernel
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)
        B, _, N, _ = out.shape
        return self._out(out.transpose(1, 2).reshape(B, N, self.d_model))

    def forward(
        self,
        x: Tensor,
        pos: Tensor | None = None,
        spatial_shape: tuple[int, int] | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        spatial_shape = spatial_shape if spatial_shape is not None else (1, x.shape[1])
        check_inputs(x, pos, spatial_shape, key_padding_mask, self.d_model)
        qk_in = x + pos if pos is not None else x
        q = self._heads(self._proj(qk_in, 0))
        k = self._heads(self._proj(qk_in, 1))
        v = self._heads(self._proj(x, 2))
        return self._attend(q, k, v, ~key_padding_mask if key_padding_mask is not None else None)


class EntropyClusteredAttention(DenseSelfAttention):
    """ENACT: attention over keys/values clustered into regions of equal entropy-curvature sign.

    Per feature map: ``entropy_proj(x + pos)`` gives one logit per position; its softmax
    over the valid positions gives ``-p log2 p`` (:func:`entropy_from_logits`), whose
    (``sigma``-smoothed) row curvature sign splits the map into row-major runs
    (:mod:`leanformer.ops.regions`). Keys and values become entropy-softmax-weighted means
    of their region (:func:`region_cluster`); every query of map ``b`` (queries are never
    clustered) attends to the clusters of map ``b`` only, through fused SDPA (or the
    explicit matrix: ``matrix=``) with the clusters padded to the largest count and masked.

    ``regions="single"`` makes every valid position its own region: the clustering is then
    the identity and the module computes dense attention through the whole ENACT path
    (entropy, plan, reduction, masked SDPA), which is how a patched host is checked
    against its unpatched self. The default ``"curvature"`` is ENACT.

    ``cluster_inputs=True`` clusters ``x + pos`` and ``x`` *before* the key/value
    projections (exact, since the weights of a region sum to 1, and the projections then
    run on ``L`` instead of ``HW`` rows); ``False`` projects first, as a check.

    After each call ``last_cluster_counts [B]`` and ``last_valid_counts [B]`` (detached)
    hold the number of clusters and of valid positions per map.
    """

    # Why ``torch.compile(fullgraph=True)`` cannot hold this layer: read by
    # :func:`leanformer.bench.compiled.compile_model` to refuse by name, not with dynamo's error.
    graph_break: ClassVar[str] = (
        "ENACT reads its largest region count on the host, which sizes its clustered keys and values"
    )

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dropout: float = 0.0,
        sigma: float = 3.0,
        bias: bool = True,
        cluster_inputs: bool = True,
        regions: str = "curvature",
        matrix: str = "fused",
    ) -> None:
        if regions not in REGION_MODES:
            raise ValueError(f"regions must be one of {', '.join(REGION_MODES)}, got {regions!r}")
        super().__init__(d_model, num_heads, dropout=dropout, bias=bias, matrix=matrix)
        self.sigma = check_sigma(sigma)
        self.regions = regions
        if not isinstance(cluster_inputs, bool):
            raise ValueError(f"cluster_inputs must be True or False, got {cluster_inputs!r}")
        self.cluster_inputs = cluster_inputs
        # No bias: the softmax over positions cancels any constant added to every logit.
        self.entropy_proj = nn.Linear(d_model, 1, bias=False)
        self.last_cluster_counts: Tensor | None = None
        self.last_valid_counts: Tensor | None = None

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # Checkpoints from before the projection lost its bias hold one; it never changed
        # the output, so it is dropped rather than refused.
        state_dict.pop(prefix + "entropy_proj.bias", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def entropy(self, k_in: Tensor, valid: Tensor | None) -> Tensor:
        """Keys ``[B, N, C]`` -> entropy terms ``[B, N]`` (differentiable)."""
        return entropy_from_logits(self.entropy_proj(k_in).squeeze(-1), valid)

    def plan(self, entropy: Tensor, spatial_shape: tuple[int, int], valid: Tensor | None) -> RegionPlan:
        """Entropy ``[B, N]`` -> regions of equal curvature sign (no gradients; one host sync)."""
        B, N = entropy.shape
        if self.regions == "single":
            return singleton_plan(valid if valid is not None else torch.ones_like(entropy, dtype=torch.bool))
        H, W = spatial_shape
        valid2d = valid.view(B, H, W) if valid is not None else None
        signs = curvature_signs(entropy.view(B, H, W), sigma=self.sigma, valid=valid2d).view(B, N)
        starts = region_starts(signs, valid)
        counts = starts.sum(dim=1)
        ok = torch.ones((), dtype=torch.bool, device=entropy.device)
        if valid2d is not None:
            hv, wv = valid_extent(valid2d)
            ok = is_top_left_rectangle(valid2d, hv, wv)
        # One host sync for the output size, the mask check and whether any map is short.
        ok_host, max_count, min_count = torch.stack([ok.long(), counts.max(), counts.min()]).tolist()
        if not ok_host:
            raise ValueError(
                "key_padding_mask: every map needs a non-empty top-left rectangle of valid positions "
                "(DETR pads images at the bottom and right)"
            )
        return plan_from_starts(starts, valid, num_slots=max_count, uniform=min_count == max_count)

    def forward(
        self,
        x: Tensor,
        pos: Tensor | None = None,
        spatial_shape: tuple[int, int] | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        if spatial_shape is None:
            raise ValueError("EntropyClusteredAttention needs spatial_shape=(H, W) of the feature map")
        check_inputs(x, pos, spatial_shape, key_padding_mask, self.d_model)
        if x.shape[0] == 0:
            # No maps to cluster (and no counts to take a maximum of): as empty an output as
            # dense attention gives, still connected to x for autograd.
            self.last_cluster_counts = x.new_zeros(0, dtype=torch.long)
            self.last_valid_counts = x.new_zeros(0, dtype=torch.long)
            return x * 0.0
        valid = ~key_padding_mask if key_padding_mask is not None else None
        qk_in = x + pos if pos is not None else x
        entropy = self.entropy(qk_in, valid)
        plan = self.plan(entropy, spatial_shape, valid)
        if self.cluster_inputs:
            k_in, v_in = region_cluster(entropy, plan, qk_in, x)
            k, v = self._proj(k_in, 1), self._proj(v_in, 2)
        else:
            k, v = region_cluster(entropy, plan, self._proj(qk_in, 1), self._proj(x, 2))
        q = self._proj(qk_in, 0)
        self.last_cluster_counts = plan.counts.detach()
        self.last_valid_counts = (
            valid.sum(dim=1) if valid is not None else torch.full_like(plan.counts, x.shape[1])
        ).detach()
        # Maps with fewer clusters than L get masked empty slots; no mask when none is short.
        key_mask = None if plan.uniform else plan.key_mask
        return self._attend(self._heads(q), self._heads(k), self._heads(v), key_mask)

    def extra_repr(self) -> str:
        extra = f", regions={self.regions!r}" if self.regions != "curvature" else ""
        return f"d_model={self.d_model}, num_heads={self.num_heads}, sigma={self.sigma}{extra}"


def layer_cluster_ratios(modules: Iterable[nn.Module]) -> list[float]:
    """For each :class:`EntropyClusteredAttention` in ``modules`` that has run (others are
    skipped), the mean over maps of clusters / valid positions in its last call."""
    out = []
    for attn in modules:
        if isinstance(attn, EntropyClusteredAttention) and attn.last_cluster_counts is not None:
            assert attn.last_valid_counts is not None
            ratio = attn.last_cluster_counts.double() / attn.last_valid_counts.double()
            out.append(float(ratio.mean()))
    return out
