"""CONTRIBUTING.md's walk-through, done: a toy method added in one module's worth of code.

``keepfirst`` keeps the first K patch tokens of each block. Registered the way a module of
``leanformer.pooling.methods`` registers its family, it is taken up by the registry, by
``apply_token_pooling`` on a timm ViT, by ``create_model(..., pool=)`` and by the budget's
run-time setter, with no other file touched.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import timm
import torch
from torch import Tensor, nn

import leanformer
from leanformer.models.registry import create_model
from leanformer.pooling.budgets import Budget
from leanformer.pooling.reducer import Grid, ReducerBase
from leanformer.pooling.registry import METHODS, PoolingMethod, build_reducers, list_methods, register


class KeepFirst(ReducerBase):
    """Keeps the first ``k`` tokens: ``tokens [B, N, C] -> [B, k, C]``."""

    keeps_input_tokens = True

    def _reduce(
        self, tokens: Tensor, sizes: Tensor | None, received: Tensor | None, k: int, grid: Grid | None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        B, N, _ = tokens.shape
        kept = torch.arange(N, device=tokens.device)
        assign = torch.where(kept < k, kept, -1).expand(B, N)
        return tokens[:, :k], (None if sizes is None else sizes[:, :k]), assign


def _make(*, keep: Budget, carry: bool) -> nn.Module:
    return KeepFirst(keep=keep, carry=carry)


@pytest.fixture
def keepfirst() -> Iterator[str]:
    register(PoolingMethod("keepfirst", "the first K tokens", _make))
    try:
        yield "keepfirst"
    finally:
        del METHODS["keepfirst"]  # the registry is the package's: leave it as found


def _vit() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, depth=3, num_classes=5
    ).eval()


def _tokens_after_blocks(model: nn.Module, images: Tensor) -> list[int]:
    counts: list[int] = []
    hooks = [b.register_forward_hook(lambda m, i, out: counts.append(out.shape[1])) for b in model.blocks]
    with torch.no_grad():
        model(images)
    for hook in hooks:
        hook.remove()
    return counts


def test_a_registered_method_is_built_and_applied_everywhere(keepfirst: str) -> None:
    assert list_methods()[-1] == keepfirst
    reducers = build_reducers(
        method=keepfirst, keep=[1.0, 0.5], depth=2, num_tokens=64, dim=8, grid_size=(8, 8)
    )
    assert reducers[0] is None and isinstance(reducers[1], KeepFirst)

    images = torch.randn(2, 3, 32, 32)
    model = leanformer.apply_token_pooling(_vit(), method=keepfirst, keep=0.5)
    assert _tokens_after_blocks(model, images) == [1 + 32, 1 + 16, 1 + 8]
    model.token_pooling.keep = 0.25  # the budget changes at run time like any method's
    assert _tokens_after_blocks(model, images) == [1 + 16, 1 + 4, 1 + 1]

    # Keeping every token is the plain model, as for every method.
    plain = _vit()
    with torch.no_grad():
        expected = plain(images)
        got = leanformer.apply_token_pooling(_vit(), method=keepfirst, keep=1.0)(images)
    torch.testing.assert_close(got, expected)

    deit = create_model("deit_test", pool=keepfirst, keep=0.5)
    assert _tokens_after_blocks(deit, torch.randn(1, 3, 16, 16)) == [1 + 8, 1 + 4, 1 + 2]


def test_a_name_is_registered_once(keepfirst: str) -> None:
    with pytest.raises(ValueError, match="'keepfirst' is registered twice"):
        register(PoolingMethod(keepfirst, "again", _make))


def test_an_unregistered_name_names_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown pooling method 'keepfirs'.*choose from: kmeans"):
        leanformer.apply_token_pooling(_vit(), method="keepfirs", keep=0.5)
