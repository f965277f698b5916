"""Shared constructor checks: integers of any kind, clear names, sizes and sigma."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leanformer.layers.checks import (
    check_patch_grid,
    check_positive,
    check_positive_number,
    check_sizes,
    head_dim,
    hidden_width,
)
from leanformer.layers.patch_embed import to_2tuple
from leanformer.ops.entropy_map import check_sigma


def test_integers_of_any_kind_are_accepted() -> None:
    check_positive(a=3, b=np.int64(2), c=torch.tensor(5))
    check_positive(minimum=0, depth=0)
    check_positive(optional=True, width=None)
    assert check_sizes("dims", (np.int64(8), 2)) == (8, 2)
    check_positive_number(mlp_ratio=0.5)
    check_positive_number(zero_ok=True, nll_ratio=0)
    check_positive_number(zero_ok=True, optional=True, init_values=None)
    assert head_dim(np.int64(24), 2) == 12
    assert to_2tuple(np.int32(32)) == (32, 32)
    assert to_2tuple((np.int64(16), torch.tensor(8))) == (16, 8)
    assert to_2tuple(torch.Size([8, 16])) == (8, 16)
    assert to_2tuple([4, 6]) == (4, 6)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: check_positive(depth=0), "depth must be an integer >= 1, got 0"),
        (lambda: check_positive(depth=True), "depth must be an integer >= 1, got True"),
        (lambda: check_positive(width=2.5), "width must be an integer >= 1, got 2.5"),
        (lambda: check_positive(minimum=0, depth=-1), "depth must be an integer >= 0, got -1"),
        (lambda: check_positive(optional=True, width=0), "width must be an integer >= 1, got 0"),
        (lambda: check_sizes("dims", [8, 2.5]), r"dims\[1\] must be an integer >= 1, got 2.5"),
        (lambda: check_sizes("dims", 8), "dims must be a list of integers, got 8"),
        (lambda: check_positive_number(mlp_ratio="abc"), "mlp_ratio must be a number > 0, got 'abc'"),
        (lambda: check_positive_number(mlp_ratio=0), "mlp_ratio must be a number > 0, got 0"),
        (lambda: check_positive_number(mlp_ratio=None), "mlp_ratio must be a number > 0, got None"),
        (
            lambda: check_positive_number(zero_ok=True, optional=True, init_values=-1e-5),
            "init_values must be a number >= 0, got -1e-05",
        ),
        (
            lambda: check_positive_number(zero_ok=True, nll_ratio=float("nan")),
            "nll_ratio must be a number >= 0",
        ),
        (lambda: head_dim(30, 4), r"dim \(30\) must be divisible by num_heads \(4\)"),
        (lambda: head_dim(30, 0), "num_heads must be an integer >= 1, got 0"),
        (lambda: check_patch_grid((32, 30), 4), r"img_size \(32, 30\) is not a multiple of patch_size 4"),
        (lambda: to_2tuple("abc"), "img_size must be a size or a"),
        (lambda: to_2tuple((1, 2, 3)), "img_size must be a size or a"),
        (lambda: to_2tuple((8, 0)), "img_size width must be an integer >= 1, got 0"),
    ],
)
def test_bad_values_name_the_option(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        call()


def test_sigma() -> None:
    assert (
        check_sigma(np.float32(1.5)) == 1.5
        and check_sigma(torch.tensor(2.0)) == 2.0
        and check_sigma(0) == 0.0
    )
    for bad in (True, "1", -1.0, float("nan"), float("inf"), 1001.0):
        with pytest.raises(ValueError, match="sigma must be a finite number in"):
            check_sigma(bad)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("sret_test", {"nll_ratio": 0.01}),
        ("sret_test", {"mlp_ratio": 0.01}),
        ("deit_test", {"mlp_ratio": 0.01}),
        ("visual_perceiver_test", {"mlp_ratio": 0.001}),
    ],
)
def test_a_ratio_that_leaves_no_hidden_unit_is_refused(name: str, options: dict[str, float]) -> None:
    # timm's Mlp reads a hidden width of 0 as "the input width": a smaller ratio used to
    # build a larger model (sret_tiny: 3.65M parameters at nll_ratio 0.015, 3.63M at 0.02).
    from leanformer import create_model

    (key,) = options
    with pytest.raises(ValueError, match=f"{key} .* leaves no hidden unit"):
        create_model(name, **options)
    assert hidden_width(16, 0.0625) == 1 and hidden_width(16, 3.6) == 57
