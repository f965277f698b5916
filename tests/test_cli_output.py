"""What the command line prints: defaults in --help, the same JSON keys for every model and
option, integer counts, figures named for what they are, files that do not overwrite
each other, and the allocator set at start-up."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from leanformer.allocator import SETTINGS, configure_allocator
from leanformer.cli import build_parser, main

Capture = pytest.CaptureFixture[str]
BENCH = ["bench", "--runs", "1", "--warmup", "0"]


def _rows(capsys: Capture) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += _parsers(sub)
    return found


def test_help_names_every_default() -> None:
    """Every option whose default is a value shows it in --help."""
    missing = []
    for parser in _parsers(build_parser()):
        for action in parser._actions:
            default = action.default
            if not action.option_strings or default in (None, False, argparse.SUPPRESS) or default == []:
                continue
            if "default" not in (parser._get_formatter()._get_help_string(action) or ""):
                missing.append(f"{parser.prog} {action.option_strings[0]}")
    assert missing == []
    bench_help = next(p for p in _parsers(build_parser()) if p.prog == "leanformer bench").format_help()
    assert "(default: 10)" in bench_help and "(default: 3)" in bench_help


def test_train_help_names_the_built_in_config_values() -> None:
    """train's config flags default to "not given"; their help names what stands then."""
    from leanformer.config import RunConfig

    train = next(p for p in _parsers(build_parser()) if p.prog == "leanformer train")
    helps = {a.option_strings[0]: a.help or "" for a in train._actions if a.option_strings}
    built_in = RunConfig()
    for flag, value in (
        ("--model", built_in.model),
        ("--data", built_in.data.name),
        ("--batch-size", built_in.data.batch_size),
        ("--lr", built_in.optim.lr),
        ("--epochs", built_in.optim.epochs),
        ("--distill-tau", built_in.train.distill_tau),
    ):
        assert f"(default: {value}, unless --config or the run --resume continues sets it)" in helps[flag], (
            flag
        )
    assert "default" not in helps["--pool"]  # the model's own, which differs by model


def test_bench_rows_have_the_same_keys(capsys: Capture) -> None:
    runs = [
        ["--model", "deit_test"],
        ["--model", "deit_test", "--pool", "kmeans", "--keep", "0.5", "--no-memory"],
        ["--model", "deit_test", "--img-size", "32", "--carry", "--pool", "merge", "--keep", "0.5"],
    ]
    rows = []
    for argv in runs:
        assert main([*BENCH, *argv, "--json"]) == 0
        rows += _rows(capsys)
    assert len({tuple(row) for row in rows}) == 1, [sorted(row) for row in rows]
    assert [row["img_size"] for row in rows] == [16, 16, 32]
    assert rows[1]["peak_mem_mb"] is None and rows[0]["pool"] is None
    assert all(isinstance(row["threads"], int) and isinstance(row["batch_size"], int) for row in rows)


def test_bench_text_names_the_memory_figure(capsys: Capture) -> None:
    assert main([*BENCH, "--model", "deit_test"]) == 0
    out = capsys.readouterr().out
    assert "forward activations peak" in out and "peak memory" not in out


def test_eval_counts_are_integers(tmp_path: Path, capsys: Capture) -> None:
    argv = ["eval", "--model", "deit_test", "--img-size", "16", "--data.limit_test", "12", "--json"]
    assert main(argv) == 0
    (row,) = _rows(capsys)
    assert row["n"] == 12 and isinstance(row["n"], int)


def test_unknown_family_is_an_error(capsys: Capture) -> None:
    assert main(["models", "--family", "nope"]) == 2
    assert "unknown family 'nope'" in capsys.readouterr().err
    assert main(["models", "--family", "deti"]) == 2
    assert "did you mean" in capsys.readouterr().err
    assert main(["models", "--family", "deit", "--json"]) == 0
    assert {row["family"] for row in _rows(capsys)} == {"deit"}


