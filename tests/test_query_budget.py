"""The query-budget protocol: which models take ``num_queries=K``, and the one range check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leanformer.cli import main
from leanformer.models.query_budget import QueryBudgetModel, check_query_count, has_query_budget, query_budget
from leanformer.models.registry import create_model


class _NamedLikeAPerceiver(nn.Module):
    """Has an attribute called num_queries, but it is not a query count."""

    num_queries = "64"


def test_only_models_with_integer_queries_have_a_budget() -> None:
    perceiver = create_model("visual_perceiver_test")
    assert isinstance(perceiver, QueryBudgetModel) and has_query_budget(perceiver)
    assert query_budget(perceiver) == perceiver.num_queries == 8
    for other in (create_model("deit_test"), _NamedLikeAPerceiver(), object()):
        assert not has_query_budget(other)
        with pytest.raises(ValueError, match=r"needs a Visual Perceiver \(a model with latent queries\)"):
            query_budget(other, needed_by="train.query_masking")


@pytest.mark.parametrize("k", [0, 9, -1, 2.0, True, "3", None])
def test_query_count_out_of_range_is_refused_by_name(k: object) -> None:
    with pytest.raises(ValueError, match=r"--num-queries must be an integer in \[1, 8\]"):
        check_query_count(k, 8, name="--num-queries")


def test_perceiver_forward_uses_the_same_check() -> None:
    perceiver = create_model("visual_perceiver_test").eval()
    x = torch.randn(2, perceiver.in_chans, *perceiver.img_size)
    assert check_query_count(8, 8) == 8
    with torch.no_grad():
        assert perceiver(x, num_queries=1).shape == perceiver(x, num_queries=8).shape
        with pytest.raises(ValueError, match=r"num_queries must be an integer in \[1, 8\]"):
            perceiver(x, num_queries=9)


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["perceiver-eval"], "perceiver-eval"),
        (["visualize", "perceiver-attention"], "visualize perceiver-attention"),
    ],
)
def test_perceiver_commands_name_themselves_for_a_model_without_queries(
    argv: list[str], command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--model", "deit_test", "--data", "digits", "--limit", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{command} needs a Visual Perceiver" in err
