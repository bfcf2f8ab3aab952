"""``memplan.choices.Record``, the typed inputs' base, against pydantic itself: the same fields
declared on a ``Record`` and on a frozen pydantic ``BaseModel`` (``extra="forbid"``) convert the
same inputs to the same values and refuse the same inputs with the same first error (type,
loc, message), so every message memplan built on pydantic's reads as before. And the command
line's option conversion (``memplan.cli.PlainValue``) against typer's own pydantic adapter for
the same option."""

from __future__ import annotations

import copy
import enum
import pickle
from typing import Literal

import pydantic
import pytest

from memplan.choices import Field, Record, lax_value, model_validator
from memplan.errors import ValidationError, validation_message


class Colour(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 0
    HIGH = 1


class Inner(Record):
    width: int = Field(gt=0, le=64)
    kind: Colour = Colour.RED


class Outer(Record):
    name: str
    layers: int = Field(default=1, gt=0, le=10_000)
    ratio: float = Field(default=0.0, ge=0.0, lt=1.0)
    cap: float | None = Field(default=None, gt=0)
    window: int | None = Field(default=None, gt=0, le=1024)
    flag: bool = False
    colour: Colour = Colour.RED
    level: Level = Level.LOW
    dims: tuple[int, ...] = ()
    names: tuple[str, ...] | None = None
    pair: tuple[Literal["a", "b"], tuple[int, ...]] = ("a", ())
    colours: frozenset[Colour] = frozenset()
    short: str = Field(default="", max_length=3)
    inner: Inner | None = None

    @model_validator(mode="after")
    def _check(self) -> Outer:
        if self.window is not None and self.window > self.layers * 100:
            raise ValueError(f"window ({self.window}) must be at most 100 x layers "
                             f"({self.layers})")
        return self


def _pydantic_twins() -> tuple[type, type]:
    """``Inner`` and ``Outer`` as frozen pydantic models of the same names and fields."""
    frozen = pydantic.ConfigDict(frozen=True, extra="forbid")
    inner = pydantic.create_model(
        "Inner", __config__=frozen, width=(int, pydantic.Field(gt=0, le=64)),
        kind=(Colour, Colour.RED))

    def check(self):
        return Outer._check(self)

    outer = pydantic.create_model(
        "Outer", __config__=frozen,
        __validators__={"_check": pydantic.model_validator(mode="after")(check)},
        **{name: (info.annotation if name != "inner" else inner | None,
                  pydantic.Field(**{k: getattr(info, k) for k in ("gt", "ge", "lt", "le",
                                                                   "max_length")
                                    if getattr(info, k) is not None},
                                 **({} if info.is_required() else {"default": info.default})))
           for name, info in Outer.model_fields.items()})
    return inner, outer


PInner, POuter = _pydantic_twins()


# Inputs each field is given (beside name="m"): accepted ones and refused ones of every kind
CASES = [
    {}, {"layers": 3}, {"layers": True}, {"layers": 2.0}, {"layers": 2.5}, {"layers": "7"},
    {"layers": " 8 "}, {"layers": "3.0"}, {"layers": "1_000"}, {"layers": "1e3"},
    {"layers": "x"}, {"layers": ""}, {"layers": 0}, {"layers": -1}, {"layers": 10_001},
    {"layers": None}, {"layers": [1]}, {"layers": float("nan")}, {"layers": float("inf")},
    {"layers": "1" * 5000}, {"layers": 10**30},
    {"ratio": 0.5}, {"ratio": 1}, {"ratio": "0.25"}, {"ratio": "abc"}, {"ratio": -0.1},
    {"ratio": float("nan")}, {"ratio": True}, {"ratio": None},
    {"cap": None}, {"cap": 30}, {"cap": 0}, {"cap": "2"},
    {"window": None}, {"window": 100}, {"window": 0}, {"window": 2048}, {"window": 150},
    {"flag": True}, {"flag": 1}, {"flag": 0}, {"flag": "yes"}, {"flag": "off"},
    {"flag": "maybe"}, {"flag": 2}, {"flag": None}, {"flag": 1.0}, {"flag": [True]},
    {"colour": "blue"}, {"colour": Colour.BLUE}, {"colour": "green"}, {"colour": 1},
    {"level": 1}, {"level": Level.HIGH}, {"level": 5}, {"level": "low"},
    {"dims": [1, 2]}, {"dims": (3,)}, {"dims": "ab"}, {"dims": [1, "x"]}, {"dims": 5},
    {"names": ["a"]}, {"names": None}, {"names": [1]},
    {"pair": ["b", [1, 2]]}, {"pair": ["c", []]}, {"pair": ["a"]}, {"pair": ["a", [1], 3]},
    {"colours": ["red"]}, {"colours": {"blue", "red"}}, {"colours": ["pink"]},
    {"colours": "red"},
    {"short": "abc"}, {"short": "abcd"}, {"short": 3},
    {"inner": {"width": 8}}, {"inner": {"width": 0}}, {"inner": {"width": 8, "x": 1}},
    {"inner": {}}, {"inner": 3}, {"inner": {"width": 8, "kind": "mauve"}},
    {"bogus": 1}, {"layers": 0, "bogus": 1}, {"layers": 0, "ratio": 2.0},
]


def _first(err: Exception) -> tuple:
    first = err.errors()[0]
    return first["type"], tuple(first["loc"]), first["msg"]


@pytest.mark.parametrize("given", CASES, ids=[repr(c)[:40] for c in CASES])
def test_a_record_converts_and_refuses_as_pydantic(given) -> None:
    """Each input: the same fields' values, or the same first error and message."""
    data = {"name": "m", **given}
    try:
        expected = POuter(**data)
    except pydantic.ValidationError as err:
        with pytest.raises(ValidationError) as ours:
            Outer(**data)
        assert _first(ours.value) == _first(err)
        assert validation_message(ours.value) == validation_message(err)
        assert ours.value.error_count() == err.error_count()
        return
    record = Outer(**data)
    want = expected.model_dump()
    assert record.model_dump() == want
    assert {k: type(v) for k, v in record.model_dump().items()} == \
        {k: type(v) for k, v in want.items()}
    assert record.model_dump(mode="json") == expected.model_dump(mode="json") or \
        given.get("colours")  # (a set's JSON order is the set's)


def test_a_missing_field_and_a_record_not_a_dict() -> None:
    for kind, ours in ((POuter, Outer), (PInner, Inner)):
        with pytest.raises(pydantic.ValidationError) as theirs:
            kind()
        with pytest.raises(ValidationError) as mine:
            ours()
        assert _first(mine.value) == _first(theirs.value)
        assert mine.value.errors()[0]["input"] == theirs.value.errors()[0]["input"] == {}
    with pytest.raises(pydantic.ValidationError) as theirs:
        POuter.model_validate([1])
    with pytest.raises(ValidationError) as mine:
        Outer.model_validate([1])
    assert _first(mine.value) == _first(theirs.value)


def test_a_record_is_frozen_hashable_and_copies_unchecked() -> None:
    """Frozen as pydantic's (the error a ValidationError of type frozen_instance); equal by
    fields and hashed by them; ``model_copy(update=)`` and ``model_construct`` do not check
    (as pydantic's: ``memplan.arguments.revalidated`` checks such objects again)."""
    rec = Outer(name="m", layers=3, inner={"width": 8})
    with pytest.raises(ValidationError) as err:
        rec.layers = 4
    assert _first(err.value) == ("frozen_instance", ("layers",), "Instance is frozen")
    assert rec == Outer(name="m", layers=3, inner=Inner(width=8))
    assert hash(rec) == hash(tuple(getattr(rec, k) for k in Outer.model_fields))
    assert rec != rec.model_copy(update={"layers": 4})
    bad = rec.model_copy(update={"layers": -5})
    assert bad.layers == -5 and rec.layers == 3
    assert Outer.model_construct(layers=0).model_dump()["layers"] == 0
    assert "name" not in Outer.model_construct().__dict__  # (required: absent, as pydantic's)
    assert Outer.model_validate(rec) is rec
    assert pickle.loads(pickle.dumps(rec)) == rec
    assert copy.deepcopy(rec) == rec and rec.model_copy(deep=True) == rec
    assert repr(Inner(width=2)) == repr(PInner(width=2)).replace("PInner", "Inner")
    assert str(Inner(width=2)) == str(PInner(width=2))
    assert Outer.model_fields["layers"].is_required() is False
    assert Outer.model_fields["name"].is_required() is True
    assert Outer.model_fields["window"].annotation == (int | None)


def test_dump_options_as_pydantic() -> None:
    """``exclude``, ``exclude_none`` and ``exclude_defaults`` drop what pydantic's drop, nested
    records included."""
    data = {"name": "m", "layers": 1, "cap": None, "window": 50, "inner": {"width": 8}}
    for kw in ({}, {"exclude_none": True}, {"exclude_defaults": True},
               {"exclude_none": True, "exclude_defaults": True}, {"exclude": {"dims"}}):
        for mode in ("python", "json"):
            assert Outer(**data).model_dump(mode=mode, **kw) == \
                POuter(**data).model_dump(mode=mode, **kw), (kw, mode)


def test_a_record_inside_a_pydantic_model() -> None:
    """A calibration file's pydantic record holds a ``ModelSpec``: validated and dumped by the
    record (``Record.__get_pydantic_core_schema__``)."""

    class Holder(pydantic.BaseModel):
        inner: Inner

    held = Holder(inner={"width": 4, "kind": "blue"})
    assert held.inner == Inner(width=4, kind=Colour.BLUE)
    assert held.model_dump(mode="json") == {"inner": {"width": 4, "kind": "blue"}}
    assert held.model_dump(mode="json", exclude_defaults=True) == {"inner": {"width": 4,
                                                                             "kind": "blue"}}
    assert Holder(inner={"width": 4}).model_dump(exclude_defaults=True) == {"inner": {"width": 4}}
    assert Holder.model_validate_json(held.model_dump_json()) == held
    with pytest.raises(pydantic.ValidationError, match="greater than 0"):
        Holder(inner={"width": 0})


@pytest.mark.parametrize("kind", [int, float, bool])
@pytest.mark.parametrize("text", ["3", " 4 ", "3.0", "2.5", "1e3", "1_000", "-2", "", "x",
                                  "inf", "nan", "yes", "off", "1", "0", "True", "\u0663",
                                  "1" * 5000])
def test_lax_value_is_pydantic_lax_mode(kind, text) -> None:
    adapter = pydantic.TypeAdapter(kind)
    try:
        want = adapter.validate_python(text)
    except pydantic.ValidationError as err:
        with pytest.raises(ValidationError) as ours:
            lax_value(kind, text)
        assert _first(ours.value)[0::2] == _first(err)[0::2]
        return
    got = lax_value(kind, text)
    assert type(got) is type(want) and (got == want or want != want)


def test_option_values_convert_as_typer_does() -> None:
    """``memplan estimate``'s options: each value converted by ``PlainValue`` as typer's own
    pydantic adapter converts it (``typer._coercion.build_runtime_param``), or refused with
    the same message."""
    import typer
    from typer import BadParameter
    from typer._coercion import build_runtime_param

    from memplan.cli import PlainValue, _command_for

    group = _command_for(["estimate"])
    command = group.commands["estimate"]
    ctx = typer.Context(command)
    values = ["8", "x", "2.5", "0", "-1", "1_0", "bf16-mixed", "BF16-MIXED", "full", "yes", "",
              "0.5", "1e2"]
    checked = 0
    for param in command.params:
        ours = param._runtime_param
        assert isinstance(ours, PlainValue), param.name
        if ours.kind is None:  # (a path: typer's own)
            continue
        theirs = build_runtime_param(param.type_descriptor)
        for value in ([["a", "b"]] if ours.kind is list else values):
            outcomes = []
            for runtime in (ours, theirs):
                try:
                    outcomes.append(("ok", runtime.coerce(value, param=param, ctx=ctx)))
                except BadParameter as err:
                    outcomes.append(("bad", err.format_message()))
            assert outcomes[0] == outcomes[1], (param.name, value)
            checked += 1
    assert checked > 400


def test_no_weak_reference_with_a_callback_on_a_record() -> None:
    """The hash cache and the API's checked-object cache keep plain weak references: Python
    runs a reference's callback wherever the object dies, and a Ctrl-C arriving during one is
    swallowed ("Exception ignored in"), which let ``memplan plan`` run on after SIGINT. A
    workload hashed and checked by the API has references, none with a callback."""
    import weakref

    import memplan
    from memplan.api import make_workload
    from memplan.arguments import revalidated

    spec = memplan.load_model("tiny")
    wl = make_workload(spec, seq_len=64)
    hash(wl)
    revalidated("workload", wl)
    refs = weakref.getweakrefs(wl)
    assert refs and all(r.__callback__ is None for r in refs)


def test_id_table_prunes_dead_objects() -> None:
    """``prune`` (the API's checked-object table, ``memplan.arguments``) drops the entries of
    dead objects once the table reaches its limit, keeps the live ones and sets the next
    limit to twice what stays (at least ``PRUNE_FROM``)."""
    import weakref

    from memplan.choices import PRUNE_FROM, prune

    class Obj:
        pass

    live = [Obj() for _ in range(3)]
    table = {id(o): (7, weakref.ref(o)) for o in live}
    dead = Obj()
    table[id(dead)] = (9, weakref.ref(dead))
    del dead
    limit = [4]
    prune(table, limit, 1)
    assert sorted(table) == sorted(id(o) for o in live) and limit == [PRUNE_FROM]
    limit = [10]
    prune(table, limit, 1)  # under the limit: nothing done
    assert len(table) == 3 and limit == [10]
