"""What the typed inputs share: the frozen record they are (``Record``: typed, bounded fields,
unknown names refused, each failure named by its field), enums that read as their plain values
(what a user sees of memplan's choices), and a record's hash kept per object (``cached_hash``).

Every choice memplan returns (a precision, a recompute policy, a ZeRO stage) is an enum member
that is also a ``str`` or an ``int``: it compares equal to its value (``Precision.FP32 ==
"fp32"``, ``ZeroStage.OPTIMIZER == 1``), serialises as it (``json.dumps``,
``model_dump(mode="json")``), and prints as it: ``str``, ``format`` and ``repr`` show the value,
so ``print(estimate)``, a notebook cell or ``candidate.recompute`` show ``'none'`` or ``1``
rather than ``<Recompute.NONE: 'none'>``. The member's name stays available as ``.name``.
"""

from __future__ import annotations

import enum
import operator
import re
import sys
import types
import typing
from typing import Any

from memplan.errors import ValidationError


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
# equal objects still hash equal) and keeps it in the object's own slot (``Record._kept_hash``,
# beside its fields' ``__dict__``): a record's fields cannot be set, and ``model_copy`` makes a
# new object without the slot, so a kept hash cannot go stale. (It was kept in a table by
# ``id`` beside a weak reference; the slot is read without a call or a lookup, and needs no
# weak reference, whose callback could swallow a Ctrl-C: tests/unit/test_faults.py.)
PRUNE_FROM = 1 << 14  # entries before a table is first pruned


def prune(table: dict[int, tuple], limit: list[int], at: int) -> None:
    """Drop the entries of ``table`` (id -> a tuple holding a weak reference at index ``at``)
    whose object died, once it holds ``limit[0]`` entries; the next limit is twice what
    stays, so pruning costs O(1) per entry added."""
    if len(table) < limit[0]:
        return
    for key in [k for k, v in table.items() if v[at]() is None]:
        del table[key]
    limit[0] = max(PRUNE_FROM, 2 * len(table))


_GETTERS: dict[type, Any] = {}


def cached_hash(self: Any) -> int:
    """``hash(self)`` for a frozen record (``Record.__hash__``, so every record's): computed
    once, then read from the record's ``_kept_hash`` slot."""
    try:
        return self._kept_hash
    except AttributeError:
        value = field_hash(self)
        object.__setattr__(self, "_kept_hash", value)
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


# --- Frozen records -------------------------------------------------------------------------
# The typed inputs (``ModelSpec``, ``Workload``, ``ParallelConfig``, ``GpuSpec``, ...) are frozen
# records with typed, bounded fields, unknown names refused and each failure named by its field.
# pydantic did this until its model classes became most of a cold command's cost: importing
# ``pydantic.BaseModel`` and building one class with one field is 290M instructions (valgrind,
# CPython 3.11, pydantic 2.14) against 379M for importing pydantic, typer and rich together, and
# the eleven input types built their schemas on every ``memplan estimate``. ``Record`` keeps the
# part of pydantic's interface memplan uses (``model_fields``, ``model_copy``, ``model_dump``,
# ``model_validate``, ``model_construct``, field and model validators, ``Field`` bounds) and its
# lax-mode conversions and messages (pydantic docs, "Conversion Table"; the error types of
# pydantic_core), built from the annotations once per class in plain Python.

_MISSING: Any = type("_Missing", (), {"__repr__": lambda self: "PydanticUndefined"})()


class FieldInfo:
    """A record field: its annotation (resolved), default, bounds and description."""

    __slots__ = ("annotation", "default", "description", "gt", "ge", "lt", "le",
                 "max_length", "check")

    def __init__(self, default: Any = _MISSING, *, gt: Any = None, ge: Any = None,
                 lt: Any = None, le: Any = None, max_length: int | None = None,
                 description: str | None = None) -> None:
        self.default = default
        self.gt, self.ge, self.lt, self.le = gt, ge, lt, le
        self.max_length = max_length
        self.description = description
        self.annotation: Any = None
        self.check: Any = None

    def is_required(self) -> bool:
        return self.default is _MISSING

    def __repr__(self) -> str:
        return f"FieldInfo(annotation={self.annotation!r}, default={self.default!r})"


