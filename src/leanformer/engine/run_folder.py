"""A training run's folder and how an epoch is committed to it.

A run folder holds ``config.yaml`` (the resolved config), ``last.safetensors`` (weights,
optimizer and RNG state, and the metrics of every finished epoch), ``last.json`` (the
checkpoint's metadata, for people) and ``metrics.jsonl`` (one line per finished epoch).

The commit point of an epoch is the rename of the new checkpoint over the old one; it
is the only file the run is resumed from. ``last.json`` and ``metrics.jsonl`` are views
of it, each replaced atomically after the commit, so a process killed at any instant
leaves them at the checkpoint's epoch or one behind it, never ahead.
:func:`recover` (run when a run is opened again) rewrites them from the checkpoint and
removes the temporary files an interrupted write left, so a resumed run neither skips
nor repeats a metrics line.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

from leanformer.engine.checkpoint import (
    CHECKPOINT_NAME,
    atomic_write_bytes,
    is_temporary_of,
    read_checkpoint_meta,
    write_readable_copy,
)

CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
# The checkpoint's metadata for people (see ``write_readable_copy``).
POINTER_NAME = "last.json"
RUN_FILES = (CONFIG_NAME, METRICS_NAME, CHECKPOINT_NAME, POINTER_NAME)


def held_run_files(folder: Path) -> list[str]:
    """The files of a run that ``folder`` already holds (none for a new or empty folder)."""
    return [name for name in RUN_FILES if (folder / name).exists()]


def check_new_run_folder(folder: Path, *, overwrite: bool) -> None:
    """Refuse to start a run where one already is, unless it is to be replaced."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {folder} is a file, but a run folder is needed there")
    held = held_run_files(folder) if folder.is_dir() else []
    if held and not overwrite:
        raise ValueError(
            f"{folder} already holds a run ({', '.join(held)}); continue it with --resume, "
            "replace it with --overwrite, or choose another --out"
        )


def clear_run(folder: Path) -> None:
    """Remove the files of the run in ``folder`` (and nothing else there)."""
    for name in RUN_FILES:
        (folder / name).unlink(missing_ok=True)
    remove_stale_temporaries(folder)


def discard_uncommitted_run(folder: Path) -> None:
    """Remove a run that never committed an epoch, and its folder if that leaves it empty."""
    clear_run(folder)
    with contextlib.suppress(OSError):  # the folder holds files of the user's: keep it
        folder.rmdir()


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete what interrupted writes of this run left in ``folder``; return what was removed.

    That is ``.<file>.<random>.tmp`` beside each run file, and the ``tmpXXXX/`` folders
    holding one ``ckpt.safetensors`` that earlier versions staged checkpoints in.
    """
    if not folder.is_dir():
        return []
    removed = []
    for entry in folder.iterdir():
        if entry.is_file() and any(is_temporary_of(entry, name) for name in RUN_FILES):
            entry.unlink(missing_ok=True)
            removed.append(entry)
        elif entry.is_dir() and entry.name.startswith("tmp"):
            inside = [p.name for p in entry.iterdir()]
            if inside in ([], ["ckpt.safetensors"]):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    path = folder / METRICS_NAME
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_metrics(folder: Path, history: list[dict[str, Any]]) -> None:
    """Replace ``metrics.jsonl`` with one line per epoch of ``history`` (atomically)."""
    text = "".join(json.dumps(row) + "\n" for row in history)
    atomic_write_bytes(folder / METRICS_NAME, text.encode())


def recover(folder: Path) -> list[dict[str, Any]]:
    """Bring ``folder``'s views back to its checkpoint's epoch; return that epoch's history.

    The checkpoint records the metrics of every epoch it covers; one written before it
    did has only its epoch number, and the lines of ``metrics.jsonl`` up to it are kept.
    """
    remove_stale_temporaries(folder)
    meta = read_checkpoint_meta(folder / CHECKPOINT_NAME)
    epoch = int(meta["epoch"])
    history = meta.get("history")
    if not isinstance(history, list):
        history = [row for row in read_metrics(folder) if row.get("epoch", 0) <= epoch]
    write_metrics(folder, history)
    write_readable_copy(folder / CHECKPOINT_NAME, meta)
    return history
