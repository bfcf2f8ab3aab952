"""Enums that read as their plain values: what a user sees of memplan's choices.

Every choice memplan returns (a precision, a recompute policy, a ZeRO stage) is an enum member
that is also a ``str`` or an ``int``: it compares equal to its value (``Precision.FP32 ==
"fp32"``, ``ZeroStage.OPTIMIZER == 1``), serialises as it (``json.dumps``, pydantic's
``model_dump(mode="json")``), and prints as it: ``str``, ``format`` and ``repr`` show the value,
so ``print(estimate)``, a notebook cell or ``candidate.recompute`` show ``'none'`` or ``1``
rather than ``<Recompute.NONE: 'none'>``. The member's name stays available as ``.name``.
"""

from __future__ import annotations

import enum


class PlainEnum(enum.StrEnum):
    """A string choice: ``str()``, ``format()`` and ``repr()`` are those of its value."""

    def __repr__(self) -> str:
        return repr(self._value_)


class PlainIntEnum(enum.IntEnum):
    """An ordered integer level (``zero >= 2``): ``str()``, ``format()`` and ``repr()`` are
    those of its value."""

    def __repr__(self) -> str:
        return repr(self._value_)


class RankedEnum(PlainEnum):
    """A string choice ordered by its declaration (``NONE < SELECTIVE < FULL``), not
    alphabetically: a member compares by position with another member or with a member's
    value (``Recompute.SELECTIVE < "full"``); any other string is refused (``TypeError``),
    rather than compared as text."""

    @property
    def rank(self) -> int:
        """The member's position in its class (0 for the first declared)."""
        return type(self)._member_names_.index(self._name_)

    def _ranks(self, other: object) -> tuple[int, int] | None:
        kind = type(self)
        if isinstance(other, str) and not isinstance(other, kind):
            if other not in kind._value2member_map_:
                raise TypeError(f"{kind.__name__} {self._value_!r} compares with "
                                f"{', '.join(map(repr, kind._value2member_map_))}, "
                                f"not {other!r}")
            other = kind(other)
        if not isinstance(other, kind):
            return None
        return self.rank, other.rank

    def __lt__(self, other: object) -> bool:
        pair = self._ranks(other)
        return NotImplemented if pair is None else pair[0] < pair[1]

    def __le__(self, other: object) -> bool:
        pair = self._ranks(other)
        return NotImplemented if pair is None else pair[0] <= pair[1]

    def __gt__(self, other: object) -> bool:
        pair = self._ranks(other)
        return NotImplemented if pair is None else pair[0] > pair[1]

    def __ge__(self, other: object) -> bool:
        pair = self._ranks(other)
        return NotImplemented if pair is None else pair[0] >= pair[1]

