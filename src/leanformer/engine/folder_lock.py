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

from leanformer.errors import FolderInUseError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Linux or macOS
    fcntl = None  # type: ignore[assignment]


def is_main_process() -> bool:
    """Whether this process writes the outputs: always, except the non-zero ranks of a
    ``torchrun`` launch (they read the environment the launcher sets)."""
    return int(os.environ.get("RANK", "0")) == 0


@contextlib.contextmanager
def locked_folder(folder: Path, *, flag: str = "--out") -> Iterator[None]:
    """Hold ``folder`` (created if missing) for this process while the block runs.

    Raises :class:`FolderInUseError` at once when another process holds it. A folder this
    call created is removed again if the block leaves it empty (a run refused before it
    wrote anything leaves no trace).
    """
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {folder} is a file, but a folder is needed there")
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    handle = os.open(folder, os.O_RDONLY)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise FolderInUseError(
                    f"{folder} is in use by another leanformer process; wait for it to finish "
                    f"or choose another {flag}"
                ) from None
        try:
            yield
        finally:
            if created:
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only succeeds while empty
    finally:
        os.close(handle)  # releases the lock
