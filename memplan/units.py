"""Byte arithmetic, dtypes, size strings, and the phases every peak is named by.

Memory inside memplan is always an ``int`` number of bytes. Only the report layer turns bytes
into GiB (``memplan.report.sizes``); this module holds the unit sizes and the parser for user
input such as "80GiB" (2**30-based) or "80GB" (10**9-based), which mean exactly what they say.
"""

from __future__ import annotations

import re

from memplan.choices import PlainEnum
from memplan.errors import shown

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4
KB = 1000
MB = 1000**2
GB = 1000**3
TB = 1000**4

# The largest signed 64-bit integer: counts, sizes and times that torch, its profiler, the
# MemoryMonitor and JSON writers store (int64); past it a number is a wrong file or object,
# and past a float's range it would overflow where a result is computed.
MAX_INT64 = 2**63 - 1

# The largest size a user may give (a GPU's memory): 1 PiB, over a thousand times any GPU's
# or host's memory, so a mistyped size is refused rather than computed with.
MAX_SIZE_BYTES = 2**50

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "kb": KB, "mb": MB, "gb": GB, "tb": TB,
}
_SIZE_RE = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class DType(PlainEnum):
    """Element types memplan counts, with their size in bytes (IEEE / OCP FP8 definitions)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT64 = "int64"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {DType.FP32: 4, DType.BF16: 2, DType.FP16: 2, DType.FP8: 1, DType.INT64: 8}
# master weights, optimizer states, upcast norms and losses are fp32 whatever the recipe
FP32_BYTES = DType.FP32.itemsize

# The phases of a training step, in order; an estimated, traced or recorded peak is one of them.
PHASES = ("forward", "backward", "optimizer")


def ceil_div(a: int, b: int) -> int:
    """Integer ceil(a / b) for non-negative a and positive b."""
    return -(-a // b)


def parse_bytes(text: str | int) -> int:
    """Parse "80GiB", "80 GB", "1.5TiB" or a plain integer into int bytes, at most
    ``MAX_SIZE_BYTES``.

    GiB/MiB/KiB are powers of 1024, GB/MB/KB powers of 1000. A bare number is bytes.
    """
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"size must be positive, got {text}")
        if text > MAX_SIZE_BYTES:
            raise ValueError(_too_large(text))
        return text
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(
            f"cannot read size {shown(text)}: use a number with a unit such as 80GiB (2^30) "
            "or 80GB (10^9)"
        )
    # a number of any length reads as a float (inf past 1.8e308), so the bound comes first
    value = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if not value <= MAX_SIZE_BYTES:
        raise ValueError(_too_large(text))
    value = int(round(value))
    if value <= 0:
        raise ValueError(f"size must be at least 1 byte, got {shown(text)}")
    return value


def _too_large(text: object) -> str:
    return f"size must be at most 1 PiB (2^50 bytes, memplan's limit), got {shown(text)}"
