"""CLI options that used to be accepted and then silently ignored or misapplied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leanformer.cli import build_parser, main

Capture = pytest.CaptureFixture[str]
TRAIN = ["train", "--model", "deit_test", "--img-size", "16", "--epochs", "1", "--batch-size", "16"]
TRAIN += ["--data.limit_train", "32", "--data.limit_test", "32"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("run")
    assert main([*TRAIN, "--out", str(run), "--quiet"]) == 0
    return run / "last.safetensors"


def _rows(capsys: pytest.CaptureFixture[str]) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """A flag argparse refuses: exit code 2 and one line, before any command runs."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_options_after_the_group_name_reach_the_command() -> None:
    parser = build_parser()
    args = parser.parse_args(["visualize", "--json", "--seed", "5", "enact"])
    assert args.json is True and args.seed == 5 and args._module.COMMAND == ("visualize", "enact")
    args = parser.parse_args(["visualize", "--seed", "3", "enact", "--seed", "4"])
    assert args.seed == 4 and args.json is False
    args = parser.parse_args(["visualize", "enact"])
    assert (args.json, args.quiet, args.device, args.seed, args.threads) == (False, False, "cpu", 0, None)


def test_eval_batch_size_is_used(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import leanformer.data.loaders as loaders

    seen: list[int] = []
    real = loaders.eval_loader

    def recording(dataset, *, batch_size, **kw):  # type: ignore[no-untyped-def]
        seen.append(batch_size)
        return real(dataset, batch_size=batch_size, **kw)

    monkeypatch.setattr(loaders, "eval_loader", recording)
    assert main(["eval", "--checkpoint", str(checkpoint), "--batch-size", "7", "--quiet"]) == 0
    assert seen == [7]


def test_eval_checkpoint_refuses_model_and_config(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(["eval", "--checkpoint", str(checkpoint), "--model", "deit_tiny"], capsys)
    assert "--model cannot be combined with --checkpoint" in err
    err = _error(["eval", "--checkpoint", str(checkpoint), "--config", "x.yaml"], capsys)
    assert "--config cannot be combined" in err
    err = _error(["bench", "--checkpoint", str(checkpoint), "--model", "deit_tiny"], capsys)
    assert "--model cannot be combined with --checkpoint" in err


def test_eval_checkpoint_applies_dotted_model_options(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["eval", "--checkpoint", str(checkpoint), "--json"]
    assert main(base) == 0
    (plain,) = _rows(capsys)
    assert main([*base, "--pool", "powerbert", "--keep", "2,1,1"]) == 0
    (flags,) = _rows(capsys)
    assert main([*base, "--model_options.pool", "powerbert", "--model_options.keep", "[2, 1, 1]"]) == 0
    (dotted,) = _rows(capsys)
    assert flags["loss"] != plain["loss"]  # pooling down to 1-2 tokens changes the outputs
    assert dotted["loss"] == flags["loss"] and dotted["top1"] == flags["top1"]
    # A list of ratios (or of counts and ratios) on the command line, as in a config.
    assert main([*base, "--pool", "powerbert", "--keep", "0.5,0.5,2"]) == 0
    (ratios,) = _rows(capsys)
    assert main([*base, "--model_options.pool", "powerbert", "--model_options.keep", "[0.5, 0.5, 2]"]) == 0
    (ratios_dotted,) = _rows(capsys)
    assert ratios["loss"] != plain["loss"]
    assert ratios["loss"] == ratios_dotted["loss"] and ratios["top1"] == ratios_dotted["top1"]
    # A nested key sets the top-level option it lives in.
    nested = [*base, "--pool", "kmedoids", "--keep", "2,1,1"]
    assert main([*nested, "--opt", "pool_options={max_iters: 0}"]) == 0
    (opt,) = _rows(capsys)
    assert main([*nested, "--model_options.pool_options.max_iters", "0"]) == 0
    (dotted_nested,) = _rows(capsys)
    assert dotted_nested["loss"] == opt["loss"]


def test_eval_warns_about_parameters_the_checkpoint_lacks(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", "--checkpoint", str(checkpoint), "--opt", "depth=4", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "blocks.3" in err and "untrained" in err
    assert main(["eval", "--checkpoint", str(checkpoint), "--quiet"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--num-queries", "4"], ["--dqs-threshold", "0.5"]])
def test_train_refuses_evaluation_only_flags(flag: list[str], tmp_path: Path, capsys: Capture) -> None:
    err = _error([*TRAIN, *flag, "--out", str(tmp_path / "run")], capsys)
    assert f"train does not take {flag[0]}" in err


def test_resume_without_checkpoint_keeps_the_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main([*TRAIN, "--out", str(run), "--quiet"]) == 0
    (run / "last.safetensors").unlink()
    metrics = (run / "metrics.jsonl").read_text()
    err = _error([*TRAIN, "--epochs", "2", "--out", str(run), "--resume", "--quiet"], capsys)
    assert "no last.safetensors" in err
    assert (run / "metrics.jsonl").read_text() == metrics


def test_perceiver_query_counts() -> None:
    from leanformer.apps.perceiver_eval import query_counts
    from leanformer.commands.perceiver_eval import DEFAULT_KS, int_list

    default = int_list(DEFAULT_KS)
    assert query_counts(None, 8, default) == [1, 2, 4, 8]
    assert query_counts(None, 10, default) == [1, 2, 4, 8, 10]
    assert query_counts(None, 64, default) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert query_counts([3, 5], 8, default) == [3, 5]
    with pytest.raises(ValueError, match=r"\[9\] exceed the model's 8 latent queries"):
        query_counts([1, 9], 8, default)
    with pytest.raises(ValueError, match=r"query counts must be >= 1, got \[0, 2\]"):
        query_counts([2, 0], 8, default)


def test_perceiver_eval_rejects_too_many_queries(capsys: Capture) -> None:
    argv = ["perceiver-eval", "--model", "visual_perceiver_test", "--data", "digits", "--img-size", "16"]
    argv += ["--ks", "1,9", "--reps", "0", "--time-batch", "0", "--limit", "8"]
    assert "exceed the model's 8 latent queries" in _error(argv, capsys)


def test_tradeoff_refuses_models_without_patch_tokens() -> None:
    from leanformer.apps.sweep_config import sweep_config_from_dict
    from leanformer.apps.tradeoff import check_poolable, run_sweep
    from leanformer.models.deit import DeiT
    from leanformer.models.perceiver import VisualPerceiver

    check_poolable(DeiT)
    with pytest.raises(ValueError, match="perceiver-eval"):
        check_poolable(VisualPerceiver)
    cfg = sweep_config_from_dict(
        {"model": "visual_perceiver_test", "budgets": [0.5], "train": {"optim": {"epochs": 50}}}
    )
    with pytest.raises(ValueError, match="not to VisualPerceiver"):
        run_sweep(cfg, progress=False)  # before training the 50 epochs


def test_figure_path_without_suffix_gets_png(tmp_path: Path) -> None:
    from matplotlib.figure import Figure

    from leanformer.apps.plots import save_figure

    written = save_figure(Figure(), tmp_path / "plot")
    assert written == tmp_path / "plot.png" and written.is_file()
    assert save_figure(Figure(), tmp_path / "plot.svg").read_text().lstrip().startswith("<?xml")


def test_visualize_enact_reports_the_file_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "visualize",
        "--json",
        "enact",
        "--image",
        "noise",
        "--stride",
        "32",
        "--out",
        str(tmp_path / "x"),
    ]
    assert main(argv) == 0
    (row,) = _rows(capsys)
    assert row["out"] == str(tmp_path / "x.png") and (tmp_path / "x.png").is_file()


def test_huge_sigma_is_a_clear_error(capsys: Capture) -> None:
    err = _error(["visualize", "enact", "--image", "noise", "--sigma", "1e9"], capsys)
    assert "sigma must be a finite number in [0, 1000]" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "deit_test", "--opt", "num_heads=0"], "num_heads must be an integer >= 1, got 0"),
        (["--model", "deit_test", "--opt", "depth=-1"], "depth must be an integer >= 0, got -1"),
        (["--model", "deit_test", "--opt", "img_size=abc"], "img_size must be a size or a (height, width)"),
        (
            ["--model", "deit_test", "--opt", "embed_dim=31"],
            "dim (31) must be divisible by num_heads (2)",
        ),
        (["--model", "drrt_test", "--opt", "patch_size=0"], "patch_size must be an integer >= 1, got 0"),
        (["--model", "recursive_mixer_test", "--opt", "in_chans=0"], "in_chans must be an integer >= 1"),
        (
            ["--model", "sret_test", "--opt", "num_heads=2"],
            "num_heads must be a list with one entry per stage",
        ),
        (["--model", "detr_encoder_test", "--opt", "d_model=0"], "d_model must be an integer >= 1"),
        (["--model", "deit_test", "--num-queries", "4"], "--num-queries: only for Visual Perceiver models"),
        # Found by a CLI fuzz: these used to end as exit-1 errors from inside torch.
        (
            ["--model", "visual_perceiver_test", "--opt", "depth=abc"],
            "depth must be an integer >= 0, got 'abc'",
        ),
        (["--model", "visual_perceiver_test", "--opt", "num_queries=1.5"], "num_queries must be an integer"),
        (["--model", "sret_test", "--opt", "loops=abc"], "loops must be an integer >= 1, got 'abc'"),
        (["--model", "recursive_mixer_test", "--opt", "loops=abc"], "loops must be an integer >= 1"),
        (
            ["--model", "recursive_mixer_test", "--opt", "token_mlp_dim=-3"],
            "token_mlp_dim must be an integer",
        ),
        (
            ["--model", "detr_encoder_test", "--opt", "dim_feedforward=-5"],
            "dim_feedforward must be an integer",
        ),
        (["--model", "drrt_test", "--opt", "relation_dim=-1"], "relation_dim must be an integer >= 1"),
        (
            ["--model", "drrt_test", "--opt", "map_recurrence=maybe"],
            "map_recurrence must be true, false or null",
        ),
        # Floats used to be truncated (8.5 groups ran as 8).
        (
            ["--model", "sret_test", "--opt", "groups=[[8.5, 2], [4, 1], [1, 1]]"],
            "groups[0][0] must be an integer >= 1, got 8.5",
        ),
    ],
)
def test_bad_model_options_name_the_option(argv: list[str], message: str, capsys: Capture) -> None:
    assert message in _error(["bench", *argv, "--runs", "1", "--warmup", "0", "--no-memory"], capsys)


def test_dataset_that_does_not_fit_the_model(tmp_path: Path, capsys: Capture) -> None:
    err = _error(["eval", "--model", "deit_test", "--data", "digits_pairs"], capsys)
    assert "deit_test takes one image per example, but the dataset gives a pair of inputs" in err
    err = _error(["train", "--model", "drrt_test", "--data", "digits", "--out", str(tmp_path)], capsys)
    assert "drrt_test takes a pair of inputs per example, but the dataset gives one image" in err


def test_config_that_is_not_a_mapping(tmp_path: Path, capsys: Capture) -> None:
    listed = tmp_path / "list.yaml"
    listed.write_text("- model: deit_test\n")
    assert "sweep config" in _error(["tradeoff", "--config", str(listed)], capsys)
    assert "must be a mapping of keys, got a YAML list" in _error(["train", "--config", str(listed)], capsys)


def test_unreadable_inputs_and_paths(tmp_path: Path, capsys: Capture) -> None:
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    err = _error(["visualize", "enact", "--input", str(text)], capsys)
    assert "is not an image file PIL can read" in err
    for out in (text / "x.png", text / "sub" / "x.png"):
        err = _error(["visualize", "enact", "--image", "noise", "--out", str(out)], capsys)
        assert f"{text} is a file, but a folder is needed there" in err
    err = _error(["visualize", "clusters", "--timm-model", "resnet18"], capsys)
    assert "timm model 'resnet18' does not take the options given" in err


def test_checkpoint_options_that_change_trained_shapes(checkpoint: Path, capsys: Capture) -> None:
    err = _error(["eval", "--checkpoint", str(checkpoint), "--opt", "embed_dim=64"], capsys)
    assert "do not fit deit_test with the options embed_dim=64 (size mismatch for" in err


@pytest.mark.parametrize(
    ("opt", "message"),
    [
        ("mlp_ratio=-1", "mlp_ratio must be a number > 0, got -1"),
        ("drop_path_rate=5", "drop_path_rate must be a number in [0, 1)"),
        ("pool_options=[1, 2]", "pool_options must be a mapping"),
    ],
)
def test_more_bad_deit_options(opt: str, message: str, capsys: Capture) -> None:
    assert message in _error(["bench", "--model", "deit_test", "--opt", opt, "--runs", "1"], capsys)


def test_bad_training_and_pooling_values(tmp_path: Path, capsys: Capture) -> None:
    err = _error([*TRAIN, "--teacher", "deit_test", "--distill-tau", "nan", "--out", str(tmp_path)], capsys)
    assert "train.distill_tau must be a finite number > 0" in err
    assert "config key seed is not a section" in _error(
        [*TRAIN, "--seed.x", "1", "--out", str(tmp_path)], capsys
    )
    argv = [
        "bench",
        "--model",
        "deit_test",
        "--pool",
        "random",
        "--keep",
        "0.5",
        "--opt",
        "pool_options={seed: x}",
    ]
    assert "pooling option seed must be an integer" in _error(argv, capsys)
    argv = ["visualize", "clusters", "--model", "deit_test", "--method", "powerbert", "--keep", "0,0,0"]
    assert "a block would keep no patch tokens" in _error([*argv, "--out", str(tmp_path)], capsys)


def test_tradeoff_timm_model_must_fit_the_data(tmp_path: Path, capsys: Capture) -> None:
    timm = {"pretrained": False, "img_size": 32, "patch_size": 4, "in_chans": 3, "num_classes": 10}
    timm.update(depth=1, embed_dim=32, num_heads=2)
    sweep = {"timm_model": "deit_tiny_patch16_224", "timm_options": timm, "throughput": False}
    sweep.update(data={"name": "digits", "limit_test": 16, "eval_batch_size": 16}, budgets=[0.5])
    config = tmp_path / "sweep.yaml"
    config.write_text(json.dumps(sweep))  # JSON is YAML
    err = _error(["tradeoff", "--config", str(config), "--out", str(tmp_path / "out")], capsys)
    assert "the timm model does not fit the data: in_chans=3 (data: 1)" in err


def test_config_file_seed_stands_unless_the_flag_is_typed(tmp_path: Path) -> None:
    import yaml

    config = tmp_path / "c.yaml"
    config.write_text("model: deit_test\nseed: 7\n")
    argv = [*TRAIN[:1], "--config", str(config), *TRAIN[3:], "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())["seed"] == 7
    assert main([*argv, "--seed", "3", "--out", str(tmp_path / "b")]) == 0
    assert yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())["seed"] == 3


def test_resume_refuses_a_new_learning_rate(tmp_path: Path, capsys: Capture) -> None:
    run = tmp_path / "run"
    assert main([*TRAIN, "--out", str(run), "--quiet"]) == 0
    err = _error([*TRAIN, "--epochs", "2", "--lr", "0.01", "--out", str(run), "--resume", "--quiet"], capsys)
    assert "would change optim.lr 0.001 -> 0.01; only optim.epochs" in err


def test_resume_refuses_to_switch_query_masking(tmp_path: Path, capsys: Capture) -> None:
    # The masked run's sampler state is in its checkpoint; an unmasked run has none.
    perceiver = ["train", "--model", "visual_perceiver_test", "--batch-size", "16"]
    perceiver += ["--data.limit_train", "32", "--data.limit_test", "16"]
    run = tmp_path / "run"
    assert main([*perceiver, "--epochs", "1", "--out", str(run), "--quiet"]) == 0
    argv = [*perceiver, "--epochs", "2", "--out", str(run), "--resume", "--quiet"]
    err = _error([*argv, "--query-masking"], capsys)
    assert "would change train.query_masking False -> True;" in err
    assert main(argv) == 0  # unchanged, it resumes


def test_resume_ignores_a_saved_option_that_had_no_effect(tmp_path: Path, capsys: Capture) -> None:
    """Runs saved before such values were refused may hold a distillation temperature
    without a teacher: resuming warns and continues instead of failing on it."""
    import yaml

    run = tmp_path / "run"
    assert main([*TRAIN, "--out", str(run), "--quiet"]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["train"]["distill_tau"] = 2.0
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--epochs", "2", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "train.distill_tau=2.0 had no effect without --teacher; using the default 1.0" in err
    # Typed now, the value is still refused.
    err = _error(["train", "--out", str(run), "--resume", "--epochs", "3", "--distill-tau", "2"], capsys)
    assert "train.distill_tau has no effect without --teacher" in err


def test_yes_no_options_datasets_needing_a_root_and_thread_counts(tmp_path: Path, capsys: Capture) -> None:
    argv = ["bench", "--model", "deit_test", "--opt", "qkv_bias=maybe", "--runs", "1"]
    assert "option qkv_bias must be true or false, got 'maybe'" in _error(argv, capsys)
    err = _error(["eval", "--model", "drt_test", "--data", "paired_arrays"], capsys)
    assert "dataset 'paired_arrays' needs the option 'root' (--data-root)" in err
    assert "--threads must be in [1, 1024]" in _error(["models", "--threads", "100000"], capsys)
    assert "unknown model ''" in _error(["train", "--model", "", "--out", str(tmp_path)], capsys)


def test_visualize_clusters_uses_the_checkpoint_image_size(
    checkpoint: Path, tmp_path: Path, capsys: Capture
) -> None:
    argv = ["visualize", "--json", "clusters", "--checkpoint", str(checkpoint), "--keep", "0.5"]
    assert main([*argv, "--num-examples", "1", "--out", str(tmp_path)]) == 0
    (row,) = _rows(capsys)
    assert Path(row["png"]).is_file()


@pytest.mark.parametrize(
    ("model", "flags", "message"),
    [
        ("deit_test", ["--distill-weight", "0.3"], "train.distill_weight has no effect without --teacher"),
        (
            "deit_test",
            ["--distill-tau", "1"],
            "train.distill_tau has no effect without --teacher",
        ),  # typed default
        (
            "visual_perceiver_test",
            ["--train.query_distribution", "log_uniform"],
            "train.query_distribution has no effect without --query-masking",
        ),
    ],
)
def test_train_options_without_effect_are_refused(
    model: str, flags: list[str], message: str, tmp_path: Path, capsys: Capture
) -> None:
    """Options that only modify another one used to be accepted and ignored without it."""
    argv = [*TRAIN[:2], model, *TRAIN[3:], *flags, "--out", str(tmp_path / "run")]
    assert message in _error(argv, capsys)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_config_file_options_without_effect_are_refused(tmp_path: Path, capsys: Capture) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model: deit_test\ntrain: {distill_tau: 2.0}\n")
    argv = ["train", "--config", str(config), *TRAIN[3:], "--out", str(tmp_path / "run")]
    assert "train.distill_tau has no effect without --teacher" in _error(argv, capsys)


def test_visualize_clusters_without_pooling_refuses_a_budget(tmp_path: Path, capsys: Capture) -> None:
    argv = ["visualize", "clusters", "--model", "deit_test", "--method", "none", "--out", str(tmp_path)]
    err = _error([*argv, "--keep", "0.5"], capsys)
    assert "--keep cannot be combined with --method none: nothing is pooled" in err


def test_tradeoff_refuses_timm_options_beside_a_checkpoint(tmp_path: Path, capsys: Capture) -> None:
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("checkpoint: x.safetensors\ntimm_options: {drop_rate: 0.5}\nbudgets: [0.5]\n")
    err = _error(["tradeoff", "--config", str(sweep), "--out", str(tmp_path / "out")], capsys)
    assert "timm_options: only applies to timm_model:" in err


def test_options_that_take_effect_are_still_accepted(
    tmp_path: Path, capsys: Capture, checkpoint: Path
) -> None:
    perceiver = [*TRAIN[:2], "visual_perceiver_test", *TRAIN[3:], "--quiet"]
    argv = [*perceiver, "--query-masking", "--train.query_distribution", "log_uniform"]
    assert main([*argv, "--out", str(tmp_path / "qm")]) == 0
    argv = [*TRAIN, "--teacher", str(checkpoint), "--distill-weight", "0.3", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "kd")]) == 0


def test_a_teacher_named_without_shipped_weights_is_refused(tmp_path: Path, capsys: Capture) -> None:
    # A frozen teacher built by name had random weights: it distilled noise, silently.
    err = _error([*TRAIN, "--teacher", "deit_test", "--out", str(tmp_path / "kd")], capsys)
    assert (
        "teacher deit_test: a model given by name needs shipped weights (deit_fashion, segvit_fashion)" in err
    )
    assert not (tmp_path / "kd").exists()


def test_tradeoff_name_cannot_leave_the_runs_folder(
    tmp_path: Path, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("name: ../escaped\nmodel: deit_test\nbudgets: [0.5]\n")
    assert "name: '../escaped' must be a plain folder name" in _error(
        ["tradeoff", "--config", str(sweep)], capsys
    )
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [*TRAIN, "--pretrained"],
            "train does not take --pretrained: to start from the shipped weights, give --init-from NAME",
        ),
        (
            ["eval", "--timm-model", "deit_tiny_patch16_224", "--pretrained"],
            "--pretrained loads the weights shipped with leanformer and goes with --model",
        ),
        (
            ["bench", "--hf-model", "ViTModel", "--pretrained"],
            "--pretrained loads the weights shipped with leanformer and goes with --model",
        ),
        (["bench", "--model", "deit_test", "--dc5"], "--dc5 applies only to --hf-model detr"),
        (
            ["bench", "--model", "deit_test", "--dc5", "--scopes", "model_fwd"],
            "--dc5 and --scopes apply only to --hf-model detr",
        ),
    ],
)
def test_flags_that_would_be_ignored_are_refused(argv: list[str], message: str, capsys: Capture) -> None:
    assert message in _error(argv, capsys)


