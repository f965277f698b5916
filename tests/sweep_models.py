"""The small untrained model the trade-off sweep tests run on (one definition for all)."""

from __future__ import annotations

import functools

import torch

from leanformer.apps.sweep_config import SweepConfig
from leanformer.engine.builders import build_model, build_split


@functools.cache
def _digits_info():
    return build_split(SweepConfig().data, "test").info


def untrained_deit_test() -> torch.nn.Module:
    """A fresh ``deit_test`` for 16x16 digits, its weights drawn from seed 0 (the same
    weights at every call, so sweeps run on separate copies can be compared)."""
    torch.manual_seed(0)
    return build_model("deit_test", {"img_size": 16}, _digits_info())[0].eval()
