"""Exceptions the CLI turns into a one-line message and exit code 2."""


class UsageError(ValueError):
    """A bad argument, option, budget or input shape, described for the user."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint without the SHA-256 of its tensors (written before checksums existed)."""
