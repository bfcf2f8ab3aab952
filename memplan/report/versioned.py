"""Every ``--json`` output of the command line, under one version: ``{"schema_version": N,
"command": NAME, ...}``. A command whose answer is a list puts it under a key of its own
(``models``, ``gpus``, ``profiles``). The format is described by the JSON Schema
``docs/schema/output.schema.json``; a change that removes or retypes a field raises
``SCHEMA_VERSION``."""

from __future__ import annotations

import json
from typing import Any

SCHEMA_VERSION = 1


def versioned(command: str, out: dict[str, Any] | list[Any], key: str = "") -> dict[str, Any]:
    """``out`` as the ``command``'s JSON object: the version and the command first, a list
    under ``key``."""
    body = {key: out} if isinstance(out, list) else out
    return {"schema_version": SCHEMA_VERSION, "command": command, **body}


def dumps(command: str, out: dict[str, Any] | list[Any], key: str = "", *,
          indent: int | None = 2) -> str:
    """``versioned`` as JSON text."""
    return json.dumps(versioned(command, out, key), indent=indent)
