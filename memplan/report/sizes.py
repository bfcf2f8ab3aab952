"""Bytes as GiB (2^30), labelled: every conversion memplan prints goes through here.

Memory is ``int`` bytes everywhere else; a renderer turns it into text (or plot values) only by
calling these, so the unit is one and the same in tables, sentences, errors and plots.
"""

from __future__ import annotations

from memplan.units import GiB, MiB


def in_gib(num_bytes: int) -> float:
    """Bytes as a number of GiB, for a plot axis labelled GiB."""
    return num_bytes / GiB


def axis_unit(max_bytes: int) -> tuple[int, str]:
    """The unit a plot axis reaching ``max_bytes`` is drawn in, and its label: GiB from 1 GiB
    up, MiB below (binary either way)."""
    return (GiB, "GiB") if max_bytes >= GiB else (MiB, "MiB")


def gib(num_bytes: int, digits: int = 2) -> str:
    """Bytes as GiB without the label, for a column headed GiB: "12.50"."""
    return f"{in_gib(num_bytes):.{digits}f}"


def format_gib(num_bytes: int, digits: int = 2) -> str:
    """Bytes as a labelled GiB string: "12.50 GiB"."""
    return f"{gib(num_bytes, digits)} GiB"


def size(num_bytes: int) -> str:
    """GiB, or MiB below 1 GiB, labelled: "1.95 GiB", "845.01 MiB" (how PyTorch prints)."""
    if abs(num_bytes) < GiB:
        return f"{num_bytes / MiB:.2f} MiB"
    return format_gib(num_bytes)


def bytes_and_gib(num_bytes: int, digits: int = 3) -> str:
    """Exact bytes with GiB beside them: "1,073,741,824 B (1.000 GiB)"."""
    return f"{num_bytes:,} B ({format_gib(num_bytes, digits)})"
