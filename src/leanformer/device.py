"""Device strings: a clear error for one torch cannot parse or this machine lacks."""

from __future__ import annotations

import torch


def check_device(device: str, *, source: str = "--device") -> None:
    """A clear error for a device string torch cannot parse or this machine does not have
    (``source`` names where it came from: the flag, or a config's ``device``)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{source} {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if dev.type == "cpu":
        return
    module = getattr(torch, dev.type, None)
    available = getattr(module, "is_available", None)
    if available is None or not available():
        raise ValueError(f"{source} {device}: no {dev.type} device is available on this machine")
    count = getattr(module, "device_count", None)
    if dev.index is not None and count is not None and dev.index >= count():
        raise ValueError(f"{source} {device}: this machine has {count()} {dev.type} device(s)")