def test_visualize_enact_figures_do_not_overwrite_each_other(
    tmp_path: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from leanformer.commands.visualize_enact import default_out

    monkeypatch.chdir(tmp_path)
    argv = ["visualize", "--json", "enact", "--image", "noise", "--stride", "32", "--sigma", "3"]
    assert main(argv) == 0
    (row,) = _rows(capsys)
    assert row["out"] == "runs/enact_noise_seed0_s32_sigma3.png" and (tmp_path / row["out"]).is_file()
    # Other inputs and settings get other files: a file of a bundled image's stem, two
    # files of one stem, and two checkpoints of one run among them.
    for checkpoint in ("last", "best"):
        (tmp_path / "run" / f"{checkpoint}.safetensors").parent.mkdir(exist_ok=True)
        (tmp_path / "run" / f"{checkpoint}.safetensors").touch()
    parser = build_parser()
    names = {
        str(default_out(parser.parse_args(["visualize", "enact", *flags]), name, sigma))
        for flags, name, sigma in (
            ([], "china", 3.0),
            (["--image", "flower"], "flower", 3.0),
            (["--sigma", "0"], "china", 0.0),
            (["--stride", "8"], "china", 3.0),
            (["--image", "noise", "--seed", "1"], "noise", 3.0),
            (["--input", "photo.jpg"], "photo.jpg", 3.0),
            (["--input", "photo.png"], "photo.png", 3.0),
            (["--input", "a/china.jpg"], "china.jpg", 3.0),
            (["--checkpoint", "run/last.safetensors"], "china", 3.0),
            (["--checkpoint", "run/best.safetensors"], "china", 3.0),
        )
    }
    assert len(names) == 10 and row["out"] not in names


def test_visualize_enact_shows_a_checkpoint_with_its_own_sigma(
    tmp_path: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The figure shows what the trained layer computes: its sigma, unless --sigma is given.
    from leanformer import create_model
    from leanformer.engine.checkpoint import save_checkpoint

    monkeypatch.chdir(tmp_path)
    model = create_model("detr_encoder_test", attention="enact")
    trained_sigma = model.layers[0].self_attn.sigma
    assert trained_sigma != 3.0  # the default of an untrained layer
    meta = {"model_name": "detr_encoder_test", "model_options": {"attention": "enact"}, "epoch": 1}
    save_checkpoint(tmp_path / "run" / "last.safetensors", model=model, meta=meta)
    argv = ["visualize", "--json", "enact", "--image", "noise", "--checkpoint", "run/last.safetensors"]
    assert main(argv) == 0
    (row,) = _rows(capsys)
    assert row["sigma"] == trained_sigma
    assert row["out"] == f"runs/enact_noise_seed0_s16_sigma{trained_sigma:g}_run-last.png"
    assert main([*argv, "--sigma", "0"]) == 0
    assert _rows(capsys)[0]["sigma"] == 0.0


def test_allocator_settings_respect_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    for variable, _, _ in SETTINGS:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("MALLOC_TOP_PAD_", "0")  # given by the user: left alone
    applied = configure_allocator()
    assert applied == {"MALLOC_MMAP_THRESHOLD_": 33554432, "MALLOC_TRIM_THRESHOLD_": 2**31 - 1}
    monkeypatch.setenv("LEANFORMER_DEFAULT_MALLOC", "1")
    assert configure_allocator() == {}


_MMAPPED_BYTES = """
import ctypes, sys
{configure}
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
block = libc.malloc(16 << 20)  # a 16 MB activation
print(libc.mallinfo2().hblkhd)  # bytes malloc took straight from mmap
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
def test_allocator_keeps_large_blocks_in_the_heap() -> None:
    """glibc alone serves a 16 MB block by mmap (and unmaps it on free); after
    ``configure_allocator`` it comes from the heap, as with the Makefile's variables."""
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("glibc older than 2.33")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    # The module alone, not the package (which imports torch): two fast processes.
    module = Path(__file__).resolve().parents[1] / "src" / "leanformer" / "allocator.py"
    configure = (
        "import importlib.util as u; spec = u.spec_from_file_location('allocator', "
        f"{str(module)!r}); m = u.module_from_spec(spec); spec.loader.exec_module(m); "
        "m.configure_allocator()"
    )

    def mmapped(code: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return int(done.stdout.strip())

    assert mmapped(_MMAPPED_BYTES.format(configure="")) >= 16 << 20
    assert mmapped(_MMAPPED_BYTES.format(configure=configure)) < 16 << 20
