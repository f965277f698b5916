"""Visual Perceiver tables: accuracy and cost per query count K, and the DQS threshold sweep.

* :func:`accuracy_by_k` -- top-1 with the first K queries (paper table 2, "Q. Masking").
* :func:`random_subset_accuracy` -- K random queries, ``reps`` repetitions, mean/std
  (the paper's baseline, green curve of figure 2).
* :func:`cost_by_k` -- GMACs per image and inference time per batch for each K
  (paper table 1), with the time relative to the full query set.
* :func:`dqs_sweep` -- for each threshold t: average, std, min, max kept queries and
  top-1 (paper table 3 / figure 6).
* :func:`dqs_timing` -- DQS versus the fixed-K' model at the same average budget, and
  the cost of the selection itself.

Rows are plain dicts (JSON-ready); :func:`markdown_table` renders them and
:func:`plot_perceiver` draws accuracy against K, GMACs and time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor, nn

from leanformer.apps.plots import save_figure, style_accuracy_axis
from leanformer.apps.table import column
from leanformer.apps.table import markdown_table as render_table
from leanformer.bench.flops import count_gflops
from leanformer.bench.timing import time_interleaved
from leanformer.engine.evaluate import evaluate
from leanformer.models.perceiver import VisualPerceiver
from leanformer.models.query_budget import query_budget
from leanformer.ops.query_selection import bucket_counts, kept_positions, select_queries
from leanformer.progress import progress_bar

PAPER_KS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64)
PAPER_THRESHOLDS: tuple[float, ...] = (0.6, 0.65, 0.7, 0.8, 0.9, 0.99)


def query_counts(given: list[int] | None, total: int, default: Iterable[int]) -> list[int]:
    """The query counts of a table: ``default``'s below the model's ``total`` (``Q``), then
    ``Q``; a list the user gave must fit entirely (a silently shorter table would not
    show what was asked)."""
    if given is None:
        return [k for k in default if k < total] + [total]
    too_many = [k for k in given if k > total]
    if too_many:
        raise ValueError(f"--ks {too_many} exceed the model's {total} latent queries")
    _sorted_counts(given)
    return given


def _sorted_counts(ks: Iterable[int]) -> list[int]:
    counts = sorted({int(k) for k in ks})
    if not counts or counts[0] < 1:
        raise ValueError(f"query counts must be >= 1, got {counts}")
    return counts


def check_ks(model: nn.Module, ks: Iterable[int]) -> list[int]:
    """Query counts clipped to the model's ``Q`` (the paper's list on a smaller model)."""
    total = query_budget(model, needed_by="the Perceiver tables")
    ks = _sorted_counts(ks)
    kept = [k for k in ks if k <= total]
    if not kept:
        raise ValueError(f"every query count in {ks} exceeds the model's {total} queries")
    return kept


def accuracy_by_k(
    model: nn.Module,
    loader: Iterable[Any],
    ks: Sequence[int],
    *,
    device: str = "cpu",
    progress: bool = False,
) -> list[dict[str, Any]]:
    """``[{"k", "top1", "loss"}]``: the first ``k`` queries for the whole dataset."""
    rows = []
    for k in progress_bar(check_ks(model, ks), desc="accuracy by K", show=progress):
        m = evaluate(
            model, loader, forward_kwargs={"num_queries": k}, device=device, progress=progress, desc=f"K={k}"
        )
        rows.append({"k": k, "top1": m["top1"], "loss": m["loss"]})
    return rows


def random_subset_accuracy(
    model: nn.Module,
    loader: Iterable[Any],
    ks: Sequence[int],
    *,
    reps: int = 5,
    seed: int = 0,
    device: str = "cpu",
    progress: bool = False,
) -> list[dict[str, Any]]:
    """``[{"k", "top1_mean", "top1_std", "top1_reps"}]``: each repetition draws one random
    ``k``-subset of the queries and uses it for the whole dataset (the paper's baseline)."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    total = query_budget(model, needed_by="the Perceiver tables")
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k in progress_bar(check_ks(model, ks), desc=f"random K subsets ({reps} each)", show=progress):
        accs = []
        for rep in range(reps):
            index = torch.randperm(total, generator=g)[:k].sort().values.to(device)
            kwargs = {"query_index": index}
            desc = f"K={k}, draw {rep + 1}"
            accs.append(
                evaluate(model, loader, forward_kwargs=kwargs, device=device, progress=progress, desc=desc)[
                    "top1"
                ]
            )
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        rows.append({"k": k, "top1_mean": statistics.fmean(accs), "top1_std": std, "top1_reps": accs})
    return rows


def cost_by_k(
    model: nn.Module,
    ks: Sequence[int],
    *,
    batch: Tensor,
    warmup: int = 2,
    runs: int = 5,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """``[{"k", "gflops", "ms_per_batch", "img_per_s", "rel_time"}]`` on ``batch [B, C, H, W]``.

    ``gflops`` is multiply-adds per image in billions (the papers' convention); the
    times are medians of ``runs`` after ``warmup``, the K values timed round-robin
    (:func:`~leanformer.bench.timing.time_interleaved`) so that load or clock changes
    during the run hit every K alike and their ratios stay comparable.
    """
    model.eval()
    ks = check_ks(model, ks)
    # rel_time is against all Q queries (the paper's table 1), timed too when not asked.
    full_k = query_budget(model, needed_by="the Perceiver tables")
    fns = {k: (lambda k=k: model(batch, num_queries=k)) for k in sorted({*ks, full_k})}
    with torch.inference_mode():
        seconds = time_interleaved(fns, warmup=warmup, runs=runs, progress=progress)
    full = seconds[full_k]
    return [
        {
            "k": k,
            "gflops": count_gflops(model, (batch,), forward_kwargs={"num_queries": k}),
            "ms_per_batch": seconds[k] * 1e3,
            "img_per_s": len(batch) / seconds[k],
            "rel_time": seconds[k] / full,
            "threads": torch.get_num_threads(),
        }
        for k in ks
    ]


def dqs_sweep(
    model: nn.Module,
    loader: Iterable[Any],
    thresholds: Sequence[float],
    *,
    rule: str = "any",
    device: str = "cpu",
    progress: bool = False,
) -> list[dict[str, Any]]:
    """``[{"threshold", "rule", "kept_mean", "kept_std", "kept_min", "kept_max", "top1"}]``."""
    query_budget(model, needed_by="the DQS sweep")
    rows = []
    for t in progress_bar(thresholds, desc="DQS thresholds", show=progress):
        counts: list[Tensor] = []

        def collect(m: nn.Module, counts: list[Tensor] = counts) -> None:
            assert isinstance(m, VisualPerceiver)
            kept = m.last_kept_counts
            assert kept is not None  # a DQS forward sets it
            counts.append(kept.detach().float().cpu())

        m = evaluate(
            model,
            loader,
            forward_kwargs={"dqs_threshold": float(t), "dqs_rule": rule},
            device=device,
            after_batch=collect,
            progress=progress,
            desc=f"t={t}",
        )
        c = torch.cat(counts)
        rows.append(
            {
                "threshold": float(t),
                "rule": rule,
                "kept_mean": float(c.mean()),
                "kept_std": float(c.std()) if c.numel() > 1 else 0.0,
                "kept_min": int(c.min()),
                "kept_max": int(c.max()),
                "top1": m["top1"],
                "loss": m["loss"],
            }
        )
    return rows


@torch.inference_mode()
def dqs_timing(
    model: VisualPerceiver,
    batch: Tensor,
    threshold: float,
    *,
    rule: str = "any",
    warmup: int = 2,
    runs: int = 5,
) -> dict[str, Any]:
    """Time of a DQS forward vs the fixed-K' forward at its average kept count K'.

    Also times the selection itself (similarities, keep mask, positions, grouping) on
    the cross-attention outputs of ``batch``, as a share of the full-Q forward, and
    reports the load-independent attention work of the mixed counts relative to the
    fixed-K' batch: ``sum(n_i^2) / (B K'^2)``, and the same with every input padded to
    its bucket's longest count.
    """
    model.eval()
    total = query_budget(model, needed_by="the Perceiver tables")
    model(batch, dqs_threshold=threshold, dqs_rule=rule)
    counts = model.last_kept_counts
    assert counts is not None
    k_avg = float(counts.float().mean())
    k_fixed = min(total, max(1, round(k_avg)))
    queries = model.candidate_queries(len(batch))
    mixed = model.cross.mix(queries, model.embed(batch))

    padding = float(getattr(model, "dqs_max_padding", 0.0))
    buckets = bucket_counts(counts, max_padding=padding)
    fixed_work = len(batch) * k_fixed**2

    def select() -> None:
        keep = select_queries(mixed, threshold, rule=rule)  # type: ignore[arg-type]
        _, c = kept_positions(keep)
        bucket_counts(c, max_padding=padding)

    seconds = time_interleaved(
        {
            "dqs": lambda: model(batch, dqs_threshold=threshold, dqs_rule=rule),
            "fixed": lambda: model(batch, num_queries=k_fixed),
            "full": lambda: model(batch),
            "select": select,
        },
        warmup=warmup,
        runs=runs,
    )
    row: dict[str, Any] = {
        "threshold": threshold,
        "rule": rule,
        "batch_size": len(batch),
        "kept_mean": k_avg,
        "kept_min": int(counts.min()),
        "kept_max": int(counts.max()),
        "groups": len(torch.unique(counts)),
        "buckets": len(buckets),
        "k_fixed": k_fixed,
        "attention_work": float(counts.double().square().sum()) / fixed_work,
        "attention_work_padded": sum(len(idx) * longest**2 for _, longest, idx in buckets) / fixed_work,
        **{f"ms_{name}": sec * 1e3 for name, sec in seconds.items()},
    }
    row["dqs_vs_fixed"] = row["ms_dqs"] / row["ms_fixed"]
    row["select_share"] = row["ms_select"] / row["ms_full"]
    return row


def _fmt(value: Any) -> str:
    # Values below 1 (GMACs of small models, ratios) keep 4 significant digits; 2 decimals
    # would print e.g. 0.0123 GMACs as 0.01.
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}" if abs(value) < 1 else f"{value:.2f}"
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]] | None = None) -> str:
    """Rows as a markdown table; ``columns`` = ``[(key, header), ...]`` (default: every key)."""
    if not rows:
        return ""
    keys = columns or [(k, k) for k in rows[0]]
    return render_table(rows, [column(key, header, _fmt, right=True) for key, header in keys])


