"""``--html PATH`` for the commands that take it (estimate, plan, diagnose, profile): checked
before any work, then the page of the command's ``--json`` object written with its text report
(``memplan.report.html``)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from memplan.report.versioned import dumps


def check(path: Path | None) -> Path | None:
    """``path`` checked as the page to write (one line naming ``--html``, exit 2, otherwise),
    before the command reads or estimates anything."""
    if path is None:
        return None
    from memplan.report.html import check_path

    return check_path(path)


def rich_text(*items: Any) -> str:
    """What ``rich`` would print for ``items`` (strings or renderables), as plain text."""
    from rich.console import Console
    from rich.text import Text

    console = Console(record=True, file=io.StringIO(), width=140, color_system=None)
    for item in items:  # a string as it is, never read as rich markup
        console.print(Text(item) if isinstance(item, str) else item)
    return console.export_text()


def write(path: Path, command: str, out: dict[str, Any], text: str = "") -> Path:
    """The page of ``out`` as ``command``'s ``--json`` prints it, written to ``path``."""
    from memplan.report.html import write_html

    return write_html(path, json.loads(dumps(command, out)), text)
