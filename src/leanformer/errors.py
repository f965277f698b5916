"""Warnings and errors the CLI reports in one line of their own (other errors are plain
``ValueError``s with a message)."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint without the SHA-256 of its tensors (written before checksums existed)."""


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; the last good checkpoint is left untouched."""


class FolderInUseError(ValueError):
    """Another process holds the output folder (a run or sweep writes there already)."""
