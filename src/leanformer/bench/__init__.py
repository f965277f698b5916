"""Measurement primitives: FLOPs, parameters, throughput, memory, interleaved timing, result rows.

The applications built on them (the trade-off sweep, its tables and plots, the Perceiver
tables, the DETR comparison) live in :mod:`leanformer.apps`.
"""