def Field(default: Any = _MISSING, **kwargs: Any) -> Any:  # noqa: N802 - pydantic's name
    """A field's default and bounds (``gt``, ``ge``, ``lt``, ``le``, ``max_length``) and its
    ``description``."""
    return FieldInfo(default, **kwargs)


def model_validator(*, mode: str) -> Any:
    """A check across fields, run after every field is valid; a ``ValueError`` it raises is
    the record's error (loc ``()``)."""
    if mode != "after":
        raise TypeError("Record supports model_validator(mode='after') only")

    def mark(function: Any) -> Any:
        function.__record_after__ = True
        return function

    return mark


class _FieldValidator:
    __slots__ = ("function", "names", "mode")

    def __init__(self, function: Any, names: tuple[str, ...], mode: str) -> None:
        self.function, self.names, self.mode = function, names, mode


def field_validator(*names: str, mode: str = "after") -> Any:
    """A conversion of the named fields' values, on a classmethod: ``before`` the type check
    (given the raw value) or ``after`` it."""
    if mode not in ("before", "after"):
        raise TypeError(f"field_validator mode {mode!r}: before or after")
    return lambda function: _FieldValidator(function, names, mode)


class _Fail(Exception):
    """One field's failure inside a check (``loc`` is relative to the field)."""

    def __init__(self, kind: str, msg: str, value: Any, loc: tuple[Any, ...] = (),
                 ctx: dict[str, Any] | None = None, nested: list[dict[str, Any]] | None = None):
        super().__init__(msg)
        self.kind, self.msg, self.value, self.loc, self.ctx = kind, msg, value, loc, ctx
        self.nested = nested


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _as_bool(value: Any) -> bool:
    if value is True or value is False:
        return value
    if isinstance(value, str):
        low = value.strip().lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
    elif isinstance(value, (int, float)):
        if value in (0, 1):
            return bool(value)
    else:
        raise _Fail("bool_type", "Input should be a valid boolean", value)
    raise _Fail("bool_parsing", "Input should be a valid boolean, unable to interpret input",
                value)


# pydantic's lax parsing of a string as an int: ASCII digits, an optional sign, underscores
# between digits and a fraction of zeros ("3.0"); pydantic-core's str_as_int
_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0*)?", re.ASCII)


def lax_value(kind: type, value: Any, *, ge: Any = None, le: Any = None) -> Any:
    """``value`` as ``kind`` (int, float, bool or str) the way a record's field converts it
    (pydantic's lax mode), within [ge, le] where given, or ``ValidationError`` with
    pydantic's error."""
    try:
        if ge is None and le is None:
            return _LAX[kind](value)
        return _bounded(_LAX[kind], FieldInfo(ge=ge, le=le))(value)
    except _Fail as fail:
        raise ValidationError(kind.__name__, [_error(fail.kind, fail.loc, fail.msg, fail.value,
                                                     fail.ctx)]) from None


def _as_int(value: Any) -> int:
    kind = type(value)
    if kind is int:
        return value
    if kind is bool:
        return int(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise _Fail("finite_number", "Input should be a finite number", value)
        if not value.is_integer():
            raise _Fail("int_from_float", "Input should be a valid integer, got a number with a "
                        "fractional part", value)
        return int(value)
    if isinstance(value, int):  # an int subclass (an IntEnum member)
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if _INT_TEXT.fullmatch(text):
            digits = text.partition(".")[0]
            if len(digits.lstrip("+-").replace("_", "")) > 4300:  # int()'s str-digits limit
                raise _Fail("int_parsing_size", "Unable to parse input string as an integer, "
                            "exceeded maximum size", value)
            return int(digits)
        raise _Fail("int_parsing", "Input should be a valid integer, unable to parse string as an "
                    "integer", value)
    raise _Fail("int_type", "Input should be a valid integer", value)


def _as_float(value: Any) -> float:
    if type(value) is float:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            if not value.isascii():
                raise ValueError(value)
            return float(value.strip())
        except ValueError:
            raise _Fail("float_parsing", "Input should be a valid number, unable to parse string "
                        "as a number", value) from None
    raise _Fail("float_type", "Input should be a valid number", value)


def _as_str(value: Any) -> str:
    if isinstance(value, str) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, enum.Enum) and isinstance(value, str):
        return value._value_
    raise _Fail("string_type", "Input should be a valid string", value)


