"""Type and range checks of the Python API's arguments, each failure naming the argument.

``memplan.api`` takes names and numbers from Python callers, where nothing has parsed them:
``gpus="8"``, ``gpu=None`` or ``tp=2.0`` would otherwise reach the formulas and fail there as
a ``TypeError`` or, worse, be taken (``True`` is an ``int`` in Python, so ``tp=True`` would be
a TP degree of 1). Each check here raises ``MemplanError`` with the argument's name, what it
must be and the value given (``memplan.errors.shown``), before any work; the rules of the
layout itself (``tp (16) must divide num_kv_heads (8)``) stay in ``memplan.parallel``.

``CLI_OPTIONS`` is the one table of which command-line option sets which API keyword.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import operator
import types
import typing
import weakref
from collections.abc import Mapping
from typing import Any

from memplan.choices import PRUNE_FROM, Record, field_hash, prune
from memplan.errors import MemplanError, shown, validation_message
from memplan.units import MAX_INT64

# The command-line option of each ``memplan.api`` keyword the CLI's shared options set (the
# model aside: the API's first argument): the one table the CLI's options
# (``memplan.cli.options``), the API's messages and an imported config's mapping read. The flag
# is ``--`` and the option with ``-`` for ``_`` (``flag``).
CLI_OPTIONS: dict[str, str] = {
    **{name: name for name in (
        "gpus", "gpu", "gpu_memory", "tp", "pp", "vpp", "dp", "cp", "ep", "etp", "vpp_group",
        "stage_layers", "dp_shard", "vocab_parallel", "tp_style", "grad_buffers", "offload",
        "zero", "recompute", "recompute_layers", "recompute_every", "precision", "optimizer",
        "optimizer_impl", "attention", "logits_fp32", "framework", "keep_grads", "loss_chunks",
        "schedule", "calibration", "grad_sync", "compile", "float8", "optimizer_in_backward",
        "mtp_layers", "loss_impl", "moe_impl", "logits_held", "fsdp_version",
        "deltanet_kernel", "mamba_kernel", "mla_cache",
        "compile_loss", "compile_in_checkpoint",
        "lora_rank", "lora_targets", "lora_dropout", "base_quant",  # fine-tuning
        "float8_all_gather", "recompute_save", "async_tp")},
    "sequence_parallel": "sp", "micro_batch_size": "mbs", "global_batch_size": "gbs",
    "seq_len": "seq", "norm_impl": "norm", "kv_cache": "use_cache",
    "backward_prefetch": "fsdp_backward_prefetch", "use_orig_params": "fsdp_use_orig_params",
    "reshard_after_forward": "fsdp_reshard_after_forward",
}
# How a message names a keyword the CLI offers: its flag without the dashes (``mbs``,
# ``recompute-layers``); a keyword only the API takes keeps its own name.
LABELS: dict[str, str] = {key: option.replace("_", "-") for key, option in CLI_OPTIONS.items()}


def flag(keyword: str) -> str:
    """The command-line flag that sets ``keyword`` (``micro_batch_size`` -> ``--mbs``)."""
    return f"--{LABELS[keyword]}"


# The most GPUs a job may name: 2^24, over a hundred times the largest published training
# clusters (~100k GPUs), so a mistyped count fails here rather than in a search.
MAX_GPUS = 2**24


def _kind(value: Any) -> str:
    return type(value).__name__


def is_int(value: Any) -> bool:
    """A true integer: not a bool (an int subclass in Python, and in TOML/JSON a different
    type), not a float however round."""
    return isinstance(value, int) and not isinstance(value, bool)


def plain(name: str, value: Any) -> Any:
    """``value`` as the API's checks and formulas take it: an integral number of another type
    (numpy's ``int64``, anything with ``__index__`` but a bool) as an ``int``, recursively in
    lists, tuples and numpy arrays (``np.arange``); a record (or a pydantic model) validated anew
    (``revalidated``); anything else as it is, for the checks to judge."""
    if value is None or type(value) in (int, float, str, bool):
        return value
    if type(value) in (list, tuple):
        return type(value)(plain(name, item) for item in value)
    if isinstance(value, Record) or hasattr(type(value), "__pydantic_fields__"):
        return revalidated(name, value)  # (a calibration's pydantic record too)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        dataclass_fields(name, value)  # (Overheads: not validated when made)
        return value
    if hasattr(value, "__array__") and hasattr(value, "tolist"):  # a numpy array: its items
        return plain(name, value.tolist())
    if (not isinstance(value, (bool, int, float, str, enum.Enum))
            and hasattr(type(value), "__index__")):
        try:
            return operator.index(value)
        except TypeError:  # an __index__ that refuses (numpy's bool): judged as it is
            return value
    return value


# Objects ``revalidated`` has checked: id -> (a weak reference to the object given, its hash
# then, what its validation returned). Only frozen models whose fields all hash (no list or
# dict to change in place) are kept; a field set in place all the same (``object.__setattr__``
# gets past ``frozen``) changes the hash, and the object is checked anew. The entry goes with
# the object.
_CHECKED: dict[int, tuple[weakref.ref, int, Record]] = {}
_CHECKED_LIMIT = [PRUNE_FROM]


def revalidated(name: str, model: Record) -> Record:
    """A record ``model`` given to the API (or a pydantic one), validated again from its fields: an object made
    with ``model_copy(update=...)`` or ``model_construct(...)`` skipped validation, and would
    otherwise reach the formulas with a negative layer count or a missing field. One line
    naming the argument and the field otherwise. An object given again is answered from
    ``_CHECKED`` (by identity and the hash of its fields: a copy is a new object, checked
    anew)."""
    known = _known(model)
    if known is not None:
        return known
    kind = type(model)
    unknown = sorted(set(vars(model)) - set(kind.model_fields))
    if unknown:  # model_copy(update=...) sets a misspelt name as it is
        raise MemplanError(f"{name}: {kind.__name__} has no field {unknown[0]!r}")
    try:
        data = model.model_dump(round_trip=True, warnings=False)
    except Exception as err:  # noqa: BLE001 - a field holding what no dump can read
        raise MemplanError(f"{name}: this {kind.__name__} cannot be read back "
                           f"({type(err).__name__}); build it with {kind.__name__}(...)") from None
    try:
        checked = kind.model_validate(data)
    except ValueError as err:  # a Record's ValidationError, or pydantic's
        if not hasattr(err, "errors"):
            raise
        raise MemplanError(f"{name}: {kind.__name__} {validation_message(err)}") from None
    _remember(model, checked)
    return checked


def _known(model: Record) -> Record | None:
    """What ``model``'s validation returned, from ``_CHECKED``, if it is the object checked
    and its fields hash as they did then; else None."""
    seen = _CHECKED.get(id(model))
    if seen is None or seen[0]() is not model:
        return None
    try:
        same = field_hash(model) == seen[1]
    except TypeError:  # a field set in place to a list or dict since
        return None
    return seen[2] if same else None


def _remember(model: Record, checked: Record) -> None:
    """Keep ``checked`` for ``model`` in ``_CHECKED`` when ``model`` is frozen."""
    if not type(model).model_config.get("frozen"):
        return
    try:
        fields_hash = field_hash(model)
    except TypeError:  # a list or dict field: it may change in place
        return
    # no callback on the reference (Python runs one wherever the object dies, and a Ctrl-C
    # arriving during it is swallowed: tests/unit/test_faults.py): entries of dead objects
    # are dropped in bulk, and a later object given a dead one's id is told apart by the
    # reference (``_known``)
    prune(_CHECKED, _CHECKED_LIMIT, 0)
    _CHECKED[id(model)] = (weakref.ref(model), fields_hash, checked)


def plain_arguments(function: Any) -> Any:
    """``function`` with every argument made ``plain`` first (see there): the API's entry
    points take numpy integers and re-check the records they are given."""
    positional = function.__code__.co_varnames[:function.__code__.co_argcount]

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        args = tuple(plain(positional[i] if i < len(positional) else "argument", value)
                     for i, value in enumerate(args))
        return function(*args, **{key: plain(key, value) for key, value in kwargs.items()})

    return call  # (functools.wraps copies a cached function's cache_clear and cache_info)


def integer(name: str, value: Any, *, minimum: int | None = 1, maximum: int | None = None,
            optional: bool = False) -> int | None:
    """``value`` as an int in [minimum, maximum] (None allowed with ``optional``)."""
    if value is None and optional:
        return None
    if not is_int(value):
        raise MemplanError(f"{name} must be an integer, got {shown(value)} ({_kind(value)})")
    if minimum is not None and value < minimum:
        what = "positive" if minimum == 1 else f"at least {minimum}"
        raise MemplanError(f"{name} must be {what}, got {value}")
    if maximum is not None and value > maximum:
        raise MemplanError(f"{name} must be at most {maximum} (memplan's limit), got {value}")
    return value


def number(name: str, value: Any, *, low: float, high: float, high_open: bool = True,
           optional: bool = False) -> float | None:
    """``value`` as a finite real number in [low, high) (or [low, high] without
    ``high_open``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MemplanError(f"{name} must be a number, got {shown(value)} ({_kind(value)})")
    inside = low <= value < high if high_open else low <= value <= high
    if not math.isfinite(value) or not inside:
        bracket = ")" if high_open else "]"
        raise MemplanError(f"{name} must be in [{low:g}, {high:g}{bracket}, got {value}")
    return float(value)


def boolean(name: str, value: Any, *, optional: bool = False) -> bool | None:
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise MemplanError(f"{name} must be True or False, got {shown(value)} ({_kind(value)})")
    return value


def text(name: str, value: Any, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip():
        raise MemplanError(f"{name} must be a non-empty string, got {shown(value)} "
                           f"({_kind(value)})")
    return value


def one_of(name: str, value: Any, kinds: tuple[type, ...], *, what: str) -> Any:
    """``value`` if it is an instance of one of ``kinds``; ``what`` says it in words."""
    if not isinstance(value, kinds):
        raise MemplanError(f"{name} must be {what}, got {shown(value)} ({_kind(value)})")
    return value


def choice(name: str, value: Any, kind: type[enum.Enum], *, optional: bool = False) -> Any:
    """``value`` as a member of ``kind`` (a member or its value)."""
    if value is None and optional:
        return None
    try:
        return kind(value)
    except (ValueError, TypeError):
        names = ", ".join(str(m.value) for m in kind)
        raise MemplanError(f"{name} must be one of {names}, got {shown(value)}") from None


def strings(name: str, value: Any, *, optional: bool = True) -> list[str] | None:
    """A string or a list/tuple of strings, as a list."""
    if value is None and optional:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise MemplanError(f"{name} must be a string or a list of strings, got {shown(value)} "
                           f"({_kind(value)})")
    return list(items)


def _base(annotation: Any) -> set[type]:
    """The plain types an annotation allows (``int | None`` -> {int, NoneType})."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return {t for arg in typing.get_args(annotation) for t in _base(arg)}
    return {annotation} if isinstance(annotation, type) else set()


def model_fields(model: Any, values: Mapping[str, Any], names: Mapping[str, str]) -> None:
    """The int and bool fields of a record ``model`` among ``values`` are of their type (a
    record in lax mode, as pydantic's, would take ``"2"`` for 2 and ``True`` for 1); unknown names
    and the other fields are left to the model's own validation. ``names``: how the message
    names a field (``LABELS``: the CLI's flag names)."""
    kinds = _field_kinds(model)
    for key, value in values.items():
        kind = kinds.get(key)
        if kind is None or value is None:
            continue
        label = names.get(key, key)
        if kind is bool:
            boolean(label, value)
        elif not is_int(value):
            raise MemplanError(f"{label} must be an integer, got {shown(value)} "
                               f"({_kind(value)})")


@functools.lru_cache(maxsize=None)
def _field_kinds(model: Any) -> dict[str, type]:
    """The fields of a record ``model`` class ``model_fields`` checks, each with what it
    checks: ``bool`` (a bool field) or ``int`` (an int field, or one that allows both): the
    annotations read once per class, not at every call."""
    kinds: dict[str, type] = {}
    for key, field in model.model_fields.items():
        allowed = _base(field.annotation)
        if bool in allowed and int not in allowed:
            kinds[key] = bool
        elif int in allowed:
            kinds[key] = int
    return kinds


def dataclass_fields(name: str, obj: Any) -> None:
    """A dataclass given to the API (``OomReport``, ``Measured``, ``Overheads``) holds what its
    fields say: an int field an int (not a bool) from 0 to ``MAX_INT64`` (bytes, counts and
    indices are 64-bit), a float field a finite number >= 0, a str field a str, a dict, tuple
    or list field one (its items and nested dataclasses checked in turn).
    A dataclass is not validated when it is made, so one built by hand is checked here;
    one line naming the argument and the field otherwise."""
    hints = typing.get_type_hints(type(obj))
    for field in dataclasses.fields(obj):
        _check_value(f"{name}.{field.name}", getattr(obj, field.name), hints[field.name])


def _check_value(label: str, value: Any, annotation: Any) -> None:
    options = (typing.get_args(annotation) if isinstance(annotation, types.UnionType)
               or typing.get_origin(annotation) is typing.Union else (annotation,))
    if value is None and type(None) in options:
        return
    for option in options:
        origin = typing.get_origin(option) or option
        if option is Any or origin is Any:
            return
        if origin is int and is_int(value):
            if not 0 <= value <= MAX_INT64:
                raise MemplanError(f"{label} must be from 0 to {MAX_INT64}, got "
                                   f"{shown(value)}")
            return
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not (math.isfinite(value) and value >= 0):
                raise MemplanError(f"{label} must be a finite number >= 0, got {shown(value)}")
            return
        if origin in (str, bool) and isinstance(value, origin):
            return
        if origin in (dict, tuple, list) and isinstance(value, origin):
            _check_items(label, value, typing.get_args(option))
            return
        if dataclasses.is_dataclass(origin) and isinstance(value, origin):
            dataclass_fields(label, value)
            return
    raise MemplanError(f"{label} must be {_words(options)}, got {shown(value)} "
                       f"({_kind(value)})")


def _check_items(label: str, value: Any, args: tuple[Any, ...]) -> None:
    if isinstance(value, dict) and len(args) == 2:
        for key, item in value.items():
            _check_value(f"{label}[{key!r}]", item, args[1])
    elif len(args) == 1 or (len(args) == 2 and args[1] is Ellipsis):  # list[T], tuple[T, ...]
        for i, item in enumerate(value):
            _check_value(f"{label}[{i}]", item, args[0])


def _words(options: tuple[Any, ...]) -> str:
    names = [getattr(typing.get_origin(o) or o, "__name__", str(o)) for o in options]
    return " or ".join("None" if n == "NoneType" else f"{'an' if n[0] in 'aeiou' else 'a'} {n}"
                       for n in names)


def _submodel(annotation: Any) -> Any:
    """The record an annotation holds (``MoESpec | None`` -> MoESpec), or None."""
    for kind in _base(annotation):
        if hasattr(kind, "model_fields"):
            return kind
    return None


def file_fields(model: Any, data: Mapping[str, Any], prefix: str = "") -> None:
    """The scalars of a model file (TOML or JSON) are of their field's type, recursively
    into nested tables: an integer field takes an integer (TOML's and JSON's ``true`` is a
    boolean, ``"64"`` a string, ``64.0`` a float: none is read as 64), a boolean field a
    boolean, a number field a number, a string field a string. Enum values and unknown keys
    are left to the model's validation (``extra="forbid"`` names a misspelt key)."""
    fields = model.model_fields
    for key, value in data.items():
        if key not in fields or value is None:
            continue
        name = f"{prefix}{key}"
        annotation = fields[key].annotation
        allowed = _base(annotation)
        nested = _submodel(annotation)
        if nested is not None and isinstance(value, dict):
            file_fields(nested, value, f"{name}.")
        elif bool in allowed and int not in allowed:
            boolean(name, value)
        elif int in allowed and not is_int(value):
            raise MemplanError(f"{name} must be an integer, got {shown(value)} "
                               f"({_kind(value)})")
        elif float in allowed and (isinstance(value, bool)
                                   or not isinstance(value, (int, float))):
            raise MemplanError(f"{name} must be a number, got {shown(value)} ({_kind(value)})")
        elif allowed == {str} and not isinstance(value, str):
            raise MemplanError(f"{name} must be a string, got {shown(value)} ({_kind(value)})")
