"""A patched block's forward runs its host's attention once and its reducer once.

Counted on a patched timm ViT for every place a reducer can sit and for each kind of
scores a reducer reads (none, the attention received, the keys): the shared step of
:mod:`leanformer.patch.adapter` asks the host's attention for the scores the reducer
reads in that one call. The ``entry`` step is a step of its own before the first block:
there the first block's reducer runs once more, and nowhere else.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import timm
import torch
from torch import Tensor, nn

import leanformer
from leanformer.patch.adapter import installed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, depth=3, num_classes=5
    ).eval()


def _count_calls(model: nn.Module) -> tuple[Counter[int], Counter[int], dict[int, list[Any]]]:
    """Counters of the attention and reducer calls per block, and what each attention was asked for."""
    attention_calls: Counter[int] = Counter()
    reducer_calls: Counter[int] = Counter()
    asked: dict[int, list[Any]] = {}
    for index, block in enumerate(model.blocks):
        step = installed(block.__dict__["forward"])
        host_attention = step.parts.attention

        def counted(
            x: Tensor, sizes: Tensor | None, reads: Any, *, i: int = index, f: Any = host_attention
        ) -> Any:
            attention_calls[i] += 1
            asked.setdefault(i, []).append(reads)
            return f(x, sizes, reads)

        step.parts = dataclasses.replace(step.parts, attention=counted)
        reducer = model.token_pooling.reducer(index)
        if reducer is not None:
            reducer.register_forward_pre_hook(lambda *_, i=index: reducer_calls.update([i]))
    return attention_calls, reducer_calls, asked


@pytest.mark.parametrize(
    ("method", "reduce_at", "reads"),
    [
        ("merge", "attn", None),
        ("merge", "mlp", None),
        ("merge", "input", None),
        ("wkmedoids", "attn", "received"),
        ("powerbert", "mlp", "received"),
        ("tome", None, "keys"),
    ],
)
def test_one_attention_and_one_reduction_per_block(
    method: str, reduce_at: str | None, reads: str | None
) -> None:
    model = leanformer.apply_token_pooling(_model(), method=method, keep=0.75, reduce_at=reduce_at)
    attention_calls, reducer_calls, asked = _count_calls(model)
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    depth = len(model.blocks)
    assert attention_calls == Counter(dict.fromkeys(range(depth), 1))
    assert reducer_calls == Counter(dict.fromkeys(range(depth), 1))
    assert asked == {i: [reads] for i in range(depth)}


def test_the_entry_step_is_the_one_extra_reduction() -> None:
    model = leanformer.apply_token_pooling(_model(), method="entrymerge", keep=0.5)
    attention_calls, reducer_calls, _ = _count_calls(model)
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    depth = len(model.blocks)
    assert attention_calls == Counter(dict.fromkeys(range(depth), 1))
    assert reducer_calls == Counter({0: 2} | dict.fromkeys(range(1, depth), 1))
