"""``engine.evaluate``: top-1 and loss against a plain loop, and the per-batch hooks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leanformer.engine.evaluate import evaluate


def _data() -> tuple[nn.Module, list[tuple[Tensor, Tensor]]]:
    torch.manual_seed(0)
    model = nn.Linear(6, 4).double()
    inputs, targets = torch.randn(23, 6, dtype=torch.float64), torch.randint(0, 4, (23,))
    # batches of 10, 10 and 3: the last one short, as loaders give it
    return model, [(inputs[i : i + 10], targets[i : i + 10]) for i in range(0, 23, 10)]


def test_top1_loss_and_per_input_hits_match_a_plain_loop() -> None:
    model, batches = _data()
    seen: list[tuple[Tensor, Tensor]] = []
    result = evaluate(model, batches, on_logits=lambda logits, y: seen.append((logits.clone(), y)))

    with torch.no_grad():
        logits = torch.cat([model(x) for x, _ in batches])
    targets = torch.cat([y for _, y in batches])
    right = [int(logits[i].argmax()) == int(targets[i]) for i in range(len(targets))]  # one at a time
    assert result["n"] == 23
    assert result["top1"] == pytest.approx(100.0 * sum(right) / 23)
    assert result["loss"] == pytest.approx(float(F.cross_entropy(logits, targets)))
    assert 0 < sum(right) < 23  # both kinds of input occur, so the hits below can be wrong
    hits = torch.cat([lg.argmax(dim=-1) == y for lg, y in seen])
    assert hits.tolist() == right
    assert [len(y) for _, y in seen] == [10, 10, 3]


def test_empty_data_is_refused() -> None:
    model, _ = _data()
    with pytest.raises(ValueError, match="evaluation data is empty"):
        evaluate(model, [])
