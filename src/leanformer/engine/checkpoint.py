"""Checkpoints: one safetensors file (weights, optimizer tensors, RNG state) whose header
carries the JSON metadata (config, epoch, optimizer/scheduler scalars) and the SHA-256 of
the whole file, plus a JSON copy of that metadata beside it for people to read.

Both are written to a temporary file in the same folder and renamed into place, so an
interrupted write never corrupts the last good checkpoint. Readers check the SHA-256 of
every byte (header, metadata and tensors; the digest's own 64 characters count as zeros):
a file damaged after it was written is refused instead of evaluated. Older files carry a
digest of their tensor bytes only (checked, with an :class:`UnverifiedCheckpointWarning`
that the metadata is not) or none at all (loaded with that warning).
"""

from __future__ import annotations

import errno
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
from leanformer.models.registry import create_model
from leanformer.models.state_loading import check_finite_state, load_state_lenient
from leanformer.pooling.state import resolve_gflops_budget

# Version 2 records the whole file's SHA-256; version 1 files had a tensor-bytes digest or none.
FORMAT = "leanformer-checkpoint-2"
_OLD_FORMAT = "leanformer-checkpoint-1"
META_KEY = "leanformer"
# The SHA-256 (hex) of the whole file, read with this digest's 64 characters as zeros.
FILE_DIGEST_KEY = "leanformer_file_sha256"
# Older files: the SHA-256 of everything after the header (the tensor bytes) only.
DIGEST_KEY = "leanformer_sha256"
_PLACEHOLDER = "0" * 64
# The file a run folder's checkpoint has; `--checkpoint RUN_DIR` loads it.
CHECKPOINT_NAME = "last.safetensors"
_MODEL_PREFIX = "model."
# Where `fit(..., ema=True)` keeps the EMA of the weights (its ``extra["ema"]`` entry).
_EMA_PREFIX = "extra.ema."
# Header entries that describe tensors of the file rather than the run.
_STATE_KEYS = ("optimizer", "scheduler", "extra")
_HEADER_LENGTH_BYTES = 8  # safetensors: a little-endian u64, then the JSON header


def _temporary_check(name: str, nonce: str) -> str:
    # A check on the random part (and the file it stands for): a file a user named like a
    # temporary (`.metrics.jsonl.deadbeef.tmp`) does not carry it, so cleanup leaves it.
    return hashlib.sha256(f"leanformer temporary {name} {nonce}".encode()).hexdigest()[:8]


