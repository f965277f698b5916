"""Token reducers for every Token Pooling method, and the method registry.

A reducer implements :class:`leanformer.layers.reducer.TokenReducer`: it maps the
non-prefix tokens ``[B, N, C]`` (with their sizes ``[B, N]`` and attention received
``[B, N]``) to at most ``K`` tokens. The block strips the class/distillation/register
tokens first, so they are never pooled.

Methods (``method=`` of :func:`build_reducers`, ``pool=`` of the DeiT models):

==============  ===========================================================================
``kmeans``      K-Means, output = cluster means (paper eqs. 10-11)
``kmedoids``    K-Medoids on distances computed once, output = cluster means (eq. 12)
``wkmeans``     weighted K-Means, weights = significance scores (eqs. 14-15)
``wkmedoids``   weighted K-Medoids (eqs. 16-18), the paper's best method
``powerbert``   keep the top-K tokens by significance score (PoWER-BERT)
``random``      keep K tokens drawn uniformly without replacement
``importance``  draw K tokens without replacement, probability proportional to the score
``conv``        learned 2x2 stride-2 convolution on the token grid (appendix D)
``tome``        ToMe exactly as published: bipartite soft matching on the attention keys,
                class/prefix tokens protected, ``r`` per block (:mod:`leanformer.layers.tome`)
``merge``       ToMe-like bipartite soft matching on the block's output tokens, down to a
                count or ratio (size-weighted merges)
``stepmerge``   bipartite merging in rounds of at most a quarter of the tokens
``inputmerge``  ``merge`` at each block's input, before its attention (the first block's too)
``entrymerge``  ``merge``, and one more merge of the embedded patches before the first block
                when the budget is tight (``leanformer.layers.reducer.entry_count``)
``none``        no reduction
==============  ===========================================================================

Carry (appendix E): with ``carry=True`` (or whenever sizes come in) every output token
has a size, the sum of the sizes of the input tokens it stands for (selected tokens keep
their own size); attention in later blocks adds ``log(size)`` to that key's logits.
Sizes of None stand for all ones: a selection keeps them None (every kept token still
has size 1), so later blocks skip a bias that would add 0 to every logit.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leanformer.layers.budgets import Budget, KeepLike, budget_to_count, parse_keep
from leanformer.layers.checks import as_int
from leanformer.layers.reducer import OFF_GRID, REDUCE_POSITION_WORDS, Grid, ReducePosition, halved_grid
from leanformer.layers.tome import build_tome
from leanformer.ops.cluster_init import InitMode, init_centers
from leanformer.ops.cluster_plan import cluster_mean, cluster_sizes, weighted_segment_mean
from leanformer.ops.kmeans import kmeans_plan
from leanformer.ops.kmedoids import kmedoids_pooled
from leanformer.ops.merging import bipartite_merge_plan, round_ratio
from leanformer.ops.token_selection import gather_tokens, importance_indices, random_indices, topk_indices


class _Reducer(nn.Module):
    """Shared budget / carry / recording logic. Subclasses implement :meth:`_reduce`.

    ``record = True`` keeps ``last_assign [B, N]``: for every input token, the output
    token it went into (-1 when dropped), for visualisation.
    """

    needs_received: bool = False
    # Whether the reducer reads the patch tokens' grid (``grid=``, when the host knows it).
    reads_grid: bool = False
    # Whether every output token is one input token (a selection): all-ones sizes in, all
    # ones out, so implicit sizes (None) can stay implicit.
    keeps_input_tokens: bool = False

    def __init__(self, *, keep: Budget, carry: bool = False) -> None:
        super().__init__()
        self.keep = keep
        self.carry = carry
        self.record = False
        self.last_assign: Tensor | None = None

    @property
    def keep(self) -> Budget:
        """This block's budget: a token count (int) or a keep ratio (float)."""
        return self._budget

    @keep.setter
    def keep(self, value: Budget) -> None:
        self._budget = value
        # torch.compile(dynamic=True) reads a float attribute as a symbolic float, and a
        # count derived from one cannot enter the clusterings' torch.cond loops; a string
        # is a constant it guards on, so the ratio is read back from its text.
        self._ratio_text = repr(value) if isinstance(value, float) else None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Reducers pickled when the budget was a plain attribute.
        budget = state.pop("keep", None)
        super().__setstate__(state)
        if budget is not None:
            self.keep = budget

    def forward(
        self,
        tokens: Tensor,
        sizes: Tensor | None,
        received: Tensor | None,
        count: int | None = None,
        grid: Grid | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``count``: tokens to keep in place of the budget's (the ``entry`` step's own).
        ``grid``: the ``rows x cols`` raster the tokens lie on, when the host knows it."""
        B, N, _ = tokens.shape
        track = self.carry or sizes is not None
        if track and sizes is None and not self.keeps_input_tokens:
            sizes = tokens.new_ones(B, N)
        if self.needs_received and received is None:
            raise ValueError(f"{type(self).__name__} needs the attention received (significance scores)")
        k = self.output_count(N, grid) if count is None else min(count, N)
        if k >= N:
            if self.record:
                self.last_assign = torch.arange(N, device=tokens.device).expand(B, N)
            return tokens, sizes
        if k == 0:
            # Budget 0: only the prefix (class) tokens remain.
            if self.record:
                self.last_assign = torch.full((B, N), -1, dtype=torch.long, device=tokens.device)
            return tokens[:, :0], (sizes[:, :0] if sizes is not None else None)
        out, out_sizes, assign = self._reduce(tokens, sizes, received, k, grid)
        if self.record:
            self.last_assign = assign
        return out, (out_sizes if track else None)

    def output_count(self, n: int, grid: Grid | None = None) -> int:
        """Tokens this reducer outputs when it receives ``n`` (on ``grid``, when known):
        ``min(K, n)`` (or the ratio of ``n``)."""
        ratio_text = self._ratio_text
        return budget_to_count(self.keep if ratio_text is None else float(ratio_text), n)

    def _reduce(
        self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None, k: int, grid: Grid | None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"keep={self.keep}, carry={self.carry}"


class _Seeded:
    """Seeded randomness: a persistent stream while training, the same draw on every call in eval.

    Eval draws counter-based noise from the seed (:mod:`leanformer.ops.hashed_noise`), so
    inference is deterministic (the same input always gives the same output) and compiles
    (no generator is created in the forward); training advances one generator per device.
    """

    seed: int
    training: bool
    _generators: dict[str, torch.Generator]

    def _randomness(self, device: torch.device) -> dict[str, Any]:
        """Keyword arguments for the ops' draws: ``seed=`` in eval, ``generator=`` in training."""
        if not self.training:
            return {"seed": self.seed}
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return {"generator": self._generators[key]}


class ClusterPooling(_Seeded, _Reducer):
    """Token Pooling by (weighted) K-Means or K-Medoids (Algorithm 1).

    Weights: the significance scores (attention received) for the weighted variants;
    for the unweighted ones the token sizes when they are tracked (a token of size s
    counts as s identical tokens), else ones. Initial centres: top-K by significance
    score (``init="topk"``, the paper's default) or uniformly random (``"random"``).
    Output: the weighted mean of every cluster, so the gradient reaches every token.
    """

    def __init__(
        self,
        *,
        keep: Budget,
        algorithm: str = "kmedoids",
        weighted: bool = True,
        carry: bool = False,
        max_iters: int = 5,
        init: InitMode = "topk",
        seed: int = 0,
    ) -> None:
        super().__init__(keep=keep, carry=carry)
        if algorithm not in ("kmeans", "kmedoids"):
            raise ValueError(f"algorithm must be 'kmeans' or 'kmedoids', got {algorithm!r}")
        if init not in ("topk", "random"):
            raise ValueError(f"init must be 'topk' or 'random', got {init!r}")
        if isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 0:
            raise ValueError(f"max_iters must be an int >= 0, got {max_iters!r}")
        self.algorithm = algorithm
        self.weighted = weighted
        self.max_iters = max_iters
        self.init = init
        self.seed = seed
        self._generators = {}
        # Scores are needed for the weights, or to pick the initial centres.
        self.needs_received = weighted or init == "topk"

    def _reduce(
        self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None, k: int, grid: Grid | None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        B, N, _ = tokens.shape
        weights = received if self.weighted else sizes
        start = None
        if not (self.weighted and self.init == "topk"):
            # Weighted top-K starts are the plans' own default (the top K by weight): left to
            # them, they are not checked again (a check that reads values back on the host).
            start = init_centers(
                received,
                k,
                num_tokens=N,
                batch=B,
                mode=self.init,
                device=tokens.device,
                **(self._randomness(tokens.device) if self.init == "random" else {}),
            )
        if self.algorithm == "kmedoids":
            plan, out = kmedoids_pooled(tokens, k, weights=weights, init=start, max_iters=self.max_iters)
        else:
            plan = kmeans_plan(tokens, k, weights=weights, init=start, max_iters=self.max_iters)
            out = cluster_mean(tokens, plan, weights)
        out_sizes = None if sizes is None else cluster_sizes(sizes, plan, batch=B, num_tokens=N)
        return out, out_sizes, plan.assign

    def extra_repr(self) -> str:
        w = "weighted " if self.weighted else ""
        return f"{w}{self.algorithm}, {super().extra_repr()}, max_iters={self.max_iters}, init={self.init}"


class TokenSelection(_Seeded, _Reducer):
    """Keep K of the tokens: ``"topk"`` by score (PoWER-BERT), ``"random"``, ``"importance"``.

    Kept tokens stay in their original order and keep their own sizes; sizes that come in
    as None (all ones) go out as None, with or without carry.
    """

    keeps_input_tokens = True

    def __init__(self, *, keep: Budget, mode: str = "topk", carry: bool = False, seed: int = 0) -> None:
        super().__init__(keep=keep, carry=carry)
        if mode not in ("topk", "random", "importance"):
            raise ValueError(f"mode must be 'topk', 'random' or 'importance', got {mode!r}")
        self.mode = mode
        self.seed = seed
        self._generators = {}
        self.needs_received = mode != "random"

    def _reduce(
        self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None, k: int, grid: Grid | None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        B, N, _ = tokens.shape
        if self.mode == "topk":
            assert received is not None
            idx = topk_indices(received, k)
        elif self.mode == "random":
            idx = random_indices(B, N, k, device=tokens.device, **self._randomness(tokens.device))
        else:
            assert received is not None
            idx = importance_indices(received, k, **self._randomness(tokens.device))
        out_sizes = None if sizes is None else sizes.gather(1, idx)
        assign = None
        if self.record:
            assign = torch.full((B, N), -1, dtype=torch.long, device=tokens.device)
            assign.scatter_(1, idx, torch.arange(k, device=tokens.device).expand(B, k))
        return gather_tokens(tokens, idx), out_sizes, assign  # type: ignore[return-value]

    def extra_repr(self) -> str:
        return f"{self.mode}, {super().extra_repr()}"


class TokenMerging(_Reducer):
    """ToMe-style bipartite soft matching down to K tokens; merged features and sizes
    are size-weighted means and sums. ``round_fraction``: the most one matching round may
    remove (ToMe: 0.5; see :mod:`leanformer.ops.merging`)."""

    needs_received = False

    def __init__(self, *, keep: Budget, carry: bool = False, round_fraction: float = 0.5) -> None:
        super().__init__(keep=keep, carry=carry)
        self.round_fraction = round_fraction
        self.round_ratio = round_ratio(round_fraction)  # what forward reads: ints (see round_ratio)

    def _reduce(
        self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None, k: int, grid: Grid | None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        assign = bipartite_merge_plan(tokens, k, sizes=sizes, round_fraction=self.round_ratio)
        w = sizes if sizes is not None else tokens.new_ones(tokens.shape[:2])
        out, out_sizes = weighted_segment_mean(tokens, w.to(tokens.dtype), assign, k)
        return out, (out_sizes if sizes is not None else None), assign

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, round_fraction={self.round_fraction}"


class ConvDownsample(_Reducer):
    """Learned 2x2 stride-2 convolution on the token grid, same width (appendix D).

    Tokens must be in raster order on an ``h x w`` grid. A patched host passes the grid it
    embedded (``grid=``), so any input size is read right. Called without one, the layer
    reads the count: the grid given at construction, that grid halved (the entry step
    ran this layer once before), or, when the count differs (another input resolution),
    a square grid. A grid with an
    odd side is padded by repeating its last row/column (sizes of the padding are 0), so
    the output grid is ``ceil(h/2) x ceil(w/2)``. Tokens that no longer form a grid (after
    a clustering/selection layer) raise a ``ValueError``: conv can only follow conv.

    The kernel starts as 2x2 average pooling (identity per channel / 4), so an inserted
    layer is sensible before any training; it is learned from there. Output sizes are the
    sums of the window's sizes.
    """

    needs_received = False
    reads_grid = True

    def __init__(self, *, dim: int, grid_size: tuple[int, int], carry: bool = False) -> None:
        super().__init__(keep=1.0, carry=carry)
        self.grid_size = (int(grid_size[0]), int(grid_size[1]))
        self.conv = nn.Conv2d(dim, dim, kernel_size=2, stride=2)
        with torch.no_grad():
            self.conv.weight.zero_()
            eye = torch.eye(dim)[:, :, None, None].expand(dim, dim, 2, 2)
            self.conv.weight.copy_(eye / 4.0)
            assert self.conv.bias is not None  # Conv2d's default bias=True
            self.conv.bias.zero_()

    def grid_for(self, n: int, grid: Grid | None = None) -> Grid:
        """The grid ``n`` tokens lie on: ``grid`` when given (checked against ``n``), else
        read from the count as the class docstring says."""
        if grid == OFF_GRID:
            raise ValueError(
                f"conv downsampling needs the tokens on their grid: the {n} tokens it got come "
                "from a clustering, selection or merge before it; conv can only follow other conv layers"
            )
        if grid is not None:
            h, w = grid
            if h * w != n:
                raise ValueError(
                    f"conv downsampling got {n} tokens on a {h}x{w} grid ({h * w} places): "
                    "conv can only follow other conv layers"
                )
            return h, w
        h, w = built = self.grid_size
        if n == h * w:
            return h, w
        # Its own grid halved (2x2 windows, odd sides rounded up): what this layer receives
        # after the entry step (reduce_at="entry") ran it once on the full grid.
        while h * w > 1:
            h, w = halved_grid(h, w)
            if n == h * w:
                return h, w
        side = math.isqrt(n)
        if side * side == n:
            return side, side
        raise ValueError(
            f"conv downsampling needs the tokens on their grid: got {n} tokens, expected "
            f"{built[0]}x{built[1]}={built[0] * built[1]}, a 2x2 halving of it, or a square number; "
            "conv can only follow other conv layers"
        )

    def output_count(self, n: int, grid: Grid | None = None) -> int:
        h, w = self.grid_for(n, grid)
        return n if n <= 1 else math.prod(halved_grid(h, w))

    def _reduce(
        self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None, k: int, grid: Grid | None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        B, N, C = tokens.shape
        h, w = self.grid_for(N, grid)
        h2, w2 = halved_grid(h, w)
        if k != h2 * w2:  # output_count (N > k >= 1 here, so N > 1)
            # A 2x2 window has one output count per grid; keeping any other (the entry
            # step's fade, a caller's count=) would silently keep this one instead.
            raise ValueError(
                f"conv downsampling keeps {h2 * w2} of {N} tokens (2x2 windows); "
                f"it cannot keep {k}: use a clustering, selection or merging method for that budget"
            )
        pad = (0, w % 2, 0, h % 2)  # right, bottom
        grid_tokens = tokens.transpose(1, 2).reshape(B, C, h, w)
        if any(pad):
            grid_tokens = F.pad(grid_tokens, pad, mode="replicate")
        out = self.conv(grid_tokens).flatten(2).transpose(1, 2)
        out_sizes = None
        if sizes is not None:
            s = F.pad(sizes.reshape(B, 1, h, w), pad)  # padded copies stand for no token
            out_sizes = F.avg_pool2d(s, 2).flatten(1) * 4.0
        rows = torch.arange(h, device=tokens.device) // 2
        cols = torch.arange(w, device=tokens.device) // 2
        assign = (rows[:, None] * w2 + cols[None, :]).flatten().expand(B, N)
        return out, out_sizes, assign

    def extra_repr(self) -> str:
        return f"grid_size={self.grid_size}, carry={self.carry}"


# --------------------------------------------------------------------------- registry


class NothingPlaced(ValueError):
    """A budget that asks for fewer tokens, with which a method would place no reducer at all
    (conv, where no block keeps half of its tokens or fewer): the model would stay unpooled."""


@dataclass(frozen=True)
class PoolingMethod:
    """A registry entry: how to build the reducers of a method for a budget.

    Most methods reduce each block on its own budget: ``make(keep=budget, carry=..., **opts)``
    builds one block's reducer, and blocks whose budget cannot bind get none. A method that
    decides its placement over the whole host (``conv``, ``none``) gives ``build`` instead,
    called as ``build(keep, depth=, num_tokens=, dim=, grid_size=, carry=, **opts)``.
    """

    name: str
    description: str
    make: Callable[..., nn.Module] | None
    options: tuple[str, ...] = ()
    build: Callable[..., list[nn.Module | None]] | None = None
    # Where the method's reducers sit when the method decides it (None: the caller's
    # ``reduce_at``, by default between attention and MLP).
    reduce_at: ReducePosition | None = None
    # Whether the method tracks token sizes whatever ``carry`` says (ToMe's merges are
    # size-weighted averages); ``carry`` then only decides the attention's log(size) bias.
    sizes_always: bool = False
    # Whether the method's counted cost depends on the images, not only on the token counts
    # (K-Medoids' C++ iterations stop at their fixed point; a FLOP counter sees every K-Means
    # iteration): a GFLOPs budget is then solved on several images rather than one.
    cost_depends_on_images: bool = False

    def __post_init__(self) -> None:
        if (self.make is None) == (self.build is None):
            raise ValueError(f"pooling method {self.name!r}: give exactly one of make and build")


def _cluster(algorithm: str, weighted: bool) -> Callable[..., nn.Module]:
    def make(*, keep: Budget, carry: bool, **opts: Any) -> nn.Module:
        return ClusterPooling(keep=keep, algorithm=algorithm, weighted=weighted, carry=carry, **opts)

    return make


def _select(mode: str) -> Callable[..., nn.Module]:
    def make(*, keep: Budget, carry: bool, **opts: Any) -> nn.Module:
        return TokenSelection(keep=keep, mode=mode, carry=carry, **opts)

    return make


def _merge(round_fraction: float) -> Callable[..., nn.Module]:
    def make(*, keep: Budget, carry: bool) -> nn.Module:
        return TokenMerging(keep=keep, carry=carry, round_fraction=round_fraction)

    return make


def _no_reducers(keep: KeepLike | None, *, depth: int, **_: Any) -> list[nn.Module | None]:
    """``none``: every block keeps all of its tokens, whatever the budget says."""
    return [None] * depth


def _build_conv(
    keep: KeepLike | None,
    *,
    depth: int,
    num_tokens: int,
    dim: int,
    grid_size: tuple[int, int],
    carry: bool,
    layers: Any = None,
) -> list[nn.Module | None]:
    """``conv``: a learned downsampler at the blocks in ``layers``, or else at each block
    where ``keep`` asks to drop at least half of the tokens it receives."""
    h, w = int(grid_size[0]), int(grid_size[1])
    if layers is None:
        if keep is None:
            raise ValueError("conv pooling needs layers=[block indices] or keep= to place its layers")
        budgets = parse_keep(keep).per_block(depth=depth, num_tokens=h * w)
        chosen, n, gh, gw = [], h * w, h, w
        for i, budget in enumerate(budgets):
            if n > 1 and budget_to_count(budget, n) <= n // 2:
                chosen.append(i)
                gh, gw = halved_grid(gh, gw)
                n = gh * gw
        if not chosen and any(budget_to_count(b, h * w) < h * w for b in budgets):
            # Placing none would silently leave the model unpooled.
            raise NothingPlaced(
                f"conv cannot keep keep={parse_keep(keep)} of the tokens: each conv layer keeps a "
                "quarter of them (2x2 windows) and sits only where a block keeps half or fewer, so the "
                "nearest budgets it reaches keep 1.0 (no layer) or 0.25 at a block: give keep=0.5 or "
                "lower, layers=[...], or a GFLOPs fraction such as 0.6x"
            )
        layers = chosen
    else:
        if isinstance(layers, int | str):
            layers = [int(t) for t in str(layers).split(",") if t.strip()]
        for i in layers:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < depth:
                raise ValueError(f"conv layers must be block indices in [0, {depth}), got {i!r}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"conv layers must be distinct, got {list(layers)}")
    reducers: list[nn.Module | None] = [None] * depth
    for i in sorted(layers):
        reducers[i] = ConvDownsample(dim=dim, grid_size=(h, w), carry=carry)
        h, w = halved_grid(h, w)
    return reducers


_CLUSTER_OPTS = ("max_iters", "init", "seed")
METHODS: dict[str, PoolingMethod] = {
    m.name: m
    for m in (
        PoolingMethod(
            "kmeans",
            "K-Means, cluster means",
            _cluster("kmeans", False),
            _CLUSTER_OPTS,
            cost_depends_on_images=True,
        ),
        PoolingMethod(
            "kmedoids",
            "K-Medoids, cluster means",
            _cluster("kmedoids", False),
            _CLUSTER_OPTS,
            cost_depends_on_images=True,
        ),
        PoolingMethod(
            "wkmeans", "weighted K-Means (significance scores)", _cluster("kmeans", True), _CLUSTER_OPTS
        ),
        PoolingMethod(
            "wkmedoids",
            "weighted K-Medoids (significance scores)",
            _cluster("kmedoids", True),
            _CLUSTER_OPTS,
            cost_depends_on_images=True,
        ),
        PoolingMethod("powerbert", "top-K by significance score (PoWER-BERT)", _select("topk")),
        PoolingMethod(
            "random", "K tokens uniformly at random, without replacement", _select("random"), ("seed",)
        ),
        PoolingMethod(
            "importance", "K tokens sampled in proportion to significance", _select("importance"), ("seed",)
        ),
        PoolingMethod(
            "tome",
            "ToMe exactly: bipartite soft matching on the attention keys, r tokens per block",
            None,
            build=build_tome,
            reduce_at="attn",
            sizes_always=True,
        ),
        PoolingMethod("merge", "ToMe-like bipartite soft matching on the tokens", _merge(0.5)),
        PoolingMethod(
            "stepmerge", "bipartite merging in rounds of at most a quarter of the tokens", _merge(0.25)
        ),
        PoolingMethod(
            "inputmerge",
            "ToMe bipartite soft matching at each block's input, before its attention",
            _merge(0.5),
            reduce_at="input",
        ),
        PoolingMethod(
            "entrymerge",
            "ToMe bipartite soft matching after each attention, and once before the first block "
            "when the budget is tight",
            _merge(0.5),
            reduce_at="entry",
        ),
        PoolingMethod(
            "conv", "learned 2x2 stride-2 conv on the token grid", None, ("layers",), build=_build_conv
        ),
        PoolingMethod("none", "no reduction", None, build=_no_reducers),
    )
}


def list_methods() -> list[str]:
    """Names accepted by ``method=`` / ``pool=``."""
    return list(METHODS)


def pooling_method(name: str) -> PoolingMethod:
    """The method registered as ``name`` (a ``ValueError`` naming close matches if none is)."""
    if name not in METHODS:
        close = difflib.get_close_matches(str(name), METHODS, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(f"unknown pooling method {name!r}; {hint}choose from: {', '.join(METHODS)}")
    return METHODS[name]


def method_reduce_at(method: str, reduce_at: ReducePosition | None) -> ReducePosition:
    """Where ``method``'s reducers sit: its own place if it has one, else ``reduce_at``
    (``None``: between attention and MLP). A place the method cannot use raises."""
    spec = pooling_method(method)
    if spec.reduce_at is None:
        return "attn" if reduce_at is None else reduce_at
    if reduce_at is not None and reduce_at != spec.reduce_at:
        raise ValueError(
            f"pooling method {method!r} reduces {REDUCE_POSITION_WORDS[spec.reduce_at]}; "
            f"reduce_at={reduce_at!r} does not apply to it (leave reduce_at unset)"
        )
    return spec.reduce_at


def build_reducers(
    *,
    method: str,
    keep: KeepLike | None,
    depth: int,
    num_tokens: int,
    dim: int,
    grid_size: tuple[int, int],
    carry: bool = False,
    **options: Any,
) -> list[nn.Module | None]:
    """One reducer (or None) per block for ``method`` under budget ``keep``.

    ``num_tokens`` is the number of patch tokens at the configured input size; a block
    whose count budget cannot bind there (``K_l >= tokens it receives``) gets no reducer,
    so it keeps the fused attention kernel. Count budgets are therefore tied to the
    configured resolution; use a ratio to scale with the input.

    ``conv`` places a conv layer at the blocks in ``layers=[...]`` (0-based), or else at
    each block where ``keep`` asks to drop at least half of the tokens it receives; it
    needs ``grid_size`` (the patch grid).

    Options: ``max_iters`` (default 5), ``init`` ("topk" | "random"), ``seed`` for the
    clustering methods; ``seed`` for ``random``/``importance``; ``layers`` for ``conv``.
    Unknown options raise ``ValueError``.
    """
    spec = pooling_method(method)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        valid = ", ".join(spec.options) if spec.options else "none"
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for pooling method {method!r} (valid: {valid})"
        )
    if "seed" in options and as_int(options["seed"]) is None:
        raise ValueError(f"pooling option seed must be an integer, got {options['seed']!r}")
    if spec.build is not None:
        return spec.build(
            keep, depth=depth, num_tokens=num_tokens, dim=dim, grid_size=grid_size, carry=carry, **options
        )
    assert spec.make is not None
    budgets = parse_keep(keep).per_block(depth=depth, num_tokens=num_tokens)
    reducers: list[nn.Module | None] = []
    n = num_tokens
    for budget in budgets:
        k = budget_to_count(budget, n)
        binds = k < n if isinstance(budget, int) else budget < 1.0
        reducers.append(spec.make(keep=budget, carry=carry, **options) if binds else None)
        n = k
    return reducers
