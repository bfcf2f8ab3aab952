"""The error type for user mistakes: one line, naming the field and the numbers."""

from __future__ import annotations


class MemplanError(ValueError):
    """A mistake in the user's input. The CLI prints ``str(err)`` on one line and exits 2."""
