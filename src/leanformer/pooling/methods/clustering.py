"""Clustering methods (Token Pooling, Algorithm 1): ``kmeans``, ``kmedoids``, ``wkmeans``,
``wkmedoids``. Each block's tokens are clustered and replaced by their clusters' weighted means."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from leanformer.ops.cluster_init import InitMode, init_centers
from leanformer.ops.cluster_plan import cluster_mean, cluster_sizes
from leanformer.ops.kmeans import kmeans_plan
from leanformer.ops.kmedoids import kmedoids_pooled
from leanformer.pooling.budgets import Budget
from leanformer.pooling.reducer import Grid, ReducerBase, SeededDraws
from leanformer.pooling.registry import PoolingMethod, register


class ClusterPooling(SeededDraws, ReducerBase):
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


def _cluster(algorithm: str, weighted: bool) -> Callable[..., nn.Module]:
    def make(*, keep: Budget, carry: bool, **opts: Any) -> nn.Module:
        return ClusterPooling(keep=keep, algorithm=algorithm, weighted=weighted, carry=carry, **opts)

    return make


_OPTIONS = ("max_iters", "init", "seed")
register(
    PoolingMethod(
        "kmeans", "K-Means, cluster means", _cluster("kmeans", False), _OPTIONS, cost_depends_on_images=True
    )
)
register(
    PoolingMethod(
        "kmedoids",
        "K-Medoids, cluster means",
        _cluster("kmedoids", False),
        _OPTIONS,
        cost_depends_on_images=True,
    )
)
register(
    PoolingMethod("wkmeans", "weighted K-Means (significance scores)", _cluster("kmeans", True), _OPTIONS)
)
register(
    PoolingMethod(
        "wkmedoids",
        "weighted K-Medoids (significance scores)",
        _cluster("kmedoids", True),
        _OPTIONS,
        cost_depends_on_images=True,
    )
)