def test_eval_checkpoint_refuses_a_host_model(checkpoint: Path, capsys: Capture) -> None:
    err = _error(["eval", "--checkpoint", str(checkpoint), "--timm-model", "deit_tiny_patch16_224"], capsys)
    assert "--timm-model cannot be combined with --checkpoint" in err


def test_bench_rows_of_host_models_have_the_keys_of_every_row(capsys: Capture) -> None:
    common = ["--batch-size", "1", "--warmup", "1", "--runs", "1", "--no-memory", "--json"]
    assert main(["bench", "--model", "deit_test", *common]) == 0
    own = _rows(capsys)[0]
    host = ["bench", "--timm-model", "deit_tiny_patch16_224", "--img-size", "32", "--opt", "patch_size=8"]
    assert main([*host, "--opt", "depth=1", *common]) == 0
    row = _rows(capsys)[0]
    leading = ["model", "pool", "keep", "carry", "batch_size", "img_size", "feature_size", "peak_mem_mb"]
    assert list(own)[: len(leading)] == list(row)[: len(leading)] == leading
    assert row["compile_s"] is None


def test_bench_compile_reaches_host_models(monkeypatch: pytest.MonkeyPatch, capsys: Capture) -> None:
    import leanformer.bench.report as report

    asked: list[bool] = []

    def fake_bench(model: object, inputs: object, **kwargs: object) -> dict:
        asked.append(bool(kwargs.get("compile")))
        return {"compile_s": 1.0}

    monkeypatch.setattr(report, "bench_model", fake_bench)
    host = ["bench", "--timm-model", "deit_tiny_patch16_224", "--img-size", "32", "--opt", "patch_size=8"]
    assert main([*host, "--opt", "depth=1", "--compile", "--json"]) == 0
    assert asked == [True]


