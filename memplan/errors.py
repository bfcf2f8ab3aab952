"""The error types for user mistakes: one line, naming the field and the numbers."""

from __future__ import annotations


class MemplanError(ValueError):
    """A mistake in the user's input. The CLI prints ``str(err)`` on one line and exits 2."""


class LayoutError(MemplanError):
    """A layout or workload that the model cannot be split into or estimated with.

    ``rule`` names the broken rule without the numbers (``"tp must divide num_kv_heads"``), so
    a search that tries many layouts counts its rejections by rule; ``str(err)`` is the full
    message with the numbers (``"tp (16) must divide num_kv_heads (8)"``).
    """

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule
