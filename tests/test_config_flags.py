"""Config options declared once: a flag, a YAML key and a dotted override give one config."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from leanformer.cli import build_parser, main
from leanformer.commands import train
from leanformer.commands._options import add_config_flags, config_flags_given
from leanformer.config import Flag, declared_flags, load_config, positive_int, to_dict
from leanformer.layers.budgets import parse_keep

# A value each kind of flag accepts, as typed; a new kind needs a sample here.
SAMPLES = {bool: "true", int: "3", float: "0.25", str: "abc", positive_int: "3", parse_keep: "0.5"}
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
        (["train", "--lr", "fast"], "leanformer train: error: argument --lr: invalid float value: 'fast'"),
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
