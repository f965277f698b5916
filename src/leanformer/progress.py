"""Progress bars for long loops: shown when asked for and stderr is a terminal.

One place decides, so ``--quiet``, JSON output and redirected or piped stderr (logs,
CI) behave the same in training, evaluation and sweeps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def progress_bar(iterable: Iterable[T], *, desc: str, show: bool = True, leave: bool = True) -> tqdm[T]:
    """``tqdm`` over ``iterable``; off when ``show`` is False or stderr is not a terminal."""
    # disable=None is tqdm's "off unless the output stream is a TTY".
    return tqdm(iterable, desc=desc, leave=leave, disable=None if show else True)
