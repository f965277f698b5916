"""Config options declared once: a flag, a YAML key and a dotted override give one config."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from leanformer.apps.sweep_config import SweepConfig, load_sweep_config
from leanformer.cli import build_parser, main
from leanformer.commands import demo_deit, demo_drrt, demo_perceiver, demo_sret, tradeoff, train
from leanformer.commands._options import add_config_flags, config_flags_given
from leanformer.config import Flag, declared_flags, load_config, positive_int, positive_number, to_dict
from leanformer.pooling.budgets import parse_keep

# A value each kind of flag accepts, as typed; a new kind needs a sample here.
SAMPLES = {
    bool: "true",
    int: "3",
    float: "0.25",
    str: "abc",
    positive_int: "3",
    positive_number: "0.25",
    parse_keep: "0.5",
}
FLAGS = list(declared_flags())


def _yaml(key: str, text: str) -> str:
    """``optim.lr``, ``0.25`` -> ``"optim:\\n  lr: 0.25\\n"``."""
    parts = key.split(".")
    return "".join(f"{'  ' * depth}{part}:\n" for depth, part in enumerate(parts[:-1])) + (
        f"{'  ' * (len(parts) - 1)}{parts[-1]}: {text}\n"
    )


@pytest.mark.parametrize(("key", "spec"), FLAGS, ids=[key for key, _ in FLAGS])
def test_flag_yaml_and_dotted_override_agree(key: str, spec: Flag, tmp_path: Path) -> None:
    text = SAMPLES[spec.type]
    parser = argparse.ArgumentParser()
    add_config_flags(parser, key)
    args = parser.parse_args([spec.name] if spec.type is bool else [spec.name, text])
    path = tmp_path / "run.yaml"
    path.write_text(_yaml(key, text))

    from_flag = load_config(None, config_flags_given(args))
    from_yaml = load_config(path)
    from_dotted = load_config(None, {key: text})
    assert to_dict(from_flag) == to_dict(from_yaml) == to_dict(from_dotted) != to_dict(load_config())


def test_every_flag_is_unique_and_offered_by_train(capsys: pytest.CaptureFixture[str]) -> None:
    names = [spec.name for _, spec in FLAGS]
    assert len(names) == len(set(names))
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    # --compile is an evaluation option (eval); every other option can be set for training.
    assert [name for name in names if not re.search(rf"{name}\b(?!-)", text)] == ["--compile"]


def test_train_flags_then_dotted_overrides_win() -> None:
    argv = ["train", "--config", "configs/train_deit_digits.yaml", "--lr", "3e-4", "--keep", "0.5"]
    argv += ["--opt", "keep=0.7", "--opt", "depth=2", "--optim.epochs", "2"]
    args, extra = build_parser().parse_known_args(argv)
    args.extra, args.given_options = extra, set()
    cfg = train.build_config(args)
    assert cfg.optim.lr == pytest.approx(3e-4) and cfg.optim.epochs == 2
    # A flag of its own (--keep) wins over --opt keep=...
    assert cfg.model_options == {"keep": parse_keep(0.5), "depth": 2}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--lr", "fast"], "leanformer train: error: argument --lr: expected a number, got 'fast'"),
        (["train", "--epochs", "2.5"], "argument --epochs: expected an integer, got '2.5'"),
        (["train", "--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
        (["train", "--keep", "nope"], "argument --keep: unknown keep preset 'nope'"),
        (["train", "--optim.lrr", "1"], "unknown config key 'optim.lrr'; did you mean lr?"),
    ],
)
def test_bad_values_are_one_line_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code  # argparse's own usage errors
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err


def test_eval_compile_flag_reaches_the_config(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import leanformer.bench.compiled as compiled

    monkeypatch.setattr(compiled, "compile_model", lambda model: model)  # eager stand-in
    argv = ["eval", "--model", "deit_test", "--img-size", "8", "--data.limit_test", "8", "--json"]
    for extra, expected in (([], False), (["--compile"], True)):
        assert main([*argv, *extra]) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["compiled"] is expected


# Each sweep flag as typed, and the same value as its sweep file would hold it.
SWEEP_SAMPLES = {
    "methods": (["--methods", "merge, kmeans"], "[merge, kmeans]"),
    "budgets": (["--budget", "0.5", "--budget", "r16", "--budget", "12,8"], "[0.5, r16, [12, 8]]"),
    "finetune_epochs": (["--finetune-epochs", "2"], "2"),
    "throughput": (["--no-throughput"], "false"),
    "compile": (["--compile"], "true"),
    "task": (["--task", "segmentation"], "segmentation"),
}
SWEEP_FLAGS = list(declared_flags(SweepConfig, nested=False))


def test_every_sweep_flag_has_a_sample() -> None:
    assert sorted(key for key, _ in SWEEP_FLAGS) == sorted(SWEEP_SAMPLES)


@pytest.mark.parametrize("key", sorted(SWEEP_SAMPLES))
def test_sweep_flag_and_sweep_file_agree(key: str, tmp_path: Path) -> None:
    argv, yaml_text = SWEEP_SAMPLES[key]
    base = "model: deit_test\nbudgets: [0.7]\n"
    parser = argparse.ArgumentParser()
    add_config_flags(parser, schema=SweepConfig, nested=False)
    overrides = config_flags_given(parser.parse_args(argv), schema=SweepConfig, nested=False)
    assert list(overrides) == [key]  # the other flags stay "not given"

    plain = tmp_path / "plain.yaml"
    plain.write_text(base)
    edited = tmp_path / "edited.yaml"
    # The flag's value replaces the file's, as a YAML key written in its place would.
    lines = [line for line in base.splitlines(keepends=True) if not line.startswith(f"{key}:")]
    edited.write_text("".join(lines) + f"{key}: {yaml_text}\n")
    from_flag = load_sweep_config(plain, overrides)
    assert from_flag == load_sweep_config(edited) != load_sweep_config(plain)


def test_tradeoff_command_takes_the_declared_sweep_flags() -> None:
    args = build_parser().parse_args(
        [
            "tradeoff",
            "--preset",
            "tradeoff_digits",
            "--methods",
            "merge",
            "--budget",
            "0.4",
            "--no-throughput",
        ]
    )
    assert tradeoff.overrides_from_args(args) == {"methods": ["merge"], "budgets": [0.4], "throughput": False}


def test_a_bad_budget_flag_is_a_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["tradeoff", "--preset", "tradeoff_digits", "--budget", "nope"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert "argument --budget: unknown keep preset 'nope'" in err


DEMOS = [demo_deit, demo_drrt, demo_perceiver, demo_sret]


@pytest.mark.parametrize("demo", DEMOS, ids=[d.COMMAND[1] for d in DEMOS])
def test_demo_training_flags_are_the_run_config_flags(demo, capsys: pytest.CaptureFixture[str]) -> None:
    # Without flags a demo trains with its own defaults; each flag is checked as `train`'s is.
    args = build_parser().parse_args(list(demo.COMMAND))
    assert config_flags_given(args, *demo.TRAINING) == demo.TRAINING
    for key in demo.TRAINING:
        name = dict(FLAGS)[key].name
        with pytest.raises(SystemExit) as exit_:
            main([*demo.COMMAND, name, "0"])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and len(err.splitlines()) == 1
        assert f"argument {name}: must be > " in err or f"argument {name}: must be >= 1" in err
