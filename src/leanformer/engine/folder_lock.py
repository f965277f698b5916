"""One writer per output folder: a run or sweep holds an exclusive lock on its folder.

Two processes given the same ``--out`` (a second terminal, a rerun while the first still
trains) would otherwise interleave checkpoints and metrics lines, or one would clear what
the other is writing. The lock is an advisory ``flock`` on the folder itself, so no lock
file is left behind, and the operating system releases it when the process ends, even
on ``kill -9``: a crashed run never leaves its folder locked. Where ``flock`` does not
exist (Windows) folders are not locked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from leanformer.engine.distributed import launch_rank
from leanformer.errors import FolderInUseError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Linux or macOS
    fcntl = None  # type: ignore[assignment]


def is_main_process() -> bool:
    """Whether this process writes the outputs: always, except the non-zero ranks of a
    ``torchrun`` launch."""
    return launch_rank()[0] == 0


def _missing_parents(folder: Path) -> list[Path]:
    """``folder`` and those of its ancestors that do not exist yet, deepest first."""
    missing = []
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing.append(path)
    return missing


def _try_lock(folder: Path) -> int | None:
    """An open handle on ``folder`` holding its lock, or None if another process holds it.

    Retried while the folder is replaced under us: a process that created it may remove it
    (empty) just after we opened it, and a lock on a removed folder guards nothing.
    """
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        handle = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(handle)
            return None
        try:
            same = os.path.samestat(os.fstat(handle), os.stat(folder))
        except FileNotFoundError:
            same = False
        if same:
            return handle
        os.close(handle)


@contextlib.contextmanager
def locked_folder(folder: Path, *, flag: str = "--out") -> Iterator[None]:
    """Hold ``folder`` (created if missing) for this process while the block runs.

    Raises :class:`FolderInUseError` at once when another process holds it. Folders this
    call created are removed again if the block leaves them empty (a run refused before
    it wrote anything leaves no trace).
    """
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {folder} is a file, but a folder is needed there")
    created = _missing_parents(folder)
    handle: int | None = None
    try:
        if fcntl is None:
            folder.mkdir(parents=True, exist_ok=True)
        else:
            handle = _try_lock(folder)
            if handle is None:
                raise FolderInUseError(
                    f"{folder} is in use by another leanformer process; wait for it to finish "
                    f"or choose another {flag}"
                )
        yield
    finally:
        # Only a holder cleans up: a refused caller may have "created" a folder that the
        # holder made at the same moment, and must not remove it from under it.
        if handle is not None or fcntl is None:
            for path in created:
                with contextlib.suppress(OSError):
                    path.rmdir()  # only succeeds while empty
        if handle is not None:
            os.close(handle)  # releases the lock