def test_perceiver_eval_keeps_earlier_results_and_other_folders(tmp_path: Path, capsys: Capture) -> None:
    argv = ["perceiver-eval", "--model", "visual_perceiver_test", "--data", "digits", "--img-size", "16"]
    argv += ["--limit", "8", "--reps", "0", "--time-batch", "0", "--ks", "2", "--thresholds", "0.9"]
    out = tmp_path / "pe"
    assert main([*argv, "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    first = (out / "results.jsonl").read_bytes()
    assert "already holds results.jsonl, accuracy_vs_k.png; pass --overwrite" in _error(
        [*argv, "--out", str(out)], capsys
    )
    assert (out / "results.jsonl").read_bytes() == first
    assert main([*argv, "--out", str(out), "--overwrite", "--json"]) == 0
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text("{}")
    assert "holds a trade-off sweep (sweep.json)" in _error(
        [*argv, "--out", str(sweep), "--overwrite"], capsys
    )
    (tmp_path / "file").write_text("")
    assert "is a file" in _error([*argv, "--out", str(tmp_path / "file")], capsys)


@pytest.mark.parametrize(
    ("model", "host"),
    [("sret_test", "SReT"), ("recursive_mixer_test", "RecursiveMixer"), ("detr_encoder_test", "DETREncoder")],
)
def test_cluster_maps_refuse_models_token_pooling_does_not_apply_to(
    model: str, host: str, tmp_path: Path, capsys: Capture
) -> None:
    err = _error(["visualize", "clusters", "--model", model, "--out", str(tmp_path)], capsys)
    assert f"token pooling applies to DeiT models, timm ViTs and Hugging Face ViTs, not to {host}" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("command", [["eval"], ["bench", "--runs", "1"], ["visualize", "clusters"]])
def test_checkpoint_at_an_image_size_the_patch_does_not_divide(
    command: list[str], checkpoint: Path, tmp_path: Path, capsys: Capture
) -> None:
    argv = [*command, "--checkpoint", str(checkpoint), "--img-size", "30"]
    if command[0] == "visualize":
        argv += ["--out", str(tmp_path)]
    assert "image size 30x30 is not a multiple of the patch size 4x4" in _error(argv, capsys)


def test_a_teacher_path_that_does_not_exist_is_named_as_a_path(tmp_path: Path, capsys: Capture) -> None:
    out = tmp_path / "run"
    for teacher in ("missing.safetensors", "nothere.pt", str(tmp_path / "gone")):
        err = _error([*TRAIN, "--teacher", teacher, "--out", str(out)], capsys)
        assert f"teacher {teacher}: no such checkpoint file or run folder" in err
    assert "unknown model 'deit_tset'; did you mean deit_test" in _error(
        [*TRAIN, "--teacher", "deit_tset", "--out", str(out)], capsys
    )
    assert not out.exists()


def test_eval_of_shipped_weights_reads_the_data_they_were_trained_on(tmp_path: Path, capsys: Capture) -> None:
    """Without --data, deit_fashion's own data (its 28x28 images fit its position
    embeddings; here a few written by hand); with other data the error says which data
    the weights were trained on."""
    from test_fashion_mnist import write_fashion

    write_fashion(tmp_path)
    argv = ["eval", "--model", "deit_fashion", "--pretrained", "--data-root", str(tmp_path), "--json"]
    assert main(argv) == 0
    (row,) = _rows(capsys)
    assert row["n"] == 6 and row["model"] == "deit_fashion"
    err = _error(["eval", "--model", "deit_fashion", "--pretrained", "--data", "digits"], capsys)
    assert "do not fit the options or data given (they were trained on fashion_mnist)" in err


def test_eval_on_training_images_reads_them_without_augmentation(tmp_path: Path, capsys: Capture) -> None:
    # A run trained with augmentation keeps `augment: true` in its data config: eval on
    # its training split used to shift and flip the images, differently every time.
    from test_fashion_mnist import write_fashion

    write_fashion(tmp_path, n_train=24)
    argv = ["eval", "--model", "deit_fashion", "--pretrained", "--data-root", str(tmp_path), "--json"]
    # The card's own validation split (10,000 images) is more than these 24 hold.
    argv += ["--split", "train", "--data.options.validation", "8", "--data.options.augment", "true"]
    losses = []
    for _ in range(2):
        assert main(argv) == 0
        losses.append(_rows(capsys)[0]["loss"])
    assert main([*argv[:-2], "--data.options.augment", "false"]) == 0
    assert losses == [losses[0], _rows(capsys)[0]["loss"]]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_bytes(bytes(range(128, 256))), "is not a text file (not UTF-8)"),
        (lambda p: p.mkdir(), "is a folder; give a YAML file"),
    ],
)
def test_a_config_that_is_not_a_yaml_file_is_named(
    tmp_path: Path, make, message: str, capsys: Capture
) -> None:
    config = tmp_path / "config.yaml"
    make(config)
    assert f"config file {config} {message}" in _error(["train", "--config", str(config)], capsys)


