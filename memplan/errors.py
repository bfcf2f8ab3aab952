"""The error types for user mistakes: one line, naming the field and the numbers.

``MemplanError`` is every mistake in the input (the CLI prints it on one line and exits 2);
``validation_message`` is the one place a pydantic ``ValidationError`` becomes such a line;
``Interrupted`` is Ctrl-C during a long command, saying what was kept (the CLI exits 130).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a job stopped by Ctrl-C


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


class Interrupted(Exception):
    """Ctrl-C during a long command. ``str(err)`` says what was saved and the command that
    resumes (or reruns) it; the CLI prints it on one line and exits ``EXIT_INTERRUPTED``."""


def shown(value: Any, limit: int = 60) -> str:
    """A value as a message quotes it: TOML/JSON spelling for booleans and null, ``repr``
    otherwise, cut at ``limit`` characters (a model file's value may be a long array)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = repr(value)
    if "\n" in text:  # one line, whatever the repr (a numpy array's spans lines)
        text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def validation_message(err: Any, names: Mapping[str, str] | None = None) -> str:
    """The first error of a pydantic ``ValidationError`` as one line: the field (its loc,
    each part renamed by ``names``, e.g. to the CLI flag), the rule, and the value given."""
    first = err.errors()[0]
    msg = str(first["msg"]).removeprefix("Value error, ")
    loc = [str(part) for part in first.get("loc", ())]
    if not loc:  # a check across fields: its message names them and their numbers
        return msg
    field = ".".join((names or {}).get(part, part) for part in loc)
    got = shown(first.get("input"))
    if first.get("type") == "missing" or got in msg:
        return f"{field}: {msg}"
    return f"{field}: {msg} (got {got})"