def temporary_name(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place: ``.<name>.<random><check>.tmp``
    beside it (same file system, so the rename is atomic; a leading dot hides it)."""
    nonce = secrets.token_hex(4)
    return path.with_name(f".{path.name}.{nonce}{_temporary_check(path.name, nonce)}.tmp")


def is_temporary_of(candidate: Path, name: str) -> bool:
    """Whether ``candidate`` is a temporary file :func:`atomic_write` made for file ``name``
    (its name carries the check only this module computes)."""
    prefix, suffix = f".{name}.", ".tmp"
    if not (candidate.name.startswith(prefix) and candidate.name.endswith(suffix)):
        return False
    middle = candidate.name[len(prefix) : -len(suffix)]
    if len(middle) != 16 or any(c not in "0123456789abcdef" for c in middle):
        return False
    return middle[8:] == _temporary_check(name, middle[:8])


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
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            # Name the file being written, not the temporary that is gone.
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from None
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
        # The schedule keeps its update count (a plain number): the state is JSON-able.
        state["scheduler"] = _flatten_state("scheduler", scheduler.state_dict(), tensors)
    if extra:
        state["extra"] = _flatten_state("extra", extra, tensors)
    header = json.dumps(state, sort_keys=True)
    # The digest covers every byte of the file: serialise once with a placeholder of the
    # digest's length, hash the file as it stands, and put the digest in the placeholder's
    # place (same length, so no offset moves). Readers hash it with the placeholder back.
    blob = serialize(tensors, metadata={META_KEY: header, FILE_DIGEST_KEY: _PLACEHOLDER})
    start = _HEADER_LENGTH_BYTES + int.from_bytes(blob[:_HEADER_LENGTH_BYTES], "little")
    body = memoryview(blob)[start:]
    mark = _digest_mark(_PLACEHOLDER)
    head = blob[:start]
    if head.count(mark) != 1:
        raise RuntimeError("safetensors wrote its header in an unexpected form; cannot record the SHA-256")
    digest = hashlib.sha256(head)
    digest.update(body)
    head = head.replace(mark, _digest_mark(digest.hexdigest()))

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


def _digest_mark(digest: str) -> bytes:
    """How the whole-file digest appears in the safetensors header (compact JSON)."""
    return f'"{FILE_DIGEST_KEY}":"{digest}"'.encode()


def _digest_after(path: Path, head: bytes, *, include_head: bool = True) -> str:
    """SHA-256 of ``head`` (unless not ``include_head``) followed by the bytes of ``path``
    after its header, read in chunks (not into memory)."""
    sha = hashlib.sha256(head if include_head else b"")
    with path.open("rb") as handle:
        handle.seek(len(head))
        while chunk := handle.read(1 << 22):
            sha.update(chunk)
    return sha.hexdigest()


def _raw_header(path: Path) -> bytes:
    with path.open("rb") as handle:
        prefix = handle.read(_HEADER_LENGTH_BYTES)
        return prefix + handle.read(int.from_bytes(prefix, "little"))


def _verify(path: Path, metadata: dict[str, str], *, tensors_read: bool) -> None:
    """Refuse ``path`` unless its recorded SHA-256 matches its bytes (see the module doc).
    An older file is checked (and warned about) only where its tensors are read: its
    metadata alone has nothing to check it."""
    expected = metadata.get(FILE_DIGEST_KEY)
    if expected is not None:
        head = _raw_header(path)
        if head.count(_digest_mark(expected)) != 1:
            raise ValueError(f"checkpoint {path} is damaged: its header's SHA-256 entry is unreadable")
        found = _digest_after(path, head.replace(_digest_mark(expected), _digest_mark(_PLACEHOLDER)))
        if found != expected:
            raise ValueError(
                f"checkpoint {path} is damaged: its bytes have SHA-256 {found[:12]}..., "
                f"its header recorded {expected[:12]}... when it was written"
            )
        return
    tensors_only = metadata.get(DIGEST_KEY)
    if _format_of(metadata) not in (None, _OLD_FORMAT):
        # Files of this format always record the whole-file digest: its entry was damaged.
        raise ValueError(f"checkpoint {path} is damaged: its header lacks its SHA-256 entry")
    if not tensors_read:
        return
    if tensors_only is None:
        warnings.warn(
            f"{path} carries no SHA-256 (written before checksums); its bytes are not verified",
            UnverifiedCheckpointWarning,
            stacklevel=4,
        )
        return
    found = _digest_after(path, _raw_header(path), include_head=False)
    if found != tensors_only:
        raise ValueError(
            f"checkpoint {path} is damaged: its tensor bytes have SHA-256 {found[:12]}..., "
            f"its header recorded {tensors_only[:12]}... when it was written"
        )
    warnings.warn(
        f"{path} carries a SHA-256 of its tensor bytes only (an older checkpoint); "
        "its metadata is not verified",
        UnverifiedCheckpointWarning,
        stacklevel=4,
    )


def _format_of(metadata: dict[str, str]) -> str | None:
    try:
        meta = json.loads(metadata.get(META_KEY) or "null")
    except json.JSONDecodeError:
        return None
    found = meta.get("format") if isinstance(meta, dict) else None
    return found if isinstance(found, str) else None


def _read(path: str | Path, *, prefix: str | None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The metadata of checkpoint ``path`` (a file, or a run folder) and its tensors whose
    names start with ``prefix`` (none when ``prefix`` is None): readers take only what they
    use. Reading checks the file's SHA-256 first, metadata included."""
    path = resolve_checkpoint(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            header = metadata.get(META_KEY)
            if header is not None:
                _verify(path, metadata, tensors_read=prefix is not None)
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


def load_model(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    ema: bool = False,
    allow_nonfinite: bool = False,
    **overrides: Any,
) -> nn.Module:
    """Rebuild the model saved in checkpoint ``path`` from its config and load its weights
    (``ema``: the exponential moving average of the weights that a run with ``train.ema``
    keeps beside them).

    ``overrides`` replace constructor options (e.g. ``pool=``, ``keep=`` to evaluate the
    trained weights with token pooling); options that add parameters leave them at init.
    Weights holding a NaN or an inf are refused unless ``allow_nonfinite``.
    """
    path = resolve_checkpoint(path)
    # The model's tensors only: an optimizer's state can be twice their size.
    prefix = _EMA_PREFIX if ema else _MODEL_PREFIX
    meta, tensors = _read(path, prefix=prefix)
    if ema and not tensors:
        raise ValueError(f"checkpoint {path} holds no EMA weights (its run was trained without --ema)")
    name = meta.get("model_name")
    options = meta.get("model_options", {})
    if not isinstance(name, str):
        raise ValueError(f"checkpoint {path} does not name its model")
    if not isinstance(options, dict):
        raise ValueError(f"checkpoint {path}: its model_options are damaged (not a mapping)")
    options = dict(options)
    weights = {k[len(prefix) :]: v for k, v in tensors.items()}
    check_finite_state(weights, source=f"checkpoint {path}", allow_nonfinite=allow_nonfinite)
    model = create_model(name, **{**options, **overrides})
    changed = ", ".join(f"{k}={v!r}" for k, v in overrides.items()) or "none"
    missing, unexpected = load_state_lenient(
        model,
        weights,
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
