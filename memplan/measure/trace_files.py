"""Chrome trace files as ``torch.profiler`` writes them: read whole, or as far as a cut one goes.

A trace is ``{..., "traceEvents": [event, ...], ...}`` (or the bare list of events), plain or
gzipped (``.json.gz``, told by its magic bytes). A job killed while its profiler exports, or a
copy stopped early, leaves a file cut short: a gzip stream without its end, JSON that stops
inside an event. Such a file is read as far as its last complete event; the result says it is
partial (``TraceFile.partial``: the file and where it ends), and the caller reports that.
Anything else that does not parse names the file and the line and column, or the event.

Events are checked where they are read: each is a JSON object, and a complete event
(``"ph": "X"``) has finite numbers ``ts`` and ``dur`` (``dur`` >= 0) and string ``name`` and
``cat`` where present.

``RankTrace`` is what ``memplan.measure.profiler_traces.load`` makes of one: its events
classified into compute, copies, communication, lanes and steps, which both the per-rank
analysis and ``memplan.measure.stragglers`` read.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError, shown
from memplan.arguments import MAX_GPUS
from memplan.inputs import TRACE_BYTES, read_maybe_gzip, too_large, too_long_number
from memplan.measure.intervals import Interval

WHAT = "trace"
_EVENTS_KEY = re.compile(r'"traceEvents"\s*:\s*\[')
_SPACE = re.compile(r"[\s,]*")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class TraceFile:
    """One trace: its top-level fields but the events (``meta``), its complete ("X") events,
    and, when the file is cut, where (``partial``), else None."""

    path: str
    meta: dict[str, Any]
    events: list[dict[str, Any]]
    partial: str | None = None
    # the "[memory]" instant events of a trace made with profile_memory=True, checked
    # (memplan.measure.memory_timeline)
    instants: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RankTrace:
    """The events of one rank's trace, classified."""

    path: str
    rank: int
    world_size: int | None
    device: str  # "gpu" or "cpu"
    compute: list[Interval] = field(default_factory=list)
    copies: list[Interval] = field(default_factory=list)
    comm: list[tuple[str, float, float]] = field(default_factory=list)  # (collective, lo, hi)
    # busy intervals of each GPU stream (GPU traces) or thread (CPU traces)
    lanes: dict[str, list[Interval]] = field(default_factory=dict)
    steps: list[tuple[int, float, float]] = field(default_factory=list)  # (number, lo, hi)
    partial: str | None = None  # a cut file read up to its last complete event: where it ends


