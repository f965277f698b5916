"""`--resume`: one rule over every config key; what changes the result is refused, listed."""

from __future__ import annotations

from pathlib import Path

import pytest

from leanformer.cli import main
from leanformer.config import RunConfig, load_config, to_dict
from leanformer.engine.resume_rule import MAY_CHANGE, check_resume, resume_differences

Capture = pytest.CaptureFixture[str]
TRAIN = ["train", "--model", "deit_test", "--img-size", "16", "--batch-size", "16"]
TRAIN += ["--data.limit_train", "32", "--data.limit_test", "16", "--quiet"]


def _leaves(data: dict, prefix: str = "") -> list[str]:
    keys: list[str] = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            keys += _leaves(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def test_the_rule_compares_every_key_but_the_allowed_ones() -> None:
    """Generic: each leaf of the config, changed alone, is refused unless it is allowed,
    so a key added to the config later is covered without naming it here."""
    saved = to_dict(load_config(None, {"data.options": "{augment: true}"}))
    keys = [k for k in _leaves(saved) if k not in ("model_options", "data.root", "train.teacher")]
    assert len(keys) > 20
    for key in keys:
        section, _, leaf = key.rpartition(".")
        node = saved
        for part in section.split(".") if section else []:
            node = node[part]
        value = node[leaf]
        other = (
            (not value)
            if isinstance(value, bool)
            else value * 2 + 1
            if isinstance(value, int | float)
            else None
        )
        if other is None:
            other = f"{value}x" if isinstance(value, str) else 1
        changed = {**saved}
        target = changed
        for part in section.split(".") if section else []:
            target[part] = dict(target[part])
            target = target[part]
        target[leaf] = other
        differences = resume_differences(changed, load_config(None, {"data.options": "{augment: true}"}))
        if key in MAY_CHANGE:
            assert differences == [], key
        else:
            assert len(differences) == 1 and differences[0].startswith(f"{key} "), (key, differences)


def test_a_key_the_saved_config_lacks_counts_at_its_default() -> None:
    """A run saved before a key existed computed with its default: resuming it works, and
    setting the new key to another value is refused."""
    saved = to_dict(RunConfig())
    del saved["train"]["label_smoothing"]
    saved["optim"].pop("beta2")
    assert resume_differences(saved, RunConfig()) == []
    changed = load_config(None, {"train.label_smoothing": "0.3"})
    assert resume_differences(saved, changed) == ["train.label_smoothing 0.1 -> 0.3"]


def test_every_difference_is_listed_in_one_error() -> None:
    saved = to_dict(RunConfig())
    new = load_config(None, {"seed": "3", "data.batch_size": "8", "optim.lr": "0.5", "optim.epochs": "99"})
    with pytest.raises(ValueError) as info:
        check_resume(saved, new)
    message = str(info.value)
    for part in ("data.batch_size 64 -> 8", "optim.lr 0.001 -> 0.5", "seed 0 -> 3"):
        assert part in message
    assert "optim.epochs 10" not in message  # allowed: it extends the run


def test_resolved_model_options_are_compared_when_given() -> None:
    saved = to_dict(RunConfig())
    same = resume_differences(
        saved, RunConfig(), saved_model_options={"num_classes": 10}, model_options={"num_classes": 10}
    )
    assert same == []
    other = resume_differences(
        saved, RunConfig(), saved_model_options={"num_classes": 10}, model_options={"num_classes": 5}
    )
    assert other == ["model_options.num_classes 10 -> 5"]


@pytest.fixture(scope="module")
def unfinished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run at epoch 1 of 2: resuming it would train epoch 2 (an allowed change of
    optim.epochs extends a run as an interrupted one would continue)."""
    run = tmp_path_factory.mktemp("unfinished") / "run"
    assert main([*TRAIN, "--epochs", "1", "--out", str(run)]) == 0
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("epochs: 1", "epochs: 2"))
    assert load_config(run / "config.yaml").optim.epochs == 2
    return run


def _snapshot(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run.iterdir())}


@pytest.mark.parametrize(
    ("flags", "parts"),
    [
        (["--batch-size", "8", "--data.limit_train", "32"], ["data.batch_size 16 -> 8"]),
        (
            ["--batch-size", "8", "--data.limit_train", "24"],
            ["data.batch_size 16 -> 8", "data.limit_train 32 -> 24"],
        ),
        (["--seed", "3"], ["seed 0 -> 3"]),
        (["--train.label_smoothing", "0.3"], ["train.label_smoothing 0.1 -> 0.3"]),
        (["--lr", "0.5"], ["optim.lr 0.001 -> 0.5"]),
        (["--data.limit_test", "8"], ["data.limit_test 16 -> 8"]),
        (["--opt", "depth=2"], ["model_options.depth (absent) -> 2"]),
    ],
)
def test_cli_resume_refuses_what_changes_the_result(
    unfinished: Path, flags: list[str], parts: list[str], capsys: Capture
) -> None:
    before = _snapshot(unfinished)
    capsys.readouterr()
    assert main(["train", "--out", str(unfinished), "--resume", "--quiet", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for part in parts:
        assert part in err
    assert _snapshot(unfinished) == before  # config.yaml is not rewritten


def test_cli_resume_of_a_finished_run_refuses_the_same(tmp_path: Path, capsys: Capture) -> None:
    run = tmp_path / "run"
    assert main([*TRAIN, "--epochs", "1", "--out", str(run)]) == 0
    before = _snapshot(run)
    for flags in (["--seed", "3"], ["--train.label_smoothing", "0.3"], ["--batch-size", "8"]):
        capsys.readouterr()
        assert main(["train", "--out", str(run), "--resume", "--quiet", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert "would change" in err and len(err.splitlines()) == 1
        assert _snapshot(run) == before
    # What does not change the result is accepted: the same seed, the device, progress output.
    assert main(["train", "--out", str(run), "--resume", "--quiet", "--seed", "0", "--device", "cpu"]) == 0
    after = _snapshot(run)
    assert after["config.yaml"] == before["config.yaml"]
    assert after["last.safetensors"] == before["last.safetensors"]
