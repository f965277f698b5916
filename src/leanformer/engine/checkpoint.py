"""Checkpoints: one safetensors file (weights, optimizer tensors, RNG state) whose header
carries the JSON metadata (config, epoch, optimizer/scheduler scalars) and the SHA-256 of
the file's tensor bytes, plus a JSON copy of that metadata beside it for people to read.

Both are written to a temporary file in the same folder and renamed into place, so an
interrupted write never corrupts the last good checkpoint. Readers check the SHA-256:
a file damaged after it was written is refused instead of evaluated. Files written before
checksums existed carry none; they load with an :class:`UnverifiedCheckpointWarning`.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from safetensors import safe_open
from safetensors.torch import save as serialize
from torch import Tensor, nn

from leanformer.errors import UnverifiedCheckpointWarning
from leanformer.layers.pooling_state import resolve_gflops_budget
from leanformer.models.registry import create_model
from leanformer.models.state_loading import load_state_lenient

FORMAT = "leanformer-checkpoint-1"
META_KEY = "leanformer"
# The SHA-256 (hex) of everything after the header: the tensor bytes.
DIGEST_KEY = "leanformer_sha256"
# The file a run folder's checkpoint has; `--checkpoint RUN_DIR` loads it.
CHECKPOINT_NAME = "last.safetensors"
_MODEL_PREFIX = "model."
# Header entries that describe tensors of the file rather than the run.
_STATE_KEYS = ("optimizer", "scheduler", "extra")
_HEADER_LENGTH_BYTES = 8  # safetensors: a little-endian u64, then the JSON header


def temporary_name(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place: ``.<name>.<random>.tmp``
    beside it (same file system, so the rename is atomic; a leading dot hides it)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


def is_temporary_of(candidate: Path, name: str) -> bool:
    """Whether ``candidate`` is a temporary file :func:`atomic_write` made for file ``name``."""
    return candidate.name.startswith(f".{name}.") and candidate.name.endswith(".tmp")


def _fsync_folder(folder: Path) -> None:
    # The rename itself must reach the disk, or a power cut can undo it.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a folder; the rename is still atomic
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(handle)`` on a temporary file beside ``path``, then rename it over ``path``.

    A reader (or a process killed at any instant) sees the old file or the new one, never
    a mix. The file gets the permissions of any new file (0666 less the umask), like
    ``open()``'s, rather than ``mkstemp``'s 0600.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    umask = os.umask(0)
    os.umask(umask)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file + rename (atomic on POSIX)."""

    def write(handle: IO[bytes]) -> None:
        handle.write(data)

    atomic_write(path, write)


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
    # The digest covers the tensor bytes, which follow the header: serialise once with a
    # placeholder of the digest's length, hash what follows the header, and put the digest
    # in the placeholder's place (same length, so no offset moves).
    placeholder = "0" * 64
    blob = serialize(tensors, metadata={META_KEY: header, DIGEST_KEY: placeholder})
    start = _HEADER_LENGTH_BYTES + int.from_bytes(blob[:_HEADER_LENGTH_BYTES], "little")
    body = memoryview(blob)[start:]
    digest = hashlib.sha256(body).hexdigest()
    mark = f'"{DIGEST_KEY}":"{placeholder}"'.encode()
    head = blob[:start]
    if head.count(mark) != 1:
        raise RuntimeError("safetensors wrote its header in an unexpected form; cannot record the SHA-256")
    head = head.replace(mark, f'"{DIGEST_KEY}":"{digest}"'.encode())

    def write(handle: IO[bytes]) -> None:
        handle.write(head)
        handle.write(body)

    atomic_write(path, write)
    write_readable_copy(path, state)
    return path


