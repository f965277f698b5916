"""The malloc behaviour timings need, set by the command line at start-up.

glibc's default malloc hands blocks above its mmap threshold (tens of MB of activations)
back to the kernel on every free, so every forward pass page-faults them in again; how
much that costs depends on the machine's load and on what ran before, and ``bench``
figures swung by up to 20x between identical runs. The Makefile exports the
``MALLOC_*_`` variables below; :func:`configure_allocator` applies the same settings
through ``mallopt`` so that a plain ``leanformer`` command measures the same way. A
variable the user exported stands (glibc read it when the process started), and
``LEANFORMER_DEFAULT_MALLOC=1`` keeps glibc's defaults (to measure them).
"""

from __future__ import annotations

import ctypes
import os
import platform

# (environment variable, mallopt parameter, value); the values are the Makefile's.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = (
    ("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, 33554432),  # 32 MiB, glibc's maximum
    ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, 17179869184),  # 16 GiB
    ("MALLOC_TOP_PAD_", M_TOP_PAD, 1073741824),  # 1 GiB
)
# mallopt takes a C int: a larger value means "never", which INT_MAX means too.
_INT_MAX = 2**31 - 1


def configure_allocator() -> dict[str, int]:
    """Apply :data:`SETTINGS` with glibc's ``mallopt``; return what was set (by variable name).

    Does nothing where the C library is not glibc, for settings given in the environment,
    and when ``LEANFORMER_DEFAULT_MALLOC`` is set to anything but ``0`` or empty.
    """
    if os.environ.get("LEANFORMER_DEFAULT_MALLOC", "0") not in ("", "0"):
        return {}
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return {}
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = {}
    for variable, parameter, value in SETTINGS:
        if variable in os.environ:
            continue
        value = min(value, _INT_MAX)
        if mallopt(parameter, value) == 1:  # 1: accepted
            applied[variable] = value
    return applied
