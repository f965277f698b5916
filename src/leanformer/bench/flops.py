"""FLOPs in the papers' convention (multiply-adds per sample, in billions): the counter of
:mod:`leanformer.ops.flop_count`, where the token budgets given as a GFLOPs fraction
(``keep="0.5x"``) count them too."""

from __future__ import annotations

from leanformer.ops.flop_count import batch_input, count_gflops, flop_counter

__all__ = ["batch_input", "count_gflops", "flop_counter"]