def write_readable_copy(path: Path, meta: dict[str, Any]) -> None:
    """``path.with_suffix('.json')``: the run's metadata without the tensor index and the
    metrics history (``metrics.jsonl`` has those lines)."""
    readable = {k: v for k, v in meta.items() if k not in (*_STATE_KEYS, "history")}
    text = json.dumps(readable, indent=2, sort_keys=True) + "\n"
    atomic_write_bytes(path.with_suffix(".json"), text.encode())


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` itself, or the checkpoint of the run folder ``path`` names."""
    path = Path(path)
    if path.is_dir():
        inside = path / CHECKPOINT_NAME
        if not inside.is_file():
            raise ValueError(f"{path} is a folder without a checkpoint (looked for {inside})")
        return inside
    if not path.is_file():
        raise ValueError(f"checkpoint {path} does not exist")
    return path


def _tensor_bytes_digest(path: Path) -> str:
    """SHA-256 of everything after the safetensors header, read in chunks (not into memory)."""
    sha = hashlib.sha256()
    with path.open("rb") as handle:
        length = int.from_bytes(handle.read(_HEADER_LENGTH_BYTES), "little")
        handle.seek(_HEADER_LENGTH_BYTES + length)
        while chunk := handle.read(1 << 22):
            sha.update(chunk)
    return sha.hexdigest()


def _verify(path: Path, expected: str | None) -> None:
    if expected is None:
        warnings.warn(
            f"{path} carries no SHA-256 (written before checksums); its tensor bytes are not verified",
            UnverifiedCheckpointWarning,
            stacklevel=3,
        )
        return
    found = _tensor_bytes_digest(path)
    if found != expected:
        raise ValueError(
            f"checkpoint {path} is damaged: its tensor bytes have SHA-256 {found[:12]}..., "
            f"its header recorded {expected[:12]}... when it was written"
        )


def _read(path: str | Path, *, prefix: str | None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The metadata of checkpoint ``path`` (a file, or a run folder) and its tensors whose
    names start with ``prefix`` (none when ``prefix`` is None): readers take only what they
    use. Reading tensors checks the file's SHA-256 first."""
    path = resolve_checkpoint(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            header = metadata.get(META_KEY)
            if header is not None and prefix is not None:
                _verify(path, metadata.get(DIGEST_KEY))
            names = [] if prefix is None else [k for k in handle.keys() if k.startswith(prefix)]  # noqa: SIM118
            data = {k: handle.get_tensor(k) for k in names}
    except ValueError:
        raise
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{path} is not a readable safetensors checkpoint: {exc}") from None
    if header is None:
        raise ValueError(f"{path} has no leanformer metadata (not written by leanformer?)")
    try:
        meta = json.loads(header)
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: its leanformer metadata is damaged (not a JSON object)")
    return meta, data


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
    path = resolve_checkpoint(path)
    # The model's tensors only: an optimizer's state can be twice their size.
    meta, tensors = _read(path, prefix=_MODEL_PREFIX)
    name = meta.get("model_name")
    options = meta.get("model_options", {})
    if not isinstance(name, str):
        raise ValueError(f"checkpoint {path} does not name its model")
    if not isinstance(options, dict):
        raise ValueError(f"checkpoint {path}: its model_options are damaged (not a mapping)")
    options = dict(options)
    model = create_model(name, **{**options, **overrides})
    changed = ", ".join(f"{k}={v!r}" for k, v in overrides.items()) or "none"
    missing, unexpected = load_state_lenient(
        model,
        _model_state(tensors),
        mismatch=f"the weights in {path} do not fit {name} with the options {changed}",
    )
    if missing and not overrides:
        raise ValueError(f"checkpoint {path} lacks weights the model needs: {', '.join(missing[:5])}")
    if unexpected:
        raise ValueError(f"checkpoint {path} has weights the model does not: {', '.join(unexpected[:5])}")
    # Parameters added by an override (e.g. a learned conv downsampler) may be missing.
    model.leanformer_missing_keys = list(missing)  # type: ignore[assignment]
    resolve_gflops_budget(model)  # a GFLOPs fraction, solved again on the trained weights
    return model.to(device)
