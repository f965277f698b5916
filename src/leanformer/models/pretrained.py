"""Weights shipped inside the package, verified by SHA-256 before they are loaded.

A shipped model ``NAME`` is two files in ``leanformer/models/weights/``: ``NAME.safetensors``
(the state dict) and ``NAME.json`` (its card: the recipe and data it was trained with,
its measured top-1, the file's SHA-256). Nothing is downloaded, ever.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from torch import nn

from leanformer.models.state_loading import check_finite_state, load_state_lenient

WEIGHTS_DIR = Path(__file__).parent / "weights"


def shipped_models() -> list[str]:
    """Names of the models whose weights ship with the package."""
    cards = WEIGHTS_DIR.glob("*.json")
    return sorted(p.stem for p in cards if (WEIGHTS_DIR / f"{p.stem}.safetensors").is_file())


def model_card(name: str) -> dict[str, Any]:
    """The card of shipped model ``name``; a ValueError naming the shipped ones otherwise."""
    path = WEIGHTS_DIR / f"{name}.json"
    if not path.is_file() or not (WEIGHTS_DIR / f"{name}.safetensors").is_file():
        shipped = ", ".join(shipped_models()) or "none"
        raise ValueError(f"model {name!r} has no shipped weights (pretrained=True works for: {shipped})")
    return _read_card(path)


def card_data_overrides(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` (dotted config keys) with the data set shipped model ``name`` was
    trained on, and its data options (a validation split, fashion_detect's semantic
    target), wherever ``overrides`` does not set them: shipped weights are sized for their
    own data."""
    card = model_card(name)
    merged = {"data.name": card["data"]["name"], **overrides}
    options = card.get("recipe", {}).get("config", {}).get("data", {}).get("options", {})
    for key, value in options.items():
        merged.setdefault(f"data.options.{key}", value)
    return merged


def _read_card(path: Path) -> dict[str, Any]:
    """The card at ``path``, checked for what readers take from it (``sha256``, ``data.name``):
    a damaged card is one clear error, not a JSONDecodeError or KeyError from inside."""
    reinstall = "the file is damaged or was edited; reinstall leanformer"
    try:
        card = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"weights card {path.name} is not valid JSON: {reinstall}") from None
    if not isinstance(card, dict):
        raise ValueError(f"weights card {path.name} is not a JSON object: {reinstall}")
    digest = card.get("sha256")
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"weights card {path.name} has no valid sha256 (64 hex digits): {reinstall}")
    data = card.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ValueError(f"weights card {path.name} does not name its data set (data.name): {reinstall}")
    return card


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_pretrained(model: nn.Module, name: str) -> nn.Module:
    """Load the shipped weights of ``name`` into ``model`` (built with the entry's defaults).

    Checks the file against the SHA-256 on its card first, so a damaged or replaced file
    is an error, never a silently wrong model.
    """
    card = model_card(name)
    path = WEIGHTS_DIR / f"{name}.safetensors"
    actual = file_sha256(path)
    if actual != card["sha256"]:
        raise ValueError(
            f"shipped weights {path.name} fail their SHA-256 check (expected {card['sha256'][:16]}..., "
            f"got {actual[:16]}...): the file is damaged or was replaced; reinstall leanformer"
        )
    state = load_file(str(path))
    check_finite_state(state, source=f"shipped weights {path.name}")
    missing, unexpected = load_state_lenient(
        model,
        state,
        mismatch=f"the shipped weights of {name} do not fit the options or data given (they were "
        f"trained on {card['data']['name']})",
    )
    if unexpected:
        raise ValueError(f"the shipped weights of {name} hold tensors the model lacks: {unexpected[:5]}")
    # Options may add parameters (e.g. a learned conv downsampler): they keep their init.
    model.leanformer_missing_keys = list(missing)  # type: ignore[assignment]
    return model
