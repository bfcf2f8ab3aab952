"""The error types for user mistakes: one line, naming the field and the numbers.

``MemplanError`` is every mistake in the input (the CLI prints it on one line and exits 2);
``validation_message`` is the one place a ``ValidationError`` (a record's, or pydantic's for the
calibration files) becomes such a line;
``Interrupted`` is Ctrl-C during a long command, saying what was kept (the CLI exits 130);
``deferred_interrupts`` takes Ctrl-C during torch work at a safe point.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a job stopped by Ctrl-C
# The CLI's line for a Ctrl-C that came before any command could say what it kept
NOTHING_WRITTEN = "memplan: interrupted: nothing was written"


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


# Set by deferred_interrupts' SIGINT handler; turned into KeyboardInterrupt at a safe point.
_INTERRUPTED = [False]


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Ctrl-C during torch work, taken at a safe point. Python's own handler raises
    KeyboardInterrupt wherever the main thread is, which may be a Python callback torch calls
    from C++ code that cannot pass an exception on (a weakref finaliser run by a tensor's
    destructor): the process then aborts (SIGABRT, a C++ traceback). Inside this block SIGINT
    only sets a flag; ``raise_if_interrupted`` (called between operators and between steps)
    raises KeyboardInterrupt there, and the block's end raises it if no check did. A second
    Ctrl-C while the first waits ends the process at once with the CLI's line and exit code.
    Outside the main thread (where no handler can be set) the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(_signum: int, _frame: Any) -> None:
        if _INTERRUPTED[0]:
            os.write(2, f"{NOTHING_WRITTEN}\n".encode())
            os._exit(EXIT_INTERRUPTED)
        _INTERRUPTED[0] = True

    import signal  # only here: its enums cost every ``import memplan`` otherwise

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        pending, _INTERRUPTED[0] = _INTERRUPTED[0], False
    if pending:
        raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if Ctrl-C came inside ``deferred_interrupts`` (a safe point: the
    caller is Python code that torch passes exceptions from, or a step boundary)."""
    if _INTERRUPTED[0]:
        raise KeyboardInterrupt


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
    """The first error of a ``ValidationError`` (a record's or pydantic's) as one line: the field (its loc,
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




class ValidationError(ValueError):
    """A typed input (``memplan.choices.Record``) refused: ``errors()`` lists each field's
    failure as pydantic does (``type``, ``loc``, ``msg``, ``input``, ``ctx``), so
    ``validation_message`` makes one line of either."""

    def __init__(self, title: str, errors: list[dict[str, Any]]) -> None:
        self.title = title
        self._errors = errors
        super().__init__(self._text())

    def errors(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self._errors]

    def error_count(self) -> int:
        return len(self._errors)

    def _text(self) -> str:
        count = len(self._errors)
        lines = [f"{count} validation error{'s' if count != 1 else ''} for {self.title}"]
        for e in self._errors:
            lines.append(".".join(map(str, e["loc"])) or "(model)")
            lines.append(f"  {e['msg']} [type={e['type']}, input_value={e['input']!r}, "
                         f"input_type={type(e['input']).__name__}]")
        return "\n".join(lines)