def plot_perceiver(
    curves: dict[str, Sequence[dict[str, Any]]],
    path: str | Path,
    *,
    cost: Sequence[dict[str, Any]] | None = None,
    baseline: Sequence[dict[str, Any]] | None = None,
    dqs: Sequence[dict[str, Any]] | None = None,
    title: str = "",
) -> Path:
    """Accuracy vs K (with the random baseline and the DQS curve), and vs GMACs and time.

    ``curves``: name -> :func:`accuracy_by_k` rows; ``cost``: :func:`cost_by_k` rows
    (adds the GMACs and time panels); ``dqs``: :func:`dqs_sweep` rows, drawn at their
    average kept count with std (thick) and min-max (thin) horizontal bars.
    """
    by_k = {r["k"]: r for r in cost or []}
    panels = [("k", "number of queries K")] + (
        [("gflops", "GMACs / image"), ("ms_per_batch", "ms / batch")] if cost else []
    )
    fig = Figure(figsize=(5.0 * len(panels), 4.0), constrained_layout=True)
    FigureCanvasAgg(fig)
    for col, (key, label) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), col + 1)
        for name, rows in curves.items():
            pts = [
                (r["k"] if key == "k" else by_k[r["k"]][key], r["top1"])
                for r in rows
                if r["k"] in by_k or key == "k"
            ]
            ax.plot(*zip(*pts, strict=True), marker="o", markersize=4, label=name)
        if key == "k" and baseline:
            ax.errorbar(
                [r["k"] for r in baseline],
                [r["top1_mean"] for r in baseline],
                yerr=[r["top1_std"] for r in baseline],
                marker="s",
                markersize=4,
                capsize=3,
                label="random K-subset (mean ± std)",
            )
        if key == "k" and dqs:
            xs, ys = [r["kept_mean"] for r in dqs], [r["top1"] for r in dqs]
            lo = [r["kept_mean"] - r["kept_min"] for r in dqs]
            hi = [r["kept_max"] - r["kept_mean"] for r in dqs]
            ax.errorbar(xs, ys, xerr=[lo, hi], fmt="none", ecolor="tab:red", elinewidth=0.8, capsize=2)
            ax.errorbar(
                xs,
                ys,
                xerr=[r["kept_std"] for r in dqs],
                fmt="D-",
                color="tab:red",
                elinewidth=2.5,
                markersize=4,
                label="DQS (average K)",
            )
        if key == "k":
            ax.set_xscale("log", base=2)
        style_accuracy_axis(ax, label, legend=col == 0, legend_loc="lower right")
    return save_figure(fig, path, title)


ACCURACY_COLUMNS = [("k", "K"), ("top1", "top-1 %")]
COST_COLUMNS = [("k", "K"), ("gflops", "GMACs"), ("ms_per_batch", "ms / batch"), ("rel_time", "rel. time")]
DQS_COLUMNS = [
    ("threshold", "t"),
    ("kept_mean", "avg K"),
    ("kept_std", "std"),
    ("kept_min", "min"),
    ("kept_max", "max"),
    ("top1", "top-1 %"),
]
