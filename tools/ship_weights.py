"""Turn a finished training run into weights shipped with the package.

    python tools/ship_weights.py RUN_DIR NAME [--ema]

Writes ``src/leanformer/models/weights/NAME.safetensors`` (the model's state dict, float32)
and ``NAME.json`` (its card: the recipe, the data, the run's score on the validation and
test splits, the file's SHA-256: top-1 of a classifier, mIoU and pixel accuracy of a
semantic segmenter). Evaluates both splits itself, so the card's figures
are those of the file it describes. ``--ema`` ships the EMA of the weights that a run with
``train.ema`` kept (choose by the validation figure the run recorded: ``top1_ema``).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import timm
import torch
import yaml
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import leanformer
from leanformer.config import DataConfig
from leanformer.engine.builders import build_split
from leanformer.engine.checkpoint import load_model, resolve_checkpoint
from leanformer.engine.evaluate import evaluate
from leanformer.engine.segmentation_train import segmentation_scores
from leanformer.models.pretrained import WEIGHTS_DIR, file_sha256


def _canvases(config: dict, split: str, pool: str) -> str:
    """A fashion_detect split in words: its canvases and the garments they are drawn from."""
    from leanformer.data.fashion_detect import DEFAULT_CANVASES

    options = config["data"]["options"]
    count = options.get("num_canvases") or DEFAULT_CANVASES[split]
    return f"{count:,} canvases of {config['data'].get('img_size') or 128} px drawn from {pool}"


def _split_words(config: dict) -> dict[str, str]:
    """The train, val and test splits of the run's data, in words."""
    if config["data"]["name"] == "fashion_detect":
        return {
            "train": _canvases(config, "train", "the first 50,000 training images"),
            "val": _canvases(config, "val", "the last 10,000 training images (held out)"),
            "test": _canvases(config, "test", "the 10,000 test images"),
        }
    return {
        "train": _training_data(config),
        "val": "the last 10,000 training images (held out)",
        "test": "the 10,000 test images",
    }


def _training_data(config: dict) -> str:
    """The training split and its augmentation, in words, from the run's config."""
    validation = config["data"]["options"].get("validation", 0)
    words = [f"the first {60_000 - validation:,} training images"]
    if config["data"]["options"].get("augment"):
        words.append("random 2-pixel shifts and left-right flips")
    aug = config.get("aug", {})
    if aug.get("randaugment"):
        words.append(f"RandAugment {aug['randaugment']}")
    if aug.get("reprob"):
        words.append(f"random erasing p={aug['reprob']}")
    if aug.get("mixup") or aug.get("cutmix"):
        words.append(f"Mixup {aug.get('mixup', 0)} / CutMix {aug.get('cutmix', 0)}")
    return ", ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("name")
    parser.add_argument("--recipe", default="configs/train_deit_fashion.yaml")
    parser.add_argument("--ema", action="store_true", help="ship the EMA weights the run kept")
    args = parser.parse_args()

    config = yaml.safe_load((args.run_dir / "config.yaml").read_text())
    metrics = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    model = load_model(resolve_checkpoint(args.run_dir), ema=args.ema).eval()
    data = config["data"]
    scores: dict[str, float] = {}
    for split in ("val", "test"):
        cfg = DataConfig(
            name=data["name"], root=data["root"], img_size=data.get("img_size"), options=data["options"]
        )
        dataset = build_split(cfg, split)
        loader = DataLoader(dataset, batch_size=100)
        info = dataset.info  # type: ignore[attr-defined]
        suffix = "_val" if split == "val" else ""
        if info.task == "semantic":
            seg = segmentation_scores(model, loader, num_classes=info.num_classes, progress=True, desc=split)
            scores[f"miou{suffix}"] = round(seg["miou"], 2)
            scores[f"pixel_accuracy{suffix}"] = round(seg["pixel_accuracy"], 2)
            print(f"{split}: mIoU {seg['miou']:.2f}% on {len(dataset)} images")
        else:
            scores[f"top1{suffix}"] = round(evaluate(model, loader, progress=True, desc=split)["top1"], 2)
            print(f"{split}: top-1 {scores['top1' + suffix]:.2f}% on {len(dataset)} images")

    WEIGHTS_DIR.mkdir(parents=True, exist_ok=True)
    path = WEIGHTS_DIR / f"{args.name}.safetensors"
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"model": args.name})
    path.chmod(0o644)  # package data: readable by every user of an installed copy
    card = {
        "model": args.name,
        "model_options": config["model_options"],
        **scores,
        "data": {"name": data["name"], **_split_words(config)},
        "recipe": {
            "command": f"leanformer train --config {args.recipe}",
            "epochs": len(metrics),
            "epoch_seconds": [round(m["epoch_seconds"]) for m in metrics],
            "config": config,
        },
        "versions": {
            "leanformer": leanformer.__version__,
            "torch": torch.__version__,
            "timm": timm.__version__,
            "python": platform.python_version(),
        },
        "weights": "EMA of the weights" if args.ema else "the last weights",
        "dtype": "float32",
        "sha256": file_sha256(path),
    }
    (WEIGHTS_DIR / f"{args.name}.json").write_text(json.dumps(card, indent=2) + "\n")
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB) and its card")


if __name__ == "__main__":
    main()
