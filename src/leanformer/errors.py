"""Warnings the CLI shows as one line (errors are plain ``ValueError``s with a message)."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint without the SHA-256 of its tensors (written before checksums existed)."""
