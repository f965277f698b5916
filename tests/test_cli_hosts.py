"""`leanformer bench` / `eval` with --timm-model and --hf-model (tiny random-weight models)."""

from __future__ import annotations

import json

import pytest

from leanformer.cli import main

pytest.importorskip("transformers")

TINY_TIMM = ["--opt", "depth=2", "--opt", "img_size=32", "--opt", "patch_size=8"]
TINY_HF = ["--opt", "num_hidden_layers=2", "--opt", "image_size=32", "--opt", "patch_size=8"]
QUICK = ["--runs", "1", "--warmup", "0", "--no-memory", "--json"]


def _rows(capsys: pytest.CaptureFixture[str]) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_bench_timm_model_gflops_follow_the_budget(capsys: pytest.CaptureFixture[str]) -> None:
    rows = []
    for pool in ([], ["--pool", "wkmedoids", "--keep", "0.5"], ["--pool", "merge", "--keep", "r4"]):
        assert main(["bench", "--timm-model", "vit_small_patch16_224", *TINY_TIMM, *pool, *QUICK]) == 0
        rows += _rows(capsys)
    plain, half, tome = rows
    assert half["pool"] == "wkmedoids" and half["keep"] == 0.5 and half["carry"] is True
    assert tome["keep"] == "r4"  # 16 patches -> 12 -> 8
    assert half["gflops"] < tome["gflops"] < plain["gflops"]
    assert plain["params_m"] == half["params_m"]


def test_bench_hf_model_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            ["bench", "--hf-model", "SiglipVisionModel", *TINY_HF, "--pool", "merge", "--keep", "0.5", *QUICK]
        )
        == 0
    )
    (row,) = _rows(capsys)
    assert row["model"] == "hf:SiglipVisionModel" and row["img_size"] == 32 and row["gflops"] > 0
    assert main(["bench", "--hf-model", "ViTForImageClasification", *QUICK]) == 2
    assert "did you mean ViTForImageClassification" in capsys.readouterr().err
    assert main(["bench", "--hf-model", "ViTModel", "--opt", "hidden_sise=8", *QUICK]) == 2
    assert "ViTConfig has no field 'hidden_sise'" in capsys.readouterr().err
    assert main(["bench", "--timm-model", "vit_small_patch16_224", *TINY_TIMM, "--keep", "0.5", *QUICK]) == 2
    assert "--keep and --carry need --pool" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(
    "source",
    [
        ["--timm-model", "vit_tiny_patch16_224", *TINY_TIMM],
        ["--hf-model", "ViTForImageClassification", *TINY_HF],
    ],
)
def test_eval_host_models_on_digits(source: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # digits are 32x32 grey images with 10 classes: the host takes them from the data.
    argv = ["eval", *source, "--data", "digits", "--pool", "powerbert", "--keep", "0.5", "--json"]
    assert main(argv) == 0
    (row,) = _rows(capsys)
    assert row["n"] > 0 and 0.0 <= row["top1"] <= 100.0 and row["pool"] == "powerbert"
