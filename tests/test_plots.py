"""The trade-off plot: every method gets a line no other method shares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from matplotlib.colors import to_hex

from leanformer.apps import plots


@pytest.mark.parametrize("n_methods", [3, 10, 12, 25])
def test_every_method_of_a_sweep_is_drawn_in_its_own_style(
    n_methods: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows: list[dict[str, Any]] = [{"method": "none", "gflops": 1.0, "top1": 90.0, "img_per_s": 100.0}]
    for m in range(n_methods):
        for g in (0.5, 0.7):
            rows.append({"method": f"m{m}", "gflops": g, "top1": 80.0 + m, "img_per_s": 200.0 / g})
    figures: list[Any] = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, title=None: figures.append(fig) or Path(path))
    plots.plot_tradeoff(rows, tmp_path / "t.png")
    (fig,) = figures
    for ax in fig.axes:  # top-1 against GFLOPs, and against img/s
        lines = {ln.get_label(): ln for ln in ax.get_lines() if ln.get_label().startswith("m")}
        assert sorted(lines) == sorted(f"m{m}" for m in range(n_methods))
        # the line itself differs (colour or dash), not only its small markers
        looks = {(to_hex(ln.get_color()), ln.get_linestyle()) for ln in lines.values()}
        assert len(looks) == n_methods