def _text(data: bytes, p: Path, cut: bool) -> str:
    """UTF-8 text (without a byte-order mark); a cut file may end inside a character, which
    is dropped."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        if cut and err.start >= len(data) - 3:
            return data[:err.start].decode("utf-8").removeprefix("\ufeff")
        raise MemplanError(f"{WHAT}: {p} is not UTF-8 text (byte offset {err.start} of the "
                           f"{'decompressed ' if cut else ''}data: "
                           f"{data[err.start:err.start + 1]!r}); not a chrome trace") from None


def _ends_early(err: json.JSONDecodeError, text: str) -> bool:
    """Whether a JSON error is the end of the text arriving too soon (a cut file), rather
    than a wrong byte inside it."""
    return err.msg.startswith("Unterminated string") or not text[err.pos:].strip()


def _where(err: json.JSONDecodeError) -> str:
    return f"{err.msg} at line {err.lineno} column {err.colno} (char {err.pos})"


def _salvage(text: str, p: Path) -> tuple[Any, int]:
    """The top-level fields before ``traceEvents`` and every complete event of a cut trace:
    ({..., "traceEvents": [...]}, events read)."""
    m = _EVENTS_KEY.search(text)
    if text.lstrip().startswith("["):
        meta: dict[str, Any] = {}
        pos = text.index("[") + 1
    elif m is not None:
        try:  # the fields before the events, closed as an object
            meta = json.loads(text[:m.start()].rstrip().rstrip(",") + "}")
        except (ValueError, RecursionError):  # ValueError: an over-long integer too
            meta = {}
        pos = m.end()
        meta = meta if isinstance(meta, dict) else {}
    else:
        raise MemplanError(f"{WHAT}: {p} is cut before its traceEvents list: no events to read")
    events = []
    while True:
        pos = _SPACE.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            event, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the event the file was cut in
        except RecursionError:
            break
        except ValueError:  # an integer over Python's digit limit, not a cut
            raise too_long_number(p, WHAT) from None
        events.append(event)
    return {**meta, "traceEvents": events}, len(events)


def _number(e: dict[str, Any], key: str, i: int, p: Path) -> float:
    value = e.get(key)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or too_large(value)
            or not math.isfinite(value)):  # (an int past 64 bits would overflow a float)
        raise MemplanError(f"{WHAT}: {p}: event {i} ({shown(e.get('name'))}) has {key} "
                           f"{shown(value)}, not a number of microseconds")
    return float(value)


def _complete(events: Any, p: Path) -> list[dict[str, Any]]:
    """The checked complete ("X") events among ``events``."""
    if not isinstance(events, list):
        raise MemplanError(f"{WHAT}: {p}: traceEvents is {type(events).__name__}, not a list: "
                           "not a chrome trace")
    out = []
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise MemplanError(f"{WHAT}: {p}: event {i} is {shown(e)}, not an object: not a "
                               "chrome trace")
        if e.get("ph") != "X" or "dur" not in e:
            continue
        _number(e, "ts", i, p)
        if _number(e, "dur", i, p) < 0:
            raise MemplanError(f"{WHAT}: {p}: event {i} ({shown(e.get('name'))}) has a negative "
                               f"dur ({e['dur']})")
        for key in ("name", "cat"):
            if key in e and not isinstance(e[key], str):
                raise MemplanError(f"{WHAT}: {p}: event {i} has {key} {shown(e[key])}, not a "
                                   "string")
        out.append(e)
    return out


def _meta(data: dict[str, Any], p: Path) -> dict[str, Any]:
    meta = {k: v for k, v in data.items() if k != "traceEvents"}
    info = meta.get("distributedInfo")
    if info is None:
        return meta
    if not isinstance(info, dict):
        raise MemplanError(f"{WHAT}: {p}: distributedInfo is {shown(info)}, not an object")
    for key, low in (("rank", 0), ("world_size", 1)):
        value = info.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not low <= value <= MAX_GPUS):
            raise MemplanError(f"{WHAT}: {p}: distributedInfo.{key} is {shown(value)}, not an "
                               f"integer from {low} to {MAX_GPUS}")
    return meta


def read_trace(path: str | Path) -> TraceFile:
    """One chrome trace, checked; a cut one up to its last complete event (see the module
    docstring). Raises MemplanError naming the file and the place that is wrong."""
    p = Path(path)
    raw = read_maybe_gzip(p, WHAT, TRACE_BYTES)
    text = _text(raw.data, p, raw.cut is not None)
    partial = None
    try:
        data = json.loads(text)
    except RecursionError:  # (only the known keys of events are read: no depth limit below)
        raise MemplanError(f"{WHAT}: {p} nests too deep for Python's JSON parser: not a "
                           "chrome trace") from None
    except json.JSONDecodeError as err:
        if raw.cut is None and not _ends_early(err, text):
            raise MemplanError(f"{WHAT}: {p} is not a readable chrome trace: invalid JSON, "
                               f"{_where(err)}") from None
        data, count = _salvage(text, p)
        end = (f"its gzip stream ends at compressed byte {raw.cut:,}" if raw.cut is not None
               else f"its JSON ends at line {text.count(chr(10)) + 1}")
        partial = (f"{p} is cut ({end}, as a killed job or an unfinished copy leaves it): "
                   f"read up to its last complete event, {count} events")
    except ValueError:  # not a syntax error: an integer over Python's digit limit
        raise too_long_number(p, WHAT) from None
    else:
        if raw.cut is not None:  # the JSON closed although the gzip stream did not
            partial = f"{p}: its gzip stream ends early at compressed byte {raw.cut:,}"
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict):
        raise MemplanError(f"{WHAT}: {p} holds {shown(data)}, not a chrome trace object")
    events = data.get("traceEvents", [])
    return TraceFile(str(p), _meta(data, p), _complete(events, p), partial,
                     _memory(events, p) if isinstance(events, list) else [])


# the args of a "[memory]" event that are integers (bytes; c10's DeviceType and index)
_MEMORY_INTS = ("Bytes", "Total Allocated", "Device Type")


def _memory(events: list[Any], p: Path) -> list[dict[str, Any]]:
    """The checked "[memory]" instant events among ``events`` (already checked objects)."""
    out = []
    for i, e in enumerate(events):
        if e.get("name") != "[memory]" or e.get("ph") != "i":
            continue
        _number(e, "ts", i, p)
        args = e.get("args")
        if not isinstance(args, dict):
            raise MemplanError(f"{WHAT}: {p}: memory event {i} has args {shown(args)}, not an "
                               "object")
        for key in (*_MEMORY_INTS, "Total Reserved", "Device Id"):
            value = args.get(key)
            if (key in _MEMORY_INTS or value is not None) and (
                    isinstance(value, bool) or not isinstance(value, int) or too_large(value)):
                raise MemplanError(f"{WHAT}: {p}: memory event {i} has {key} {shown(value)}, "
                                   "not an integer")
        out.append(e)
    return out


__all__ = ["RankTrace", "TraceFile", "read_trace"]
