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

import enum
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from memplan.errors import MemplanError, shown

# The command-line option of each ``memplan.api`` keyword the CLI's shared options set (the
# model aside: the API's first argument): the one table the CLI's options
# (``memplan.cli.options``), the API's messages and an imported config's mapping read. The flag
# is ``--`` and the option with ``-`` for ``_`` (``flag``).
CLI_OPTIONS: dict[str, str] = {
    **{name: name for name in (
        "gpus", "gpu", "gpu_memory", "tp", "pp", "vpp", "dp", "cp", "ep", "stage_layers",
        "dp_shard", "vocab_parallel", "tp_style", "grad_buffers", "offload", "zero",
        "recompute", "recompute_layers", "precision", "optimizer", "optimizer_impl",
        "attention", "logits_fp32", "framework", "keep_grads", "loss_chunks", "schedule",
        "calibration")},
    "sequence_parallel": "sp", "micro_batch_size": "mbs", "global_batch_size": "gbs",
    "seq_len": "seq", "norm_impl": "norm", "kv_cache": "use_cache",
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
    """The int and bool fields of a pydantic ``model`` among ``values`` are of their type (a
    pydantic model in lax mode would take ``"2"`` for 2 and ``True`` for 1); unknown names
    and the other fields are left to the model's own validation. ``names``: how the message
    names a field (``LABELS``: the CLI's flag names)."""
    fields = model.model_fields
    for key, value in values.items():
        if key not in fields or value is None:
            continue
        allowed = _base(fields[key].annotation)
        label = names.get(key, key)
        if bool in allowed and int not in allowed:
            boolean(label, value)
        elif int in allowed and not is_int(value):
            raise MemplanError(f"{label} must be an integer, got {shown(value)} "
                               f"({_kind(value)})")


def _submodel(annotation: Any) -> Any:
    """The pydantic model an annotation holds (``MoESpec | None`` -> MoESpec), or None."""
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
