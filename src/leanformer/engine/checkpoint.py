"""Checkpoints: one safetensors file (weights, optimizer tensors, RNG state) whose header
carries the JSON metadata (config, epoch, optimizer/scheduler scalars), plus a JSON
copy of that metadata beside it for people to read.

Both are written to a temporary file in the same folder and renamed into place, so an
interrupted write never corrupts the last good checkpoint.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

FORMAT = "leanformer-checkpoint-1"
META_KEY = "leanformer"
_MODEL_PREFIX = "model."
# Header entries that describe tensors of the file rather than the run.
_STATE_KEYS = ("optimizer", "scheduler", "extra")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file + rename (atomic on POSIX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _flatten_state(prefix: str, state: Any, tensors: dict[str, Tensor]) -> Any:
    """Move every tensor of a nested state into ``tensors``; return the JSON-able rest."""
    if isinstance(state, Tensor):
        key = f"{prefix}"
        tensors[key] = state.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(state, dict):
        return {str(k): _flatten_state(f"{prefix}.{k}", v, tensors) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return [_flatten_state(f"{prefix}.{i}", v, tensors) for i, v in enumerate(state)]
    return state


def _unflatten_state(state: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(state, dict):
        if set(state) == {"__tensor__"}:
            return tensors[state["__tensor__"]]
        return {k: _unflatten_state(v, tensors) for k, v in state.items()}
    if isinstance(state, list):
        return [_unflatten_state(v, tensors) for v in state]
    return state


def _optimizer_state_from_json(state: dict[str, Any]) -> dict[str, Any]:
    # JSON turned the integer parameter ids into strings.
    return {"state": {int(k): v for k, v in state["state"].items()}, "param_groups": state["param_groups"]}


@dataclass
class Checkpoint:
    model_state: dict[str, Tensor]
    meta: dict[str, Any]
    optimizer_state: dict[str, Any] | None
    scheduler_state: dict[str, Any] | None
    extra: dict[str, Any]


def save_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    meta: dict[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``path`` (``.safetensors``) and ``path.with_suffix('.json')`` atomically."""
    path = Path(path)
    tensors: dict[str, Tensor] = {
        f"{_MODEL_PREFIX}{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()
    }
    state: dict[str, Any] = {"format": FORMAT, **meta}
    if optimizer is not None:
        state["optimizer"] = _flatten_state("optimizer", optimizer.state_dict(), tensors)
    if scheduler is not None:
        # LambdaLR stores None in place of plain functions: the state is JSON-able.
        state["scheduler"] = _flatten_state("scheduler", scheduler.state_dict(), tensors)
    if extra:
        state["extra"] = _flatten_state("extra", extra, tensors)
    header = json.dumps(state, sort_keys=True)
    with tempfile.TemporaryDirectory(dir=path.parent if path.parent.exists() else None) as tmp:
        tmp_file = Path(tmp) / "ckpt.safetensors"
        save_file(tensors, str(tmp_file), metadata={META_KEY: header})
        atomic_write_bytes(path, tmp_file.read_bytes())
    readable = {k: v for k, v in state.items() if k not in ("optimizer", "scheduler", "extra")}
    atomic_write_bytes(
        path.with_suffix(".json"), (json.dumps(readable, indent=2, sort_keys=True) + "\n").encode()
    )
    return path


def _read(path: str | Path, *, prefix: str | None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The metadata of checkpoint ``path`` and its tensors whose names start with ``prefix``
    (none when ``prefix`` is None): readers take only what they use."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = (handle.metadata() or {}).get(META_KEY)
            names = [] if prefix is None else [k for k in handle.keys() if k.startswith(prefix)]  # noqa: SIM118
            data = {k: handle.get_tensor(k) for k in names}
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{path} is not a readable safetensors checkpoint: {exc}") from None
    if header is None:
        raise ValueError(f"{path} has no leanformer metadata (not written by leanformer?)")
    return json.loads(header), data


def _model_state(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k[len(_MODEL_PREFIX) :]: v for k, v in tensors.items() if k.startswith(_MODEL_PREFIX)}


def read_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """``load_checkpoint(path).meta`` (config, model name, epoch, ...) without reading the tensors.

    For commands that need the run's configuration before :func:`load_model` reads the
    weights: the header is a few kB, the tensors can be hundreds of MB.
    """
    meta, _ = _read(path, prefix=None)
    for key in _STATE_KEYS:
        meta.pop(key, None)
    return meta


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint` (raises ``ValueError`` if it is not one)."""
    meta, tensors = _read(path, prefix="")
    model_state = _model_state(tensors)
    optimizer = meta.pop("optimizer", None)
    scheduler = meta.pop("scheduler", None)
    extra = meta.pop("extra", None)
    return Checkpoint(
        model_state=model_state,
        meta=meta,
        optimizer_state=None
        if optimizer is None
        else _optimizer_state_from_json(_unflatten_state(optimizer, tensors)),
        scheduler_state=None if scheduler is None else _unflatten_state(scheduler, tensors),
        extra={} if extra is None else _unflatten_state(extra, tensors),
    )


def load_model(path: str | Path, *, device: str | torch.device = "cpu", **overrides: Any) -> nn.Module:
    """Rebuild the model saved in checkpoint ``path`` from its config and load its weights.

    ``overrides`` replace constructor options (e.g. ``pool=``, ``keep=`` to evaluate the
    trained weights with token pooling); options that add parameters leave them at init.
    """
    from leanformer.models.registry import create_model

    # The model's tensors only: an optimizer's state can be twice their size.
    meta, tensors = _read(path, prefix=_MODEL_PREFIX)
    name = meta.get("model_name")
    options = dict(meta.get("model_options", {}))
    if name is None:
        raise ValueError(f"checkpoint {path} does not name its model")
    model = create_model(name, **{**options, **overrides})
    try:
        missing, unexpected = model.load_state_dict(_model_state(tensors), strict=False)
    except RuntimeError as exc:  # a size mismatch: an override changed a trained tensor's shape
        changed = ", ".join(f"{k}={v!r}" for k, v in overrides.items()) or "none"
        detail = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), "")
        raise ValueError(
            f"the weights in {path} do not fit {name} with the options {changed} ({detail})"
        ) from None
    if missing and not overrides:
        raise ValueError(f"checkpoint {path} lacks weights the model needs: {', '.join(missing[:5])}")
    if unexpected:
        raise ValueError(f"checkpoint {path} has weights the model does not: {', '.join(unexpected[:5])}")
    # Parameters added by an override (e.g. a learned conv downsampler) may be missing.
    model.leanformer_missing_keys = list(missing)  # type: ignore[assignment]
    return model.to(device)
