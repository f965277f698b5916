"""Whether a demo runs its shipped Fashion-MNIST models or trains its digits models.

A demo runs on real photographs when both the weights of its Fashion-MNIST models ship
with this install and Fashion-MNIST is installed (``--data auto``, the default);
otherwise it says why in one line on stderr, with how to install Fashion-MNIST when that
is missing, and runs its digits path (trained here). ``--data`` forces either path.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

AUTO = "auto"


@dataclass(frozen=True)
class DemoData:
    """A demo's two paths: ``fashion`` and ``digits`` are its ``--data`` choices (data set
    names), ``models`` the shipped models the Fashion-MNIST path runs."""

    demo: str
    fashion: str
    digits: str
    models: tuple[str, ...]

    def add_argument(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--data",
            choices=(AUTO, self.fashion, self.digits),
            default=AUTO,
            help=f"{self.fashion}: the shipped {', '.join(self.models)} (nothing is trained); "
            f"{self.digits}: the digits models, trained here; auto: {self.fashion} when this install "
            "ships those weights and Fashion-MNIST is installed (default: auto)",
        )

    def use_fashion(self, requested: str) -> bool:
        """Whether to run the shipped models on Fashion-MNIST (``requested`` is ``--data``).

        ``auto`` falls back to the digits path with one line on stderr saying why; asking
        for the Fashion-MNIST path when its weights or images are missing is a one-line
        ValueError.
        """
        from leanformer.data import fashion_mnist
        from leanformer.models import pretrained

        if requested not in (AUTO, self.fashion):
            return False
        shipped = set(pretrained.shipped_models())
        missing = [name for name in self.models if name not in shipped]
        if requested == self.fashion:
            if missing:
                raise ValueError(
                    f"--data {self.fashion}: this install ships no weights for {', '.join(missing)}; "
                    f"use --data {self.digits}"
                )
            fashion_mnist.find_root()  # the one-line "not found, here is how to get it" error
            return True
        installed = fashion_mnist.is_available()
        if installed and not missing:
            return True
        reasons = []
        if missing:
            reasons.append(f"this install ships no weights for {', '.join(missing)}")
        if not installed:
            reasons.append(f"Fashion-MNIST is not installed (to get it: {fashion_mnist.HOW_TO_GET})")
        print(
            f"leanformer demo {self.demo}: {' and '.join(reasons)}; running the {self.digits} demo",
            file=sys.stderr,
        )
        return False

    def refuse_digits_options(self, given: dict[str, tuple[Any, Any]]) -> None:
        """A one-line ValueError when an option of the digits path was changed on the
        Fashion-MNIST path, which trains nothing: ``given`` maps a flag to ``(value, default)``."""
        changed = [flag for flag, (value, default) in given.items() if value != default]
        if changed:
            raise ValueError(
                f"{', '.join(changed)} set(s) the {self.digits} demo, but this run uses the shipped "
                f"{', '.join(self.models)} and trains nothing: add --data {self.digits} to train"
            )


def evaluate_shipped(
    names: tuple[str, ...], data: str, *, device: str, progress: bool, limit: int | None = None
) -> list[tuple[str, Any, float]]:
    """``(name, model, top-1 %)`` of each shipped model on the test split of ``data`` (its
    first ``limit`` examples when given), in eval mode on ``device``."""
    from leanformer.config import load_config
    from leanformer.data.loaders import eval_loader
    from leanformer.engine.builders import build_model, build_split
    from leanformer.engine.evaluate import evaluate

    overrides: dict[str, Any] = {"data.name": data, "device": device}
    if limit is not None:
        overrides["data.limit_test"] = limit
    dataset = build_split(load_config(None, overrides).data, "test")
    info = dataset.info  # type: ignore[attr-defined]
    # Every model's weights are loaded (and their hashes checked) before any evaluation.
    models = [build_model(name, {}, info, pretrained=True)[0].to(device).eval() for name in names]
    loader = eval_loader(dataset, batch_size=500)
    return [
        (name, model, evaluate(model, loader, device=device, progress=progress, desc=name)["top1"])
        for name, model in zip(names, models, strict=True)
    ]


def training_flags(args: argparse.Namespace, training: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{flag: (value, default)}`` of a demo's training options (``TRAINING``, by dotted key)."""
    from leanformer.commands._options import config_flags_given
    from leanformer.config import declared_flags

    names = dict(declared_flags())
    given = config_flags_given(args, *training)
    return {names[key].name: (given.get(key), default) for key, default in training.items()}
