"""`leanformer bench --hf-model detr`: dense and ENACT rows side by side; misuse is refused."""

from __future__ import annotations

import json

import pytest

from leanformer.cli import main

pytest.importorskip("transformers")

TINY = [
    *("--opt", "backbone=resnet18", "--opt", "d_model=32", "--opt", "encoder_layers=2"),
    *(
        "--opt",
        "decoder_layers=1",
        "--opt",
        "encoder_attention_heads=4",
        "--opt",
        "decoder_attention_heads=4",
    ),
    *("--opt", "encoder_ffn_dim=64", "--opt", "decoder_ffn_dim=64", "--opt", "num_queries=5"),
]


@pytest.mark.slow
def test_bench_hf_detr_reports_dense_and_enact(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = [
        "bench",
        "--hf-model",
        "detr",
        "--attention",
        "enact",
        "--img-size",
        "192x256",
        "--batch-size",
        "2",
    ]
    argv += [
        *TINY,
        "--scopes",
        "encoder_fwd,model_fwd",
        "--runs",
        "1",
        "--warmup",
        "0",
        "--no-memory",
        "--json",
    ]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [r["scope"] for r in rows] == ["encoder_fwd", "model_fwd"]
    for r in rows:
        assert r["model"] == "detr-resnet18" and r["img_size"] == "192x256" and r["feature_size"] == "6x8"
        assert 0 < r["cluster_ratio"] < 1 and len(r["cluster_ratio_per_layer"]) == 2
        assert r["time_ratio"] == pytest.approx(r["enact_ms"] / r["dense_ms"], rel=0.01)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hf-model", "detr", "--model", "deit_test"], "does not take --model"),
        # Flags of the other paths that the DETR comparison would silently not honour.
        (["--hf-model", "detr", "--compile"], "does not take --compile"),
        (["--hf-model", "detr", "--pretrained"], "does not take --pretrained"),
        (["--hf-model", "detr", "--timm-model", "deit_tiny_patch16_224"], "does not take --timm-model"),
        (["--hf-model", "detr", "--dqs-rule", "kept"], "does not take --dqs-rule"),
        (["--hf-model", "detr", "--attention", "dense"], "--attention enact, not 'dense'"),
        (["--hf-model", "detr", "--opt", "bakbone=resnet18"], "DetrConfig has no field bakbone"),
        (["--hf-model", "vit"], "'vit' is not a transformers model class"),
        (["--model", "deit_test", "--img-size", "32x48"], "--img-size HxW is for --hf-model detr"),
    ],
)
def test_bench_hf_detr_refuses_misuse(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err
