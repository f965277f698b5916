"""Progress for long loops: a bar on a terminal, plain lines in a log, nothing when quiet.

One place decides, so ``--quiet``, JSON output and redirected or piped stderr (logs,
CI, ``| tee``) behave the same in training, evaluation and sweeps. Without a terminal a
bar would be unreadable, and nothing at all would leave a long sweep silent: the outer
loops (``leave=True``: epochs, sweep points) print one line per finished step instead,
the inner ones (batches, timing runs) nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Progress(Protocol[T_co]):
    def __iter__(self) -> Iterator[T_co]: ...
    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None: ...
    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...


class PlainProgress(Iterable[T]):
    """``for item in PlainProgress(items, desc="epochs")``: after each step one line on
    stderr, ``epochs: 2/10 top1=81.2, loss=0.512`` (the postfix as last set)."""

    def __init__(self, iterable: Iterable[T], *, desc: str) -> None:
        self.iterable = iterable
        self.desc = desc
        self.postfix = ""

    def __iter__(self) -> Iterator[T]:
        total = len(self.iterable) if hasattr(self.iterable, "__len__") else None  # type: ignore[arg-type]
        for done, item in enumerate(self.iterable, start=1):
            yield item
            count = f"{done}/{total}" if total is not None else str(done)
            print(
                f"{self.desc}: {count}{' ' + self.postfix if self.postfix else ''}",
                file=sys.stderr,
                flush=True,
            )

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        values = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s


def progress_bar(iterable: Iterable[T], *, desc: str, show: bool = True, leave: bool = True) -> Progress[T]:
    """``tqdm`` over ``iterable`` on a terminal; without one, :class:`PlainProgress` for an
    outer loop (``leave``) and nothing for an inner one; nothing when ``show`` is False."""
    if show and leave and not _stderr_is_a_terminal():
        return PlainProgress(iterable, desc=desc)
    # disable=None is tqdm's "off unless the output stream is a TTY".
    return tqdm(iterable, desc=desc, leave=leave, disable=None if show else True)


def _stderr_is_a_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False
