"""YAML files and values: a key given twice is refused, naming it and its lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from leanformer.cli import main
from leanformer.strict_yaml import DuplicateKeyError, safe_load_strict


def test_duplicate_keys_are_refused_at_any_depth() -> None:
    assert safe_load_strict("a: 1\nb: {c: 2}\n") == {"a": 1, "b": {"c": 2}}
    with pytest.raises(DuplicateKeyError, match=r"duplicate key 'optim' on line 2 \(first on line 1\)"):
        safe_load_strict("optim: {lr: -5}\noptim: {epochs: 1}\n")
    with pytest.raises(DuplicateKeyError, match="duplicate key 'lr' on line 3"):
        safe_load_strict("optim:\n  lr: 1\n  lr: 2\n")
    with pytest.raises(DuplicateKeyError, match="duplicate key 'a'"):
        safe_load_strict("{a: 1, a: 1}")  # even with the same value: one of them is a typo


def test_what_yaml_allows_stays_allowed() -> None:
    # A merge key then one key of the merged mapping overridden is YAML's own rule.
    text = "base: &b {lr: 1, epochs: 2}\nrun:\n  <<: *b\n  lr: 3\n"
    assert safe_load_strict(text)["run"] == {"lr": 3, "epochs": 2}
    assert safe_load_strict("[{a: 1}, {a: 2}]") == [{"a": 1}, {"a": 2}]  # one key per mapping


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(
    ("command", "text"),
    [
        ("train", "model: deit_test\noptim: {lr: -5}\noptim: {epochs: 1}\n"),
        ("tradeoff", "model: deit_test\nbudgets: [0.5]\nbudgets: [0.7]\n"),
    ],
)
def test_cli_refuses_a_config_file_with_a_key_twice(
    command: str, text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(text)
    before = _files(tmp_path)
    assert main([command, "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(config) in err and "duplicate key" in err and "on line 3 (first on line 2)" in err
    assert _files(tmp_path) == before  # nothing was written


def test_a_dotted_override_with_a_key_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["eval", "--model", "deit_test", "--data.options", "{validation: 1, validation: 2}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "duplicate key 'validation'" in err
