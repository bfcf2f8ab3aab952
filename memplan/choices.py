"""What the typed inputs share: enums that read as their plain values (what a user sees of
memplan's choices), and a frozen model's hash kept per object (``cached_hash``).

Every choice memplan returns (a precision, a recompute policy, a ZeRO stage) is an enum member
that is also a ``str`` or an ``int``: it compares equal to its value (``Precision.FP32 ==
"fp32"``, ``ZeroStage.OPTIMIZER == 1``), serialises as it (``json.dumps``, pydantic's
``model_dump(mode="json")``), and prints as it: ``str``, ``format`` and ``repr`` show the value,
so ``print(estimate)``, a notebook cell or ``candidate.recompute`` show ``'none'`` or ``1``
rather than ``<Recompute.NONE: 'none'>``. The member's name stays available as ``.name``.
"""

from __future__ import annotations

import enum
import operator
import weakref
from typing import Any


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


# The analytic model's caches (``memplan.model.memo``, the result cache) are keyed by the frozen
# configuration objects, so one ``ModelSpec`` or ``Workload`` is hashed dozens of times per
# estimate (a plan hashes tens of thousands). pydantic hashes a frozen model from its field
# values on every call (``pydantic._internal._model_construction.make_hash_func``), nested models
# included. ``cached_hash`` gives the same value (the hash of the field values in field order, so
# equal objects still hash equal) and keeps it per object, by ``id``, for as long as the object
# lives: a weak reference's callback drops it when the object is freed, before its ``id`` can be
# reused. A frozen model's fields cannot be set, and ``model_copy`` makes a new object, so a kept
# hash cannot go stale.
_HASHES: dict[int, tuple[int, weakref.ref]] = {}
_GETTERS: dict[type, Any] = {}


def cached_hash(self: Any) -> int:
    """``hash(self)`` for a frozen pydantic model (use as its class's ``__hash__``)."""
    key = id(self)
    kept = _HASHES.get(key)
    if kept is not None:
        return kept[0]
    value = field_hash(self)
    # the reference is kept beside the value: its callback runs only while it lives
    _HASHES[key] = (value, weakref.ref(self, lambda _, key=key, table=_HASHES:
                                       table.pop(key, None)))
    return value


def field_hash(model: Any) -> int:
    """The hash of a pydantic ``model``'s field values as they are now (``cached_hash``'s
    value, computed anew): what tells a field set in place past ``frozen``
    (``object.__setattr__``) from the value checked before (``memplan.arguments.revalidated``).
    TypeError for an unhashable field, as pydantic's own hash."""
    cls = type(model)
    getter = _GETTERS.get(cls)
    if getter is None:
        names = tuple(cls.model_fields)
        getter = _GETTERS[cls] = (operator.itemgetter(*names) if len(names) > 1
                                  else (lambda d, n=names: tuple(d[k] for k in n)))
    try:
        return hash(getter(model.__dict__))
    except KeyError:  # a field missing from __dict__ (as pydantic's hash allows for)
        return hash(tuple(model.__dict__.get(name) for name in cls.model_fields))
