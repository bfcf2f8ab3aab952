"""What a traced test keeps of a library's trace in its record (tests/traced/recorded.py): the
values the comparison reads, without the live model, its step and its optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KeptBuilt:
    """What ``frameworks.compare_built`` reads of a ``Built``: the library's model described in
    memplan's terms (the model, its step and optimizer are not kept)."""

    library: str
    spec: Any
    layout: Any
    workload: dict[str, Any]


def framework_trace(case: Any, fake: bool | None, steps: int) -> tuple[KeptBuilt, Any]:
    """``frameworks.trace_case``, its ``Built`` cut to what the comparison reads."""
    from memplan.profile import frameworks

    built, result = frameworks.trace_case(case, fake=fake, steps=steps)
    return KeptBuilt(built.library, built.spec, built.layout, dict(built.workload)), result