_LAX = {int: _as_int, float: _as_float, bool: _as_bool, str: _as_str}


def _expected(values: Any) -> str:
    shown = [repr(v) for v in values]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


def _shown_bound(bound: Any) -> str:
    """A bound as pydantic's messages show it: a whole float without its fraction."""
    if isinstance(bound, float) and bound.is_integer():
        return str(int(bound))
    return str(bound)


def _bounded(convert: Any, info: FieldInfo) -> Any:
    """``convert`` followed by the field's bounds (pydantic's messages and order)."""
    gt, ge, lt, le, most = info.gt, info.ge, info.lt, info.le, info.max_length
    if gt is None and ge is None and lt is None and le is None and most is None:
        return convert

    def check(given: Any) -> Any:
        value = convert(given)
        # pydantic-core's constrained int and float validators: le, lt, ge, gt, in that order
        if le is not None and not value <= le:
            raise _Fail("less_than_equal", f"Input should be less than or equal to "
                        f"{_shown_bound(le)}", given, ctx={"le": le})
        if lt is not None and not value < lt:
            raise _Fail("less_than", f"Input should be less than {_shown_bound(lt)}", given,
                        ctx={"lt": lt})
        if ge is not None and not value >= ge:
            raise _Fail("greater_than_equal", f"Input should be greater than or equal to "
                        f"{_shown_bound(ge)}", given, ctx={"ge": ge})
        if gt is not None and not value > gt:
            raise _Fail("greater_than", f"Input should be greater than {_shown_bound(gt)}", given,
                        ctx={"gt": gt})
        if most is not None and len(value) > most:
            raise _Fail("string_too_long", f"String should have at most {most} characters",
                        given, ctx={"max_length": most})
        return value

    return check


def _field_check(annotation: Any, info: FieldInfo, owner: str) -> Any:
    """A field's check: its type's, then its bounds (on the value, not on None)."""
    if typing.get_origin(annotation) in (types.UnionType, typing.Union):
        others = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(others) == 1 and len(typing.get_args(annotation)) == 2:
            inner = _bounded(_converter(others[0], owner), info)
            return lambda value: None if value is None else inner(value)
    return _bounded(_converter(annotation, owner), info)


