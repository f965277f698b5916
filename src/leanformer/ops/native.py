"""The package's optional C++ kernels: loading them, and the one gate that decides whether
one runs.

Every kernel is a ``torch.library`` custom op (``torch.ops.leanformer.<name>``, defined
beside its PyTorch caller in a ``*_native`` module) with a fake implementation, so
``torch.compile`` and fake tensors can trace a call without running it, and, where it
does arithmetic a FLOP counter should see, a ``register_flop_formula``. Its PyTorch code
is the reference, and the fallback: :func:`use_kernel` sends a call to the kernel only
where it is built and may stand in for that code.

The kernels are built when the package is installed (``setup.py``); without a C++
compiler the package installs without them, and the PyTorch code runs instead: the same
results, slower, after one :class:`MissingKernelWarning`.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor

REINSTALL = "Reinstall where a C++ compiler is available: pip install --no-build-isolation -e ."

# The floating types the kernels are compiled for (ATen's AT_DISPATCH_FLOATING_TYPES).
KERNEL_FLOAT_TYPES = (torch.float32, torch.float64)

# A missing-kernel warning points at the first frame outside these packages: the user's
# call, however many of our functions and torch's wrappers (no_grad, Module.__call__) lie
# between.
_INTERNAL_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (os.path.dirname(os.path.abspath(__file__)), torch.__file__)
)


class MissingKernelWarning(UserWarning):
    """The package was installed without one of its C++ kernels."""


@dataclass
class NativeKernel:
    """One compiled extension, ``leanformer.ops.<module>`` (``extension``: None when it was
    not built), what it is (``what``, e.g. "K-Means kernel") and what runs without it
    (``instead``)."""

    module: str
    what: str
    instead: str
    extension: Any = None
    warned: bool = False

    def warn_once(self) -> None:
        """Say, the first time only, that the kernel was not built and what runs instead."""
        if self.warned:
            return
        self.warned = True
        warnings.warn(
            f"leanformer was installed without its C++ {self.what} (leanformer.ops.{self.module}), "
            f"so {self.instead}. {REINSTALL}",
            MissingKernelWarning,
            stacklevel=_user_stacklevel(),
        )


# The kernels by the name of their custom op (``torch.ops.leanformer.<name>``).
KERNELS: dict[str, NativeKernel] = {}


def register_kernel(op_name: str, module: str, *, what: str, instead: str) -> NativeKernel:
    """Load ``leanformer.ops.<module>`` (if it was built) as the kernel of the custom op
    ``leanformer::<op_name>``: ``what`` names it, ``instead`` says what runs without it."""
    try:
        extension = importlib.import_module(f"leanformer.ops.{module}")
    except ImportError:
        extension = None
    kernel = KERNELS[op_name] = NativeKernel(module, what, instead, extension)
    return kernel


def kernel_available(op_name: str) -> bool:
    """Whether the package was built with the kernel of ``leanformer::<op_name>``."""
    return KERNELS[op_name].extension is not None


def extension(op_name: str) -> Any:
    """The compiled extension behind ``leanformer::<op_name>``; a RuntimeError when the
    package was built without it (a custom op called directly, past :func:`use_kernel`)."""
    kernel = KERNELS[op_name]
    if kernel.extension is None:
        raise RuntimeError(
            f"leanformer was installed without its C++ {kernel.what} (leanformer.ops.{kernel.module})"
        )
    return kernel.extension


def check_one_device(op_name: str, *tensors: Tensor | None) -> None:
    """Refuse inputs of ``leanformer::<op_name>`` on several devices (in its fake
    implementation, which a meta tensor among CPU ones would otherwise answer)."""
    devices = sorted({str(t.device) for t in tensors if t is not None})
    if len(devices) > 1:
        raise RuntimeError(f"leanformer::{op_name}: the tensors must all be on one device, got {devices}")


def use_kernel(op_name: str, *tensors: Tensor | None) -> bool:
    """The gate: whether the C++ kernel of ``leanformer::<op_name>`` may stand in for its
    PyTorch code on ``tensors`` (the tensors the kernel will read; None is skipped).

    Yes when the code runs eagerly (not traced by ``torch.compile``: the traced graph
    keeps its fused PyTorch code), every tensor is on the CPU, floating ones are float32
    or float64 and integer ones int64 (what the kernels are compiled for), none needs a
    gradient (no kernel has a backward) and none carries more than its values (a forward
    tangent or a ``torch.func`` wrapper, :func:`transformed`), and the kernel was built.
    Only when everything but the build says yes does a missing kernel say so, once per
    process (:class:`MissingKernelWarning`). A FLOP counter watching is no reason to
    refuse: each op registers its own FLOP formula.

    Conditions of one kernel alone (no dropout, matching widths) are its caller's.
    """
    # Compiling is checked first and alone: the rest need not be traced.
    if torch.compiler.is_compiling():
        return False
    given = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" for t in given):
        return False
    for t in given:
        if t.is_floating_point() and t.dtype not in KERNEL_FLOAT_TYPES:
            return False
        if not t.is_floating_point() and t.dtype != torch.int64:
            return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in given):
        return False
    if transformed(*given):
        return False
    kernel = KERNELS[op_name]
    if kernel.extension is None:
        kernel.warn_once()
        return False
    return True


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


def counting() -> bool:
    """Whether a dispatch mode (a FLOP counter) is watching the operations. The batched
    clusterings then run every iteration, so that a counted cost depends on the token
    counts alone (see :func:`leanformer.ops.cluster_regimes.repeat_while_changing`)."""
    return bool(torch._C._len_torch_dispatch_stack())


def _user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by this module's caller point at the
    first frame outside leanformer and torch."""
    frame = sys._getframe(1)  # the function that calls warnings.warn
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame = frame.f_back
        level += 1
    return level
