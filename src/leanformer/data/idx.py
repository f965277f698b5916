"""Reader for the IDX format of the MNIST family (gzipped or raw).

An IDX file is a 4-byte magic number (two zero bytes, a type code, the number of
dimensions), one big-endian uint32 per dimension, then the values in C order. Only
unsigned bytes (type 0x08) occur in the MNIST family, so only they are accepted.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

_GZIP_MAGIC = b"\x1f\x8b"
_UBYTE = 0x08


class IdxError(ValueError):
    """A file that is not a well-formed unsigned-byte IDX file."""


def _read_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    if not raw.startswith(_GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError) as exc:  # truncated or corrupt gzip stream
        raise IdxError(f"{path}: not a readable gzip file ({exc})") from None


def read_idx(path: str | Path) -> np.ndarray:
    """The array stored in ``path`` (uint8, shape from the header)."""
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise IdxError(f"{path}: not an IDX file (bad magic number {data[:4].hex() or 'empty'})")
    type_code, ndim = data[2], data[3]
    if type_code != _UBYTE:
        raise IdxError(f"{path}: IDX type 0x{type_code:02x} is not unsigned bytes (0x08)")
    if ndim == 0:
        raise IdxError(f"{path}: IDX header declares 0 dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IdxError(f"{path}: truncated IDX header ({len(data)} bytes, {header} expected)")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = header + int(np.prod(shape, dtype=np.int64))
    if len(data) != expected:
        problem = "truncated" if len(data) < expected else "has trailing bytes"
        raise IdxError(f"{path}: {problem}: {len(data)} bytes, {expected} expected for shape {shape}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)
