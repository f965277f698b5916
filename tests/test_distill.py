"""Soft-label distillation loss (SReT supplement eq. 6)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from leanformer.engine.distill import soft_cross_entropy


def reference(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Eq. 6 with explicit loops: -1/N sum_i sum_c P_T log P_S (times T^2)."""
    total = 0.0
    for s_row, t_row in zip(student.tolist(), teacher.tolist()):
        zs = [v / temperature for v in s_row]
        zt = [v / temperature for v in t_row]
        log_norm_s = math.log(sum(math.exp(v) for v in zs))
        norm_t = sum(math.exp(v) for v in zt)
        total -= sum(math.exp(t) / norm_t * (s - log_norm_s) for s, t in zip(zs, zt))
    return torch.tensor(total / len(student) * temperature**2, dtype=torch.float32)


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_matches_loop_reference(temperature: float) -> None:
    torch.manual_seed(0)
    s, t = torch.randn(5, 7), torch.randn(5, 7)
    torch.testing.assert_close(
        soft_cross_entropy(s, t, temperature=temperature), reference(s, t, temperature)
    )


def test_one_hot_teacher_gives_cross_entropy() -> None:
    torch.manual_seed(0)
    s = torch.randn(6, 4)
    labels = torch.tensor([0, 1, 2, 3, 0, 1])
    teacher = F.one_hot(labels, 4).float() * 1e4  # softmax is (numerically) one-hot
    torch.testing.assert_close(soft_cross_entropy(s, teacher), F.cross_entropy(s, labels))


def test_minimum_at_teacher_and_no_gradient_to_teacher() -> None:
    torch.manual_seed(0)
    t = torch.randn(3, 5, requires_grad=True)
    s = t.detach().clone().requires_grad_(True)
    loss = soft_cross_entropy(s, t)
    loss.backward()
    # d/ds = (softmax(s) - softmax(t)) / N = 0 when the student equals the teacher.
    torch.testing.assert_close(s.grad, torch.zeros_like(s), atol=1e-7, rtol=0)
    assert t.grad is None
    # Equal to the teacher's entropy there, and larger for any other student.
    p = t.detach().softmax(-1)
    torch.testing.assert_close(loss, -(p * p.log()).sum(-1).mean())
    assert soft_cross_entropy(s.detach() + torch.randn(3, 5), t) > loss


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="temperature must be > 0"):
        soft_cross_entropy(torch.zeros(2, 3), torch.zeros(2, 3), temperature=0.0)
    with pytest.raises(ValueError, match="differ in shape"):
        soft_cross_entropy(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"expected logits \[N, classes\]"):
        soft_cross_entropy(torch.zeros(3), torch.zeros(3))


def test_engine_trains_sret_with_a_trained_teacher(tmp_path: Path) -> None:
    from leanformer.config import load_config
    from leanformer.engine.train import fit

    data = {"data.limit_train": 32, "data.batch_size": 16, "data.limit_test": 32, "optim.epochs": 1}
    fit(load_config(None, {"model": "deit_test", **data}), out_dir=tmp_path / "teacher", progress=False)
    overrides = {
        "model": "sret_test",
        "train.teacher": str(tmp_path / "teacher"),
        "train.distill_weight": 1.0,  # the paper's scheme: soft labels only
        **data,
        "train.checkpoint": False,
    }
    result = fit(load_config(None, overrides), progress=False)
    assert math.isfinite(result.metrics["train_loss"]) and result.metrics["train_loss"] > 0