def _converter(annotation: Any, owner: str) -> Any:
    """The check of one annotation: a function of the value that returns it converted or
    raises ``_Fail``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is types.UnionType or origin is typing.Union:
        others = [a for a in args if a is not type(None)]
        if len(others) != 1:
            raise TypeError(f"{owner}: a union other than X | None ({annotation!r})")
        inner = _converter(others[0], owner)
        return lambda value: None if value is None else inner(value)
    if annotation is bool:
        return _as_bool
    if annotation is int:
        return _as_int
    if annotation is float:
        return _as_float
    if annotation is str:
        return _as_str
    if annotation is Any:
        return lambda value: value
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _enum_converter(annotation)
    if isinstance(annotation, type) and issubclass(annotation, Record):
        return _record_converter(annotation)
    if origin is typing.Literal:
        allowed = args
        message = f"Input should be {_expected(allowed)}"

        def literal(value: Any) -> Any:
            for option in allowed:
                if value == option and type(value) is type(option):
                    return option
            raise _Fail("literal_error", message, value, ctx={"expected": _expected(allowed)})
        return literal
    if origin is tuple:
        return _tuple_converter(args, owner)
    if origin is frozenset:
        item = _converter(args[0], owner)

        def to_frozenset(value: Any) -> frozenset:
            if not isinstance(value, (set, frozenset, list, tuple)):
                raise _Fail("frozen_set_type", "Input should be a valid frozenset", value)
            return frozenset(_items(item, value))
        return to_frozenset
    raise TypeError(f"{owner}: no check for the annotation {annotation!r}")


def _items(item: Any, values: Any) -> list[Any]:
    out = []
    for i, value in enumerate(values):
        try:
            out.append(item(value))
        except _Fail as fail:
            fail.loc = (i, *fail.loc)
            raise
    return out


def _tuple_converter(args: tuple[Any, ...], owner: str) -> Any:
    def sequence(value: Any) -> Any:
        if not isinstance(value, (tuple, list)):
            raise _Fail("tuple_type", "Input should be a valid tuple", value)
        return value

    if len(args) == 2 and args[1] is Ellipsis:
        item = _converter(args[0], owner)
        return lambda value: tuple(_items(item, sequence(value)))
    each = [_converter(a, owner) for a in args]

    def fixed(value: Any) -> tuple:
        value = sequence(value)
        if len(value) > len(each):
            raise _Fail("too_long", f"Tuple should have at most {len(each)} items after "
                        f"validation, not {len(value)}", value)
        if len(value) < len(each):  # pydantic: the first absent position is a missing field
            raise _Fail("missing", "Field required", value, loc=(len(value),))
        out = []
        for i, (check, item) in enumerate(zip(each, value)):
            try:
                out.append(check(item))
            except _Fail as fail:
                fail.loc = (i, *fail.loc)
                raise
        return tuple(out)
    return fixed


def _enum_converter(kind: type[enum.Enum]) -> Any:
    def member(value: Any) -> Any:
        if type(value) is kind:
            return value
        try:
            return kind(value)
        except (ValueError, TypeError):
            expected = _expected([m.value for m in kind])  # (made on failure only)
            raise _Fail("enum", f"Input should be {expected}", value,
                        ctx={"expected": expected}) from None
    return member


def _record_converter(kind: type[Record]) -> Any:
    message = f"Input should be a valid dictionary or instance of {kind.__name__}"

    def record(value: Any) -> Any:
        if isinstance(value, kind):
            return value
        if not isinstance(value, dict):
            raise _Fail("model_type", message, value, ctx={"class_name": kind.__name__})
        try:
            return kind(**value)
        except ValidationError as err:
            raise _Fail("nested", "", value, nested=err.errors()) from None
    return record


def _error(kind: str, loc: tuple[Any, ...], msg: str, value: Any,
           ctx: dict[str, Any] | None = None) -> dict[str, Any]:
    error = {"type": kind, "loc": loc, "msg": msg, "input": value}
    if ctx:
        error["ctx"] = ctx
    return error


_PLAIN = {"int": int, "bool": bool, "float": float, "str": str}  # annotations read without eval


class Record:
    """A frozen record with typed fields (see the section's comment above).

    A subclass declares its fields as annotations, with defaults or ``Field(...)``;
    ``Record(**values)`` converts and checks every value, refuses unknown names and raises
    ``memplan.errors.ValidationError`` listing each failure by field, then runs the
    ``model_validator`` checks. Instances cannot be changed (``model_copy`` makes another,
    without checking: as pydantic's)."""

    # the fields live in ``__dict__``; ``_kept_hash``: ``cached_hash``'s value, once computed
    __slots__ = ("__dict__", "__weakref__", "_kept_hash")
    model_fields: typing.ClassVar[dict[str, FieldInfo]] = {}
    model_config: typing.ClassVar[dict[str, Any]] = {"frozen": True, "extra": "forbid"}
    _record_defaults: typing.ClassVar[dict[str, Any]] = {}
    _record_before: typing.ClassVar[dict[str, list[Any]]] = {}
    _record_after_field: typing.ClassVar[dict[str, list[Any]]] = {}
    _record_after: typing.ClassVar[tuple[Any, ...]] = ()
    _record_steps: typing.ClassVar[tuple[tuple[Any, ...], ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        config = cls.__dict__.get("model_config")
        if config is not None and (not config.get("frozen") or config.get("extra") != "forbid"):
            raise TypeError(f"{cls.__name__}: a Record is frozen and forbids extra fields")
        namespace = vars(sys.modules[cls.__module__])
        local: dict[str, Any] | None = None  # the class body's names, for eval
        fields = dict(cls.model_fields)
        for name, text in cls.__dict__.get("__annotations__", {}).items():
            annotation = _PLAIN.get(text) if isinstance(text, str) else text
            if annotation is None:
                local = dict(vars(cls)) if local is None else local
                annotation = eval(text, namespace, local)  # noqa: S307 - the class's own
            if typing.get_origin(annotation) is typing.ClassVar:
                continue
            value = cls.__dict__.get(name, _MISSING)
            info = value if isinstance(value, FieldInfo) else FieldInfo(value)
            info.annotation = annotation
            info.check = _field_check(annotation, info, f"{cls.__name__}.{name}")
            fields[name] = info
            if name in cls.__dict__:
                delattr(cls, name)  # the default lives in model_fields, not on the class
        before: dict[str, list[Any]] = {k: list(v) for k, v in cls._record_before.items()}
        after_field: dict[str, list[Any]] = {k: list(v) for k, v in
                                             cls._record_after_field.items()}
        after = list(cls._record_after)
        for attr, value in list(cls.__dict__.items()):
            if isinstance(value, _FieldValidator):
                function = value.function.__get__(None, cls)  # the classmethod, bound
                for name in value.names:
                    if name not in fields:
                        raise TypeError(f"{cls.__name__}: field_validator of no field {name!r}")
                    (before if value.mode == "before" else after_field).setdefault(
                        name, []).append(function)
                setattr(cls, attr, function)
            elif getattr(value, "__record_after__", False):
                after.append(value)
        cls.model_fields = fields
        cls._record_defaults = {k: f.default for k, f in fields.items()
                                if f.default is not _MISSING}
        cls._record_before, cls._record_after_field = before, after_field
        # what ``_checked`` reads of each field, in the fields' order, made once per class
        cls._record_steps = tuple(
            (name, info.default, info.check, tuple(before.get(name, ())),
             tuple(after_field.get(name, ())))
            for name, info in fields.items())
        cls._record_after = tuple(after)

    @classmethod
    def _checked(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The fields' values from ``data``, converted and checked (ValidationError)."""
        errors: list[dict[str, Any]] = []
        out: dict[str, Any] = {}
        given = 0  # names of ``data`` that are fields
        for name, default, check, before, after in cls._record_steps:
            if name in data:
                value = data[name]
                given += 1
            elif default is not _MISSING:
                out[name] = default
                continue
            else:
                errors.append(_error("missing", (name,), "Field required", data))
                continue
            try:
                for function in before:
                    value = _run_validator(function, value)
                value = check(value)
                for function in after:
                    value = _run_validator(function, value)
                out[name] = value
            except _Fail as fail:
                if fail.nested is not None:
                    errors.extend({**e, "loc": (name, *fail.loc, *e["loc"])} for e in fail.nested)
                else:
                    errors.append(_error(fail.kind, (name, *fail.loc), fail.msg, fail.value,
                                         fail.ctx))
        if given < len(data):
            fields = cls.model_fields
            for name in data:
                if name not in fields:
                    errors.append(_error("extra_forbidden", (name,),
                                         "Extra inputs are not permitted", data[name]))
        if errors:
            raise ValidationError(cls.__name__, errors)
        return out

    def __init__(self, **data: Any) -> None:
        cls = type(self)
        object.__setattr__(self, "__dict__", cls._checked(data))
        for check in cls._record_after:
            try:
                check(self)
            except (ValueError, AssertionError) as err:
                if isinstance(err, ValidationError):
                    raise
                kind, msg = _raised(err)
                raise ValidationError(cls.__name__, [_error(
                    kind, (), msg, data, {"error": err})]) from None

    def __getstate__(self) -> dict[str, Any]:
        """The fields alone (pickled or copied without the kept hash, restored into
        ``__dict__`` without ``__setattr__``)."""
        return self.__dict__

    def __setattr__(self, name: str, value: Any) -> None:
        raise ValidationError(type(self).__name__, [_error(
            "frozen_instance", (name,), "Instance is frozen", value)])

    def __delattr__(self, name: str) -> None:
        raise ValidationError(type(self).__name__, [_error(
            "frozen_instance", (name,), "Instance is frozen", None)])

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = cached_hash  # the field values' hash, computed once per object

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__repr_fields__(', ')})"

    def __str__(self) -> str:
        return self.__repr_fields__(" ")

    def __repr_fields__(self, sep: str) -> str:
        return sep.join(f"{k}={v!r}" for k, v in self.__dict__.items())

    @classmethod
    def model_validate(cls, obj: Any) -> Any:
        """``obj`` if it is one already, else a record of a mapping's items."""
        if isinstance(obj, cls):
            return obj
        if not isinstance(obj, dict):
            raise ValidationError(cls.__name__, [_error(
                "model_type", (), f"Input should be a valid dictionary or instance of "
                f"{cls.__name__}", obj, {"class_name": cls.__name__})])
        return cls(**obj)

    @classmethod
    def model_validate_json(cls, text: str | bytes) -> Any:
        import json

        try:
            data = json.loads(text)
        except ValueError as err:
            raise ValidationError(cls.__name__, [_error(
                "json_invalid", (), f"Invalid JSON: {err}", text)]) from None
        return cls.model_validate(data)

    @classmethod
    def model_construct(cls, **values: Any) -> Any:
        """A record of ``values`` and the defaults, unchecked (as pydantic's)."""
        record = object.__new__(cls)
        object.__setattr__(record, "__dict__", {**cls._record_defaults, **values})
        return record

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Any:
        """Another record with ``update``'s fields changed, unchecked (as pydantic's)."""
        data = dict(self.__dict__)
        if deep:
            import copy

            data = copy.deepcopy(data)
        if update:
            data.update(update)
        record = object.__new__(type(self))
        object.__setattr__(record, "__dict__", data)
        return record

    def model_dump(self, *, mode: str = "python", exclude: Any = None, round_trip: bool = False,
                   warnings: bool = True, exclude_none: bool = False,
                   exclude_defaults: bool = False) -> dict[str, Any]:
        """The fields as a dict, nested records as dicts (``exclude_none`` and
        ``exclude_defaults`` reach them, as pydantic's); ``mode="json"``: enums as their
        values, tuples and sets as lists."""
        json_mode = mode == "json"
        defaults = type(self)._record_defaults
        out = {}
        for k, v in self.__dict__.items():
            if (exclude and k in exclude) or (exclude_none and v is None) or (
                    exclude_defaults and k in defaults and defaults[k] == v):
                continue
            out[k] = (v.model_dump(mode=mode, exclude_none=exclude_none,
                                   exclude_defaults=exclude_defaults)
                      if isinstance(v, Record) else _dumped(v, json_mode))
        return out

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """A field of this type in a pydantic model (the calibration records): validated and
        dumped by the record itself."""
        from pydantic_core import core_schema

        return core_schema.no_info_plain_validator_function(
            cls.model_validate, serialization=core_schema.plain_serializer_function_ser_schema(
                lambda value, info: value.model_dump(
                    mode=info.mode, exclude_none=info.exclude_none,
                    exclude_defaults=info.exclude_defaults), info_arg=True))


def _run_validator(function: Any, value: Any) -> Any:
    try:
        return function(value)
    except _Fail:
        raise
    except (ValueError, AssertionError) as err:
        kind, msg = _raised(err)
        raise _Fail(kind, msg, value, ctx={"error": err}) from None


def _raised(err: Exception) -> tuple[str, str]:
    """A validator's ValueError or AssertionError as pydantic reports it: (type, message)."""
    if isinstance(err, ValueError):
        return "value_error", f"Value error, {err}"
    return "assertion_error", f"Assertion failed, {err}"


def _dumped(value: Any, json_mode: bool) -> Any:
    if isinstance(value, Record):
        return value.model_dump(mode="json" if json_mode else "python")
    if not json_mode:
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_dumped(v, True) for v in value]
    if isinstance(value, (set, frozenset)):
        return [_dumped(v, True) for v in value]
    return value