def test_single_figure_commands_write_into_an_existing_folder(tmp_path: Path, capsys: Capture) -> None:
    """``--out FOLDER`` puts the figure in the folder, not beside it as FOLDER.png."""
    folder = tmp_path / "figures"
    folder.mkdir()
    argv = ["visualize", "perceiver-attention", "--model", "visual_perceiver_test", "--limit", "4"]
    assert main([*argv, "--out", str(folder), "--quiet"]) == 0
    assert main(["visualize", "enact", "--image", "noise", "--out", str(folder), "--quiet"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == [
        "enact_noise_seed0_s16_sigma3.png",
        "perceiver_attention.png",
    ]
    assert not (tmp_path / "figures.png").exists()
    # A folder still to be made, written with a trailing slash, is a folder too.
    assert main(["visualize", "enact", "--image", "noise", "--out", f"{tmp_path / 'new'}/", "--quiet"]) == 0
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["enact_noise_seed0_s16_sigma3.png"]
    for cols in ("0", "-2"):
        err = _usage_error([*argv, "--cols", cols, "--out", str(folder)], capsys)
        assert f"argument --cols: must be >= 1, got {cols}" in err


def test_enact_refuses_both_inputs(tmp_path: Path, capsys: Capture) -> None:
    err = _error(["visualize", "enact", "--image", "flower", "--input", str(tmp_path / "x.png")], capsys)
    assert "give --image (a bundled input) or --input (an image file), not both" in err


def test_models_suggests_close_names(capsys: Capture) -> None:
    # A plain name that names no model is an error (exit 2), with the close names.
    assert "unknown model 'deit_tset'; did you mean deit_test" in _error(["models", "deit_tset"], capsys)
    assert main(["models", "deit_tset*"]) == 0  # a glob that matches nothing is an empty list
    assert capsys.readouterr().out.strip() == "no models match"
    err = _error(["models", "--family", "sret", "sret_tst"], capsys)
    assert "did you mean sret_test" in err and "deit" not in err  # only names the filter keeps
    for flags in (["--family", "sret"], ["--pretrained"]):
        assert main(["models", *flags, "deit_test"]) == 0
        assert (
            "deit_test is a model, but not one the --family/--pretrained filters keep"
            in capsys.readouterr().out
        )


def test_an_unknown_detr_backbone_is_refused_with_close_names(capsys: Capture) -> None:
    err = _error(["bench", "--hf-model", "detr", "--opt", "backbone=resnet1", "--runs", "1"], capsys)
    assert "unknown DETR backbone 'resnet1'; did you mean resnet18" in err


def test_a_checkpoint_on_data_of_other_channels(checkpoint: Path, capsys: Capture) -> None:
    err = _error(["eval", "--checkpoint", str(checkpoint), "--data.options.channels", "3"], capsys)
    assert "deit_test takes images of 1 channel(s), but the data gives 3" in err


@pytest.mark.parametrize("seed", ["99999999999999999999", str(2**32), "-1"])
def test_seeds_out_of_range_name_the_flag(seed: str, tmp_path: Path, capsys: Capture) -> None:
    """torch's generator keeps 32 bits: seed 2^32 ran as seed 0, and -1 as 2^32 - 1."""
    err = _usage_error([*TRAIN, "--seed", seed, "--out", str(tmp_path / "run")], capsys)
    assert f"argument --seed: the seed must be an integer from 0 to 2^32 - 1, got {seed}" in err
    config = tmp_path / "seed.yaml"
    config.write_text(f"seed: {seed}\n")
    err = _error([*TRAIN, "--config", str(config), "--out", str(tmp_path / "run")], capsys)
    assert f"seed must be an integer from 0 to 2^32 - 1, got {seed}" in err
    assert not (tmp_path / "run").exists()
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"model: deit_test\nseed: {seed}\nbudgets: [0.5]\n")
    err = _error(["tradeoff", "--config", str(sweep), "--out", str(tmp_path / "sweep")], capsys)
    assert f"seed must be an integer from 0 to 2^32 - 1, got {seed}" in err


@pytest.mark.parametrize("seed", ["0", str(2**32 - 1)])
def test_seeds_at_the_ends_of_the_range_train(seed: str, tmp_path: Path) -> None:
    assert main([*TRAIN, "--seed", seed, "--out", str(tmp_path / "run"), "--quiet"]) == 0


def _image_folder(root: Path, classes: int) -> Path:
    import numpy as np
    from PIL import Image

    for split in ("train", "test"):
        for label in range(classes):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True)
            for i in range(2):
                Image.fromarray(np.full((8, 8, 3), 20 * label + i, dtype=np.uint8)).save(folder / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def two_class_perceiver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = _image_folder(tmp_path_factory.mktemp("two"), 2)
    run = root / "run"
    argv = ["train", "--model", "visual_perceiver_test", "--data", "imagefolder", "--data-root", str(root)]
    assert (
        main([*argv, "--img-size", "8", "--batch-size", "2", "--epochs", "1", "--out", str(run), "--quiet"])
        == 0
    )
    return run


@pytest.mark.parametrize("command", ["eval", "perceiver-eval"])
def test_a_checkpoint_with_fewer_class_scores_than_the_data_is_refused(
    command: str, two_class_perceiver: Path, tmp_path: Path, capsys: Capture
) -> None:
    # A target past the last score used to fail partway through with an IndexError.
    data = _image_folder(tmp_path / "twelve", 12)
    argv = [command, "--checkpoint", str(two_class_perceiver), "--data", "imagefolder"]
    argv += ["--data-root", str(data), "--img-size", "8"]
    if command == "perceiver-eval":
        argv += ["--out", str(tmp_path / "pe")]
    err = _error(argv, capsys)
    assert "gives 2 class scores, but the data has 12 classes" in err


def test_a_teacher_that_takes_other_inputs_is_refused_naming_it(
    tmp_path: Path, capsys: Capture, checkpoint: Path
) -> None:
    # An image model teaching a pair model used to fail on the first batch with a bare
    # TypeError (and a pair model teaching an image model, with the student's input error).
    pairs = ["train", "--model", "drrt_test", "--data", "digits_pairs", "--epochs", "1"]
    err = _error([*pairs, "--teacher", str(checkpoint), "--out", str(tmp_path / "b")], capsys)
    assert f"teacher {checkpoint} does not fit the data" in err and "takes one image" in err
    assert not (tmp_path / "b").exists()


def test_resume_refuses_a_config_file(tmp_path: Path, capsys: Capture, checkpoint: Path) -> None:
    # A file replaced the saved config: the seed and every setting not repeated changed.
    config = tmp_path / "c.yaml"
    config.write_text("model: deit_test\n")
    err = _error(["train", "--config", str(config), "--resume", "--out", str(checkpoint.parent)], capsys)
    assert "--resume continues with the run's own config.yaml" in err


def test_resuming_a_finished_run_leaves_its_config(tmp_path: Path, capsys: Capture) -> None:
    run = tmp_path / "run"
    assert main([*TRAIN, "--out", str(run), "--quiet"]) == 0
    saved = (run / "config.yaml").read_text()
    assert main(["train", "--resume", "--out", str(run), "--quiet"]) == 0
    assert (run / "config.yaml").read_text() == saved
    # A finished run follows the same rule as an unfinished one: a change is refused, not ignored.
    err = _error(["train", "--resume", "--out", str(run), "--batch-size", "8", "--quiet"], capsys)
    assert "would change data.batch_size 16 -> 8" in err
    assert (run / "config.yaml").read_text() == saved


def test_a_bad_query_distribution_does_not_clear_the_run_it_would_replace(
    tmp_path: Path, capsys: Capture
) -> None:
    perceiver = ["train", "--model", "visual_perceiver_test", "--batch-size", "16"]
    perceiver += ["--data.limit_train", "32", "--data.limit_test", "16", "--epochs", "1", "--quiet"]
    run = tmp_path / "run"
    assert main([*perceiver, "--out", str(run)]) == 0
    before = sorted(p.name for p in run.iterdir())
    argv = [*perceiver, "--query-masking", "--train.query_distribution", "unifrom", "--overwrite"]
    err = _error([*argv, "--out", str(run)], capsys)
    assert "unknown train.query_distribution 'unifrom'" in err
    assert sorted(p.name for p in run.iterdir()) == before


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("optim: {warmup_epochs: .inf}", "optim.warmup_epochs must be a finite number >= 0, got inf"),
        ("optim: {weight_decay: .nan}", "optim.weight_decay must be a finite number >= 0, got nan"),
        ("train: {grad_clip: .nan}", "train.grad_clip must be a finite number > 0 or none, got nan"),
        ("device: cuda:7", "device cuda:7: no cuda device is available"),
    ],
)
def test_config_file_values_get_the_checks_flags_get(
    text: str, message: str, tmp_path: Path, capsys: Capture
) -> None:
    if "cuda" in text and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    config = tmp_path / "c.yaml"
    config.write_text(f"model: deit_test\n{text}\n")
    err = _error(["train", "--config", str(config), "--out", str(tmp_path / "run"), "--quiet"], capsys)
    assert message in err
