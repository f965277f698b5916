"""``--compile`` for bench, eval and the trade-off harness: the compiled model is what runs,
the compile time is reported apart, and eval refuses what cannot compile (DQS)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from leanformer.apps.sweep_config import sweep_config_from_dict
from leanformer.bench import compiled as compiled_module
from leanformer.bench.report import bench_model
from leanformer.cli import main


class Affine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).flatten(1)


def test_bench_model_times_the_compiled_model_and_reports_compile_time(monkeypatch) -> None:
    calls: list[str] = []

    def fake_compile(model: nn.Module) -> nn.Module:
        calls.append(type(model).__name__)

        class Recording(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                calls.append("compiled forward")
                return model(x)

        return Recording()

    monkeypatch.setattr(compiled_module, "compile_model", fake_compile)
    x = torch.randn(2, 3)
    eager = bench_model(Affine(), (x,), warmup=0, runs=2, memory=False)
    assert eager["compile_s"] is None and calls == []
    row = bench_model(Affine(), (x,), warmup=0, runs=2, memory=False, compile=True)
    assert calls[0] == "Affine"
    assert calls.count("compiled forward") == 1 + 2  # the compiling call, then the timed runs
    assert isinstance(row["compile_s"], float) and row["compile_s"] >= 0
    assert set(row) == set(eager)


def test_compiled_on_the_cpu_gives_no_memory_figure_rather_than_a_wrong_one(monkeypatch) -> None:
    """The CPU profiler does not see the buffers compiled code allocates (a whole compiled
    DeiT measured a few bytes), so a compiled CPU row says None; eager rows keep theirs."""
    monkeypatch.setattr(compiled_module, "compile_model", lambda model: model)
    x = torch.randn(2, 3)
    eager = bench_model(Affine(), (x,), warmup=0, runs=1, memory=True)
    assert eager["peak_mem_mb"] is not None and eager["peak_mem_mb"] > 0
    assert bench_model(Affine(), (x,), warmup=0, runs=1, memory=True, compile=True)["peak_mem_mb"] is None


def test_any_number_of_models_compile_in_one_process() -> None:
    """Each model of another shape is another compiled version of the forwards they share;
    dynamo's default limit of 8 versions made the ninth a hard error with fullgraph=True.
    Twelve models of different widths, each called at two batch sizes, all kept alive
    and called again afterwards (as the interleaved benchmarks do)."""
    torch._dynamo.reset()

    class Scaled(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    models = []
    for width in range(1, 13):
        model = compiled_module.compile_model(Scaled(width), backend="eager")
        for batch in (2, 3):
            assert model(torch.ones(batch, width)).shape == (batch, width)
        models.append((width, model))
    for width, model in models:
        torch.testing.assert_close(model(torch.ones(2, width)), torch.ones(2, width))


def test_compiled_model_runs_fullgraph_and_matches_eager() -> None:
    torch._dynamo.reset()
    model, seconds = compiled_module.compile_for_inference(Affine(), (torch.ones(2, 3),))
    assert seconds > 0
    with torch.inference_mode():
        torch.testing.assert_close(model(torch.ones(2, 3)), torch.full((2, 3), 2.0))


def test_cli_flags(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setattr(compiled_module, "compile_model", lambda model: model)  # eager stand-in
    argv = ["bench", "--model", "deit_test", "--runs", "1", "--warmup", "0", "--no-memory", "--json"]
    assert main([*argv, "--compile"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert isinstance(row["compile_s"], float)
    assert sweep_config_from_dict({"model": "deit_test", "budgets": [0.5], "compile": True}).compile is True
    for command in ("bench", "eval", "tradeoff"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--compile" in capsys.readouterr().out


def test_a_layer_that_breaks_the_graph_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    # ENACT sizes its clusters from a host read: dynamo would fail mid-trace with a
    # data-dependent guard error; the refusal names the layer and the reason instead.
    from leanformer.layers.enact_attention import EntropyClusteredAttention

    with pytest.raises(
        ValueError, match=r"0 \(EntropyClusteredAttention\) cannot be compiled into one graph"
    ):
        compiled_module.compile_model(nn.Sequential(EntropyClusteredAttention(8, 2)))
    # PyTorch's fused recurrences (DRRT's default tanh recurrence): dynamo does not wrap them.
    with pytest.raises(ValueError, match=r"^1 \(GRU\) cannot be compiled into one graph.*fused recurrent"):
        compiled_module.compile_model(nn.Sequential(nn.Identity(), nn.GRU(2, 2)))
    argv = ["bench", "--model", "detr_encoder_test", "--attention", "enact", "--feature-size", "6x7"]
    assert main([*argv, "--runs", "1", "--warmup", "0", "--no-memory", "--compile"]) == 2
    assert "largest region count on the host" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "eval"])
def test_compiled_dynamic_query_selection_is_refused(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The number of queries DQS keeps depends on the data: bench used to fail in dynamo.
    argv = [command, "--model", "visual_perceiver_test", "--compile", "--dqs-threshold", "0.5"]
    argv += (
        ["--runs", "1", "--warmup", "0", "--no-memory"] if command == "bench" else ["--data.limit_test", "8"]
    )
    assert main(argv) == 2
    assert "--compile cannot run dynamic query selection" in capsys.readouterr().err
