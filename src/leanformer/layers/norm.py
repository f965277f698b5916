"""The transformer LayerNorm of the DeiT/SReT families, defined once."""

from __future__ import annotations

from functools import partial

from torch import nn

# eps 1e-6 as in the DeiT and SReT reference code (PyTorch's default is 1e-5); a factory,
# so that it serves as the default ``norm_layer`` argument of blocks and stages.
LAYER_NORM = partial(nn.LayerNorm, eps=1e-6)
