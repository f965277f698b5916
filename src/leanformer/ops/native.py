"""The package's optional C++ kernels: loading them, and saying once when one is missing.

They are built when the package is installed (``setup.py``); without a C++ compiler the
package installs without them, and the code that would call a kernel runs its PyTorch
version instead: the same results, slower.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch

REINSTALL = "Reinstall where a C++ compiler is available: pip install --no-build-isolation -e ."


class MissingKernelWarning(UserWarning):
    """The package was installed without one of its C++ kernels."""


def load(module: str) -> Any:
    """The extension ``leanformer.ops.<module>``, or None when it was not built."""
    try:
        return importlib.import_module(f"leanformer.ops.{module}")
    except ImportError:
        return None


def counting() -> bool:
    """Whether a dispatch mode (a FLOP counter) is watching the operations: the kernels'
    arithmetic is invisible to it, so callers then take, or report, the visible path."""
    return bool(torch._C._len_torch_dispatch_stack())


def warn_missing(message: str, stacklevel: int) -> None:
    """Warn that a kernel is missing (the caller keeps track of "once")."""
    warnings.warn(f"{message} {REINSTALL}", MissingKernelWarning, stacklevel=stacklevel + 1)
