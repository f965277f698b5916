"""`tradeoff --resume`: an interrupted sweep continues where it stopped and ends with the
rows an uninterrupted sweep would have written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leanformer.apps import tradeoff
from leanformer.apps.sweep_config import method_options, sweep_config_from_dict
from leanformer.apps.tradeoff import run_sweep
from leanformer.cli import main
from sweep_models import untrained_deit_test

DATA = {"name": "digits", "img_size": 16, "limit_test": 48, "eval_batch_size": 48, "batch_size": 16}
# Fine-tuned and seeded points: both must not depend on which run measured them.
SWEEP = {
    "model": "deit_test",
    "data": {**DATA, "limit_train": 32},
    "methods": ["merge", "random"],
    "budgets": [0.5],
    "seeds": 2,
    "finetune_epochs": 1,
    "finetune_lr": 1e-2,
    "throughput": False,
}
MEASURED = ("method", "keep", "seed", "finetuned", "top1", "gflops", "tokens_out")


def _measured(rows: list[dict]) -> list[tuple]:
    return [tuple(r[k] for k in MEASURED) for r in rows]


def test_a_resumed_sweep_measures_only_the_missing_points_and_matches_an_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = sweep_config_from_dict(SWEEP)
    whole = run_sweep(cfg, out_dir=tmp_path / "whole", progress=False, base=untrained_deit_test())
    assert len(whole.rows) == 1 + 1 + 2  # baseline, merge, random x 2 seeds

    # An interruption after two points, in the middle of writing the third.
    cut = tmp_path / "cut"
    run_sweep(cfg, out_dir=cut, progress=False, base=untrained_deit_test())
    lines = (cut / "results.jsonl").read_text().splitlines(keepends=True)
    (cut / "results.jsonl").write_text("".join(lines[:2]) + lines[2][:20])
    (cut / "table.md").unlink()

    calls = []
    measure = tradeoff.measure_point
    monkeypatch.setattr(tradeoff, "measure_point", lambda *a, **k: calls.append(1) or measure(*a, **k))
    resumed = run_sweep(cfg, out_dir=cut, progress=False, base=untrained_deit_test(), resume=True)
    assert len(calls) == len(whole.rows) - 2
    assert _measured(resumed.rows) == _measured(whole.rows)
    on_disk = [json.loads(line) for line in (cut / "results.jsonl").read_text().splitlines()]
    assert sorted(_measured(on_disk)) == sorted(_measured(whole.rows))
    assert (cut / "table.md").read_text() == (tmp_path / "whole" / "table.md").read_text()

    # Resuming a finished sweep measures nothing.
    calls.clear()
    again = run_sweep(cfg, out_dir=cut, progress=False, base=untrained_deit_test(), resume=True)
    assert calls == [] and _measured(again.rows) == _measured(whole.rows)


def test_resume_refuses_what_it_cannot_continue(tmp_path: Path) -> None:
    cfg = sweep_config_from_dict({**SWEEP, "finetune_epochs": 0, "methods": ["merge"], "budgets": [0.5]})
    with pytest.raises(ValueError, match="holds no sweep to resume"):
        run_sweep(cfg, out_dir=tmp_path, progress=False, base=untrained_deit_test(), resume=True)
    with pytest.raises(ValueError, match="resume continues the sweep"):
        run_sweep(
            cfg, out_dir=tmp_path, progress=False, base=untrained_deit_test(), resume=True, overwrite=True
        )
    run_sweep(cfg, out_dir=tmp_path, progress=False, base=untrained_deit_test())
    other = sweep_config_from_dict({**SWEEP, "finetune_epochs": 0, "methods": ["merge"], "budgets": [0.4]})
    with pytest.raises(ValueError, match=r"holds a sweep with other settings \(budgets\)"):
        run_sweep(other, out_dir=tmp_path, progress=False, base=untrained_deit_test(), resume=True)
    lines = (tmp_path / "results.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "results.jsonl").write_text("not json\n" + "".join(lines[1:]))
    with pytest.raises(ValueError, match="line 1: not a result row; the file is damaged"):
        run_sweep(cfg, out_dir=tmp_path, progress=False, base=untrained_deit_test(), resume=True)
    # Rows of another sweep, or no row at all, would stand in for points never measured here.
    row = json.loads(lines[1])
    for foreign in ({**row, "keep": "r0.4"}, {**row, "sweep": "other"}, {**row, "method": "kmeans"}, [1]):
        (tmp_path / "results.jsonl").write_text(lines[0] + json.dumps(foreign) + "\n")
        with pytest.raises(ValueError, match="line 2: not a point of sweep"):
            run_sweep(cfg, out_dir=tmp_path, progress=False, base=untrained_deit_test(), resume=True)


def test_resume_and_overwrite_together_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["tradeoff", "--preset", "tradeoff_digits", "--resume", "--overwrite"])
    assert exit_.value.code == 2
    assert "argument --overwrite: not allowed with argument --resume" in capsys.readouterr().err


def test_resume_refuses_rows_of_another_thread_count_and_mends_an_unterminated_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed = {**SWEEP, "finetune_epochs": 0, "methods": ["merge"], "seeds": 1, "throughput": True}
    cfg = sweep_config_from_dict({**timed, "throughput_runs": 1, "throughput_warmup": 0})
    run_sweep(cfg, out_dir=tmp_path, progress=False, base=untrained_deit_test())
    results = tmp_path / "results.jsonl"
    first = results.read_text().splitlines()[0]
    # A whole row whose newline the interruption cut: the next row must start a line.
    results.write_text(first)
    run_sweep(cfg, out_dir=tmp_path, progress=False, base=untrained_deit_test(), resume=True)
    assert [json.loads(line)["method"] for line in results.read_text().splitlines()] == ["none", "merge"]
    # Timings of another thread count would make bogus speedups against the rows kept.
    results.write_text(first + "\n")
    threads = tradeoff.torch.get_num_threads()
    monkeypatch.setattr(tradeoff.torch, "get_num_threads", lambda: threads + 1)
    with pytest.raises(ValueError, match=f"measured with {threads} thread.*--threads {threads}"):
        run_sweep(cfg, out_dir=tmp_path, progress=False, base=untrained_deit_test(), resume=True)


def test_resume_refuses_a_replaced_base_checkpoint(tmp_path: Path) -> None:
    from leanformer.engine.checkpoint import save_checkpoint

    checkpoint = tmp_path / "base.safetensors"
    meta = {"model_name": "deit_test", "model_options": {"img_size": 16, "in_chans": 1, "num_classes": 10}}
    save_checkpoint(checkpoint, model=untrained_deit_test(), meta={**meta, "epoch": 1})
    cfg = sweep_config_from_dict(
        {**{k: v for k, v in SWEEP.items() if k != "model"}, "checkpoint": str(checkpoint)}
        | {"finetune_epochs": 0, "methods": ["merge"], "seeds": 1}
    )
    run_sweep(cfg, out_dir=tmp_path / "sweep", progress=False)
    other = untrained_deit_test()
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    save_checkpoint(checkpoint, model=other, meta={**meta, "epoch": 1})
    with pytest.raises(ValueError, match="measured on another version of the checkpoint"):
        run_sweep(cfg, out_dir=tmp_path / "sweep", progress=False, resume=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pool_options": {"seed": 5}}, "pool_options: seed would be replaced for random"),
        ({"device": "nonsense"}, "device 'nonsense' is not a torch device"),
    ],
)
def test_sweep_options_that_would_be_ignored_or_fail_late_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sweep_config_from_dict({**SWEEP, "methods": ["random"], **change})
    # A clustering's seed (its random initial centres) is not replaced: it stands.
    kmeans = sweep_config_from_dict({**SWEEP, "methods": ["kmeans"], "pool_options": {"seed": 5}})
    assert method_options(kmeans, "kmeans")["seed"] == 5


def test_overwrite_keeps_the_old_sweep_when_fine_tuning_cannot_start(tmp_path: Path) -> None:
    cfg = sweep_config_from_dict({**SWEEP, "finetune_epochs": 0, "methods": ["merge"], "seeds": 1})
    run_sweep(cfg, out_dir=tmp_path, progress=False, base=untrained_deit_test())
    before = sorted(p.name for p in tmp_path.iterdir())
    tiny = sweep_config_from_dict(
        {**SWEEP, "methods": ["merge"], "seeds": 1, "data": {**DATA, "limit_train": 8}}
    )
    with pytest.raises(ValueError, match="smaller than one batch"):
        run_sweep(tiny, out_dir=tmp_path, progress=False, base=untrained_deit_test(), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_points_are_checked_on_the_architecture_train_builds(tmp_path: Path) -> None:
    # The probe ignored train.model_options: a 3-entry schedule passed the check on the
    # 3-block deit_test, then failed on the trained 2-block base, after training it.
    sweep = {**SWEEP, "finetune_epochs": 0, "methods": ["merge"], "seeds": 1, "budgets": [[8, 4, 2]]}
    sweep["train"] = {"model_options": {"depth": 2}, "optim": {"epochs": 1}}
    with pytest.raises(ValueError, match="3 entries but the model has 2 blocks"):
        run_sweep(sweep_config_from_dict(sweep), out_dir=tmp_path / "sweep", progress=False)
    assert not (tmp_path / "sweep").exists()
