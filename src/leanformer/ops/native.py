"""The package's optional C++ kernels: loading them, and saying once when one is missing.

They are built when the package is installed (``setup.py``); without a C++ compiler the
package installs without them, and the code that would call a kernel runs its PyTorch
version instead: the same results, slower, after one :class:`MissingKernelWarning`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor

REINSTALL = "Reinstall where a C++ compiler is available: pip install --no-build-isolation -e ."


class MissingKernelWarning(UserWarning):
    """The package was installed without one of its C++ kernels."""


def load(module: str) -> Any:
    """The extension ``leanformer.ops.<module>``, or None when it was not built."""
    try:
        return importlib.import_module(f"leanformer.ops.{module}")
    except ImportError:
        return None


def transformed(*tensors: Tensor | None) -> bool:
    """Whether any tensor carries more than its values: a forward-mode tangent, or a
    ``torch.func`` wrapper (vmap, grad). A kernel reads the values only, so such a tensor
    takes the PyTorch path, which carries the rest or says that it cannot."""
    for t in tensors:
        if t is None:
            continue
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            return True
        if forward_ad.unpack_dual(t).tangent is not None:
            return True
    return False


def eager_cpu_inference(*tensors: Tensor | None) -> bool:
    """Whether a kernel may stand in for the PyTorch code on ``tensors``: eager (not
    traced by ``torch.compile``), all on the CPU, none that needs a gradient, no forward
    tangent or ``torch.func`` transform (:func:`transformed`), and no FLOP counter
    watching (:func:`counting`)."""
    # Compiling is checked first and alone: the rest need not be traced.
    if torch.compiler.is_compiling():
        return False
    given = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" for t in given):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in given):
        return False
    return not counting() and not transformed(*given)


def counting() -> bool:
    """Whether a dispatch mode (a FLOP counter) is watching the operations: the kernels'
    arithmetic is invisible to it, so callers then take, or report, the visible path."""
    return bool(torch._C._len_torch_dispatch_stack())


class MissingKernelNotice:
    """Says once per process that a kernel was not built, and which slower PyTorch code
    runs instead (``message``: "<kernel> (<module>), so <what runs instead>")."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.warned = False

    def warn_once(self, stacklevel: int) -> None:
        """Warn, the first time only; ``stacklevel`` counts from the caller."""
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"leanformer was installed without its C++ {self.message}. {REINSTALL}",
                MissingKernelWarning,
                stacklevel=stacklevel + 1,
            )
