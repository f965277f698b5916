"""The training recipe (timm's pieces): each option changes what it should, and a run with
every option on resumes exactly."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from leanformer.config import AugConfig, OptimConfig, TrainConfig, load_config
from leanformer.data.recipe_augment import RecipeAugmentDataset
from leanformer.data.registry import build_dataset
from leanformer.engine.checkpoint import load_checkpoint, load_model
from leanformer.engine.recipe import StepSchedule, autocast_for, build_mixup, build_optimizer
from leanformer.engine.train import fit
from leanformer.models.registry import create_model

QUICK = {
    "model": "deit_test",
    "model_options.drop_path_rate": "0.1",
    "data.img_size": "16",
    "data.limit_train": "96",
    "data.limit_test": "64",
    "data.batch_size": "32",
    "optim.epochs": "3",
}
EVERYTHING = {
    "aug.randaugment": "rand-m9-mstd0.5",
    "aug.reprob": "0.25",
    "aug.mixup": "0.8",
    "aug.cutmix": "1.0",
    "train.ema": "true",
    "train.ema_decay": "0.9",
    "train.precision": "bf16",
    "optim.sched": "cosine",
    "optim.warmup_epochs": "1",
}


def _rows(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "epoch_seconds"} for r in rows]


def _host_states() -> tuple:
    return random.getstate(), np.random.get_state()[1].tolist()


def test_resume_with_every_option_on_matches_uninterrupted(tmp_path: Path) -> None:
    cfg = load_config(None, {**QUICK, **EVERYTHING})
    straight = fit(cfg, out_dir=tmp_path / "a", progress=False)
    fit(cfg, out_dir=tmp_path / "b", progress=False, stop_after_epochs=1)
    resumed = fit(cfg, out_dir=tmp_path / "b", progress=False, resume=True)
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert len(a) == len(b) == 3 and "top1_ema" in a[0]
    assert a == b
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    ema_a = load_checkpoint(tmp_path / "a" / "last.safetensors").extra["ema"]
    ema_b = load_checkpoint(tmp_path / "b" / "last.safetensors").extra["ema"]
    for key in ema_a:
        torch.testing.assert_close(ema_a[key], ema_b[key], rtol=0, atol=0, msg=key)


def test_ema_weights_differ_from_the_live_ones_and_follow_them(tmp_path: Path) -> None:
    cfg = load_config(None, {**QUICK, "train.ema": "true", "train.ema_decay": "0.5"})
    torch.manual_seed(cfg.seed)
    initial = create_model("deit_test", num_classes=10, in_chans=1, img_size=16).state_dict()
    fit(cfg, out_dir=tmp_path, progress=False)
    live = load_model(tmp_path).state_dict()
    ema = load_model(tmp_path, ema=True).state_dict()
    key = "head.weight"
    assert not torch.equal(ema[key], live[key])
    # Nine steps at decay 0.5: the average sits near the last weights, far from the first.
    assert (ema[key] - live[key]).norm() < 0.5 * (initial[key] - live[key]).norm()
    # Without --ema there is nothing to load.
    fit(load_config(None, {**QUICK, "optim.epochs": "1"}), out_dir=tmp_path / "plain", progress=False)
    with pytest.raises(ValueError, match="holds no EMA weights"):
        load_model(tmp_path / "plain", ema=True)


def test_mixup_mixes_targets_and_leaves_the_host_streams_alone() -> None:
    mix = build_mixup(AugConfig(mixup=0.8, cutmix=1.0), label_smoothing=0.1, num_classes=10)
    assert mix is not None
    x = torch.randn(8, 1, 16, 16)
    y = torch.arange(8) % 10
    before = _host_states()
    torch.manual_seed(0)
    mixed_x, soft = mix(x.clone(), y)
    assert _host_states() == before
    torch.manual_seed(0)
    again_x, _ = mix(x.clone(), y)
    torch.testing.assert_close(mixed_x, again_x)
    assert soft.shape == (8, 10)
    torch.testing.assert_close(soft.sum(-1), torch.ones(8))
    # Mixed: each target is lam * own smoothed label + (1 - lam) * its partner's (the flipped
    # batch), one lam for the batch, strictly between 0 and 1.
    smoothed = torch.nn.functional.one_hot(y, 10) * 0.9 + 0.01
    lam = float((soft[0, y[0]] - smoothed.flip(0)[0, y[0]]) / (smoothed[0, y[0]] - smoothed.flip(0)[0, y[0]]))
    assert 0.0 < lam < 1.0
    torch.testing.assert_close(soft, lam * smoothed + (1 - lam) * smoothed.flip(0))
    assert not torch.equal(mixed_x, x)
    assert build_mixup(AugConfig(), label_smoothing=0.1, num_classes=10) is None
    with pytest.raises(ValueError, match="even batch"):
        mix(torch.randn(3, 1, 16, 16), torch.arange(3))


def test_rand_augment_changes_images_reproducibly() -> None:
    base = build_dataset("digits", split="train", img_size=16)
    augmented = RecipeAugmentDataset(base, policy="rand-m9-n2-mstd0.5", reprob=0.5)
    before = _host_states()
    torch.manual_seed(1)
    first = torch.stack([augmented[i][0] for i in range(16)])
    torch.manual_seed(1)
    second = torch.stack([augmented[i][0] for i in range(16)])
    assert _host_states() == before
    torch.testing.assert_close(first, second)
    plain = torch.stack([base[i][0] for i in range(16)])
    assert first.shape == plain.shape
    changed = (first - plain).flatten(1).abs().amax(1) > 1e-3
    assert 4 <= int(changed.sum()) <= 16
    # No policy and no erasing: the images come back as they were, up to 8-bit rounding.
    identity = RecipeAugmentDataset(base, policy="rand-m0-n1-p0", reprob=0.0)
    torch.testing.assert_close(identity[0][0], base[0][0], atol=0.02, rtol=0)


def test_rand_augment_keeps_one_channel_images_grey() -> None:
    base = build_dataset("digits", split="train", img_size=16, channels=1)
    image, _ = RecipeAugmentDataset(base, policy="rand-m9-n3", reprob=0.0)[3]
    assert image.shape == (1, 16, 16)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("aug.randaugment", "auto-m9", "not a RandAugment policy"),
        ("aug.reprob", "1.5", r"aug\.reprob"),
        ("aug.mixup", "-1", r"aug\.mixup"),
        ("aug.mixup_mode", "row", r"aug\.mixup_mode"),
        ("train.precision", "fp8", r"train\.precision"),
        ("train.ema_decay", "1", r"train\.ema_decay"),
        ("optim.opt", "adamq", "timm has no optimizer 'adamq'"),
        ("optim.sched", "linear", r"optim\.sched"),
        ("optim.layer_decay", "0", r"optim\.layer_decay"),
        ("train.eval_split", "val", "train.eval_split 'val'"),
        ("train.eval_split", "train", "not on train"),
    ],
)
def test_bad_recipe_values_are_refused_before_writing(
    tmp_path: Path, key: str, value: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        fit(load_config(None, {**QUICK, key: value}), out_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_the_optimizer_spares_tokens_biases_and_norms() -> None:
    model = create_model("deit_test", num_classes=10, in_chans=1, img_size=16)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.05))
    assert type(optimizer) is torch.optim.AdamW
    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    for name, param in model.named_parameters():
        expected = 0.0 if param.ndim <= 1 or name in ("pos_embed", "cls_token") else 0.05
        assert decay_of[id(param)] == expected, name
    layered = build_optimizer(model, OptimConfig(lr=1e-3, layer_decay=0.5))
    scales = sorted({g["lr_scale"] for g in layered.param_groups})
    assert scales[-1] == 1.0 and scales[0] < 0.5  # the head learns fastest, the stem slowest
    with pytest.raises(ValueError, match="names its layers"):
        build_optimizer(torch.nn.Linear(3, 3), OptimConfig(layer_decay=0.5))


def test_the_schedule_warms_up_then_follows_the_cosine_to_the_floor() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    cfg = OptimConfig(lr=1.0, epochs=10, warmup_epochs=2, warmup_lr=0.0, min_lr=0.01)
    schedule = StepSchedule(optimizer, cfg, steps_per_epoch=10)
    rates = []
    for _ in range(100):
        rates.append(schedule.get_last_lr()[0])
        schedule.step()
    assert rates[0] == 0.0
    assert rates[10] == pytest.approx(0.5)  # halfway through the warm-up
    # After the warm-up: timm's cosine over the whole run, from the peak to the floor.
    for t in (20, 50, 99):
        expected = 0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * t / 100))
        assert rates[t] == pytest.approx(expected)
    # The rate is a function of the update count: setting it equals stepping to it.
    fresh = StepSchedule(torch.optim.SGD([param], lr=1.0), cfg, steps_per_epoch=10)
    fresh.at(57)
    assert fresh.get_last_lr()[0] == pytest.approx(rates[57])


def test_bf16_runs_under_autocast_and_follows_fp32(tmp_path: Path) -> None:
    seen: list[torch.dtype] = []
    model = create_model("deit_test", num_classes=10, in_chans=1, img_size=16)
    hook = model.head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with autocast_for(torch.device("cpu"), "bf16"):
        model(torch.randn(2, 1, 16, 16))
    with autocast_for(torch.device("cpu"), "fp32"):
        model(torch.randn(2, 1, 16, 16))
    hook.remove()
    assert seen == [torch.bfloat16, torch.float32]
    # A few steps of deit_digits: the bf16 loss curve follows fp32's within bf16's noise.
    quick = {"model": "deit_digits", "data.limit_train": "128", "data.limit_test": "32"}
    quick |= {"data.batch_size": "32", "optim.epochs": "3"}
    fp32 = fit(load_config(None, quick), progress=False).history
    bf16 = fit(load_config(None, {**quick, "train.precision": "bf16"}), progress=False).history
    for a, b in zip(fp32, bf16):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=0.03)
    assert bf16[-1]["train_loss"] < bf16[0]["train_loss"]


def test_eval_reads_the_ema_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from leanformer.cli import main

    fit(
        load_config(None, {**QUICK, "optim.epochs": "1", "train.ema": "true"}),
        out_dir=tmp_path,
        progress=False,
    )
    common = ["eval", "--checkpoint", str(tmp_path), "--json", "--quiet"]
    assert main([*common, "--ema"]) == 0
    ema = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = load_checkpoint(tmp_path / "last.safetensors").meta["metrics"]["top1_ema"]
    assert ema["top1"] == pytest.approx(expected)
    assert main(["eval", "--model", "deit_test", "--ema"]) == 2
    assert "--ema evaluates the EMA weights" in capsys.readouterr().err


def test_train_help_lists_the_recipe_options(capsys: pytest.CaptureFixture[str]) -> None:
    from leanformer.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--aug.randaugment", "--aug.reprob", "--aug.mixup", "--aug.cutmix", "--ema", "--precision"):
        assert flag in text
    assert "--optimizer" in text and "(default: adamw" in text and "(default: cosine" in text


def test_configs_default_is_the_old_plain_recipe() -> None:
    assert AugConfig() == AugConfig(randaugment=None, reprob=0.0, mixup=0.0, cutmix=0.0)
    assert TrainConfig().ema is False and TrainConfig().precision == "fp32"
