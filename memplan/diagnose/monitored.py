"""``MemoryMonitor`` JSONL files as evidence: a running job's per-step memory against the estimate.

Reads the files ``memplan.monitor.MemoryMonitor`` writes (one ``memory_rank<R>.jsonl`` per rank,
one JSON record per training step), reduces them with ``memplan.monitor.summarize`` to the
worst rank (the largest allocated peak), and sets that rank's measured peak, reserved bytes,
allocator cache and headroom next to the estimate of its pipeline stage. Allocation retries,
OOMs and growth (the monitor's own leak rule, ``memplan.monitor.trend``, over each rank's whole
run) are looked for on every rank.
Torch-free; sizes stay int bytes until ``memplan.report.diagnose``.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.diagnose.explain import Finding
from memplan.errors import MemplanError, shown
from memplan.inputs import MONITOR_BYTES, UTF8_BOM, regular_file, size_text, too_large
from memplan.model.estimate import Estimate
from memplan.monitor.memory_monitor import MemoryMonitor
from memplan.monitor.records import summarize
from memplan.overheads import NOTABLE_CACHE_FRACTION

# The file name MemoryMonitor.start writes, as memplan.monitor.read_records globs it.
RECORD_GLOB = "memory_rank*.jsonl"
# The monitor's own thresholds (its constructor's defaults), so a diagnosis flags what a
# default monitor flags: headroom under min_headroom_pct of capacity, a peak more than
# deviation_pct from the prediction (a leak: memplan.monitor.summarize's trend, the same rule).
_DEFAULTS = inspect.signature(MemoryMonitor).parameters
MIN_HEADROOM_PCT: float = _DEFAULTS["min_headroom_pct"].default
DEVIATION_PCT: float = _DEFAULTS["deviation_pct"].default
# Counters a record may hold (memplan.monitor: the allocator's, and the two it derives).
_INT_KEYS = ("allocated_bytes", "reserved_bytes", "peak_bytes", "inactive_split_bytes",
             "alloc_retries", "num_ooms", "capacity_bytes", "fragmentation_bytes",
             "headroom_bytes")
# Derived differences, which a record may hold below zero (reserved under allocated between
# the allocator's reads; reserved above the capacity the driver reports).
_SIGNED_KEYS = ("fragmentation_bytes", "headroom_bytes")
# A record is ~1.5 KiB (memplan.monitor); a line this long is not one.
MAX_LINE_BYTES = 1024 * 1024
CRLF = b"\r\n"
_RECORD_START = re.compile(r'\{\s*"rank"\s*:')


@dataclass(frozen=True)
class Monitored:
    """Every rank's records in file order, and ``summarize``'s reduction of them."""

    files: tuple[str, ...]
    records: dict[int, tuple[dict[str, Any], ...]]
    summary: dict[str, Any]
    partial: tuple[str, ...] = ()  # what a killed job left and was skipped, by file and line

    @property
    def worst_rank(self) -> int:
        """The rank with the largest allocated peak among those that recorded bytes
        (``summarize``'s key), else ``summarize``'s choice (the slowest median step)."""
        ranks = self.summary["ranks"]
        with_bytes = [k for k in ranks if "max_peak_bytes" in ranks[k]]
        if not with_bytes:
            return self.summary["worst_rank"]
        return max(with_bytes, key=lambda k: ranks[k]["max_peak_bytes"])

    @property
    def worst(self) -> dict[str, Any]:
        return self.summary["ranks"][self.worst_rank]

    @property
    def capacity_bytes(self) -> int | None:
        """The device capacity the worst rank recorded (None without allocator counters)."""
        caps = [r["capacity_bytes"] for r in self.records[self.worst_rank] if "capacity_bytes" in r]
        return max(caps) if caps else None


def revalidated(given: Any) -> Monitored:
    """A ``Monitored`` given to the API, checked as its files would be: each record a
    MemoryMonitor record (``_check``), and the summary made anew from them (a summary built
    by hand would otherwise be trusted). One line naming the rank and record otherwise."""
    records = given.records
    if not isinstance(records, dict) or not all(
            type(rank) is int and isinstance(recs, (tuple, list))
            for rank, recs in records.items()):
        raise MemplanError(f"monitor: Monitored.records must map each rank (an int) to its "
                           f"records, got {shown(records)}")
    every = [_check(f"monitor: rank {rank} record {i}", rec)
             for rank, recs in records.items() for i, rec in enumerate(recs)]
    if not every:
        raise MemplanError("monitor: Monitored.records holds no records")
    return Monitored(tuple(map(str, given.files)),
                     {k: tuple(v) for k, v in sorted(records.items())}, summarize(every),
                     tuple(map(str, given.partial)))


def _files(path: str, what: str) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob(RECORD_GLOB))
        if not found:
            raise MemplanError(f"{what}: {p} holds no {RECORD_GLOB} files")
        return [regular_file(f, what) for f in found]
    return [regular_file(p, what)]


def _check(where: str, rec: Any) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise MemplanError(f"{where}: a record is a JSON object, not {type(rec).__name__}")
    huge = next((k for k, v in rec.items() if too_large(v)), None)
    if huge is not None:  # past 64 bits: no counter the monitor writes (and past a float's
        raise MemplanError(f"{where}: {huge!r} is {shown(rec[huge])}, past the 64-bit range "
                           "of a counter (not a MemoryMonitor record)")
    when = rec.get("time")
    if when is not None and (type(when) not in (int, float) or not math.isfinite(when)):
        raise MemplanError(f"{where}: 'time' is {shown(when)}, not a number of seconds (not a "
                           "MemoryMonitor record)")
    for key, low in (("rank", 0), ("step", 1)):
        value = rec.get(key)
        if type(value) is not int or value < low:
            raise MemplanError(f"{where}: {key!r} is {shown(value)}, not an int >= {low} "
                               "(not a MemoryMonitor record)")
    took = rec.get("step_time_s")
    if type(took) not in (int, float) or not math.isfinite(took) or took < 0:
        raise MemplanError(f"{where}: 'step_time_s' is {shown(took)}, not a number of seconds "
                           ">= 0 (not a MemoryMonitor record)")
    for key in _INT_KEYS:
        if key in rec and (type(rec[key]) is not int
                           or (rec[key] < 0 and key not in _SIGNED_KEYS)):
            raise MemplanError(f"{where}: {key!r} is {shown(rec[key])}, not a byte count")
    warned = rec.get("warnings", [])
    if not isinstance(warned, list) or not all(isinstance(w, str) for w in warned):
        raise MemplanError(f"{where}: 'warnings' is {shown(warned)}, not a list of strings")
    return rec


def _restarted(line: str) -> tuple[dict[str, Any], int] | None:
    """A record cut by a killed job with the restarted job's first record appended to it on
    the same line (the monitor appends): (that record, bytes of the cut one), or None."""
    for m in _RECORD_START.finditer(line, 1):
        try:
            rec = json.loads(line[m.start():])
        except (ValueError, RecursionError):
            continue
        return rec, m.start()
    return None


def _lines(file: Path, what: str):
    """(number, text, ends with a newline) of each line of ``file``, bounded in length."""
    try:
        size = file.stat().st_size
        if size > MONITOR_BYTES:
            raise MemplanError(f"{what}: {file} is {size:,} bytes, over the "
                               f"{size_text(MONITOR_BYTES)} limit for monitor files")
        with file.open("rb") as fh:
            offset = 0
            for num, raw in enumerate(iter(lambda: fh.readline(MAX_LINE_BYTES + 1), b""), 1):
                if len(raw) > MAX_LINE_BYTES:
                    raise MemplanError(f"{what}: {file} line {num} (byte offset {offset:,}) is "
                                       f"longer than {size_text(MAX_LINE_BYTES)}: not a "
                                       "MemoryMonitor record")
                yield num, raw, offset
                offset += len(raw)
    except OSError as err:
        raise MemplanError(f"{what}: cannot read {file}: {err.strerror or err}") from None


def _cut(err: Exception, line: str) -> bool:
    """Whether a JSON error is the line ending too soon (a record cut short) rather than a
    wrong byte inside it."""
    if not isinstance(err, json.JSONDecodeError):
        return False
    return (err.msg.startswith(("Unterminated string", "Invalid control character"))
            or not line[err.pos:].strip())


def _read_file(file: Path, what: str) -> tuple[list[dict[str, Any]], list[str]]:
    """One file's records, each checked, naming the line (and byte offset) that is not a
    record; and notes on what a killed job left and was skipped (its last record cut short;
    a cut record a restarted job appended to). Line by line here rather than
    ``memplan.monitor.read_records``, which cannot say which line failed."""
    out: list[dict[str, Any]] = []
    notes: list[str] = []
    lines = _lines(file, what)
    ahead = next(lines, None)
    while ahead is not None:
        num, raw, offset = ahead
        ahead = next(lines, None)
        last = ahead is None
        where = f"{what}: {file} line {num} (byte offset {offset:,})"
        try:
            if num == 1 and raw.startswith(UTF8_BOM):  # an editor's byte-order mark
                raw, offset = raw[len(UTF8_BOM):], offset + len(UTF8_BOM)
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            if not (last and err.start >= len(raw.rstrip(CRLF)) - 3):
                raise MemplanError(f"{where} is not UTF-8 text (byte offset "
                                   f"{offset + err.start:,})") from None
            line = raw[:err.start].decode("utf-8")  # the job stopped inside a character
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError) as err:  # ValueError: an over-long integer
            if last and _cut(err, line):
                size = len(raw.rstrip(CRLF))
                notes.append(f"{file} line {num} is cut ({size} bytes of a record: the job "
                             f"stopped while writing it); the {len(out)} records before it "
                             "are used")
                break
            found = _restarted(line)
            if found is None:
                detail = (f"{err.msg}, column {err.colno}" if isinstance(err, json.JSONDecodeError)
                          else "nested too deep" if isinstance(err, RecursionError)
                          else f"an integer of more than {sys.get_int_max_str_digits() or 4300} "
                          "digits")
                raise MemplanError(f"{where} is not JSON ({detail})") from None
            rec, cut = found
            notes.append(f"{file} line {num} starts with a record cut by a stopped job ({cut} "
                         "bytes, skipped) before the restarted job's first record")
        out.append(_check(where, rec))
    if not out:
        raise MemplanError(f"{what}: {file} holds no records"
                           + (f" ({notes[0]})" if notes else ""))
    return out, notes


def read_monitor(paths: Sequence[str], what: str = "--monitor") -> Monitored:
    """The records of ``paths`` (JSONL files, or directories of ``memory_rank*.jsonl``).
    Raises MemplanError naming the file (and line) that is missing or not a record; what a
    killed job left (a cut last line) is skipped and said in ``Monitored.partial``. ``what``
    names the input in messages (the option or command)."""
    files = [f for p in paths for f in _files(str(p), what)]
    by_rank: dict[int, list[dict[str, Any]]] = {}
    partial: list[str] = []
    for f in files:
        records, notes = _read_file(f, what)
        partial += notes
        for rec in records:
            by_rank.setdefault(rec["rank"], []).append(rec)
    every = [r for recs in by_rank.values() for r in recs]
    return Monitored(tuple(map(str, files)),
                     {k: tuple(v) for k, v in sorted(by_rank.items())}, summarize(every),
                     tuple(partial))


def _pct(measured: int, predicted: int) -> str:
    return f"{100.0 * (measured - predicted) / predicted:+.1f}%" if predicted else "n/a"


def _versus(sizes: dict[str, int], name: str, measured: int, predicted: int) -> str:
    """``sizes[name_gap_bytes]`` and the words: how far ``measured`` is from ``predicted``."""
    sizes[f"{name}_gap_bytes"] = abs(measured - predicted)
    where = "above" if measured >= predicted else "below"
    return f"{{{name}_gap_bytes}} ({_pct(measured, predicted)}) {where}"


def _peak(est: Estimate, m: Monitored) -> Finding:
    rank, row = m.worst_rank, m.worst
    s = est.stage_of_rank(rank)
    by = "peak" if "max_peak_bytes" in row else "median step time"
    head = (f"monitor, rank {rank} (the worst of {len(m.records)} by {by}; stage {s.stage}), "
            f"{row['num_steps']} steps")
    if "max_peak_bytes" not in row:
        return Finding("monitor_peak", head + ": step times only (no allocator counters were "
                       "read), so no measured memory to compare")
    measured = row["max_peak_bytes"]
    # The allocator's allocated peak is tensors: against the estimate's tensor peak (with a
    # calibration's correction); reserved against the rank's peak less the CUDA context, which
    # PyTorch's allocator never holds.
    predicted = s.tensor_peak_bytes + s.calibration_bytes
    sizes = {"measured_bytes": measured, "predicted_bytes": predicted}
    text = (f"{head}: measured peak {{measured_bytes}} allocated, "
            f"{_versus(sizes, 'peak', measured, predicted)} the estimate's tensor peak "
            "{predicted_bytes}")
    if "max_reserved_bytes" in row:
        reserved, want = row["max_reserved_bytes"], s.peak_bytes - s.cuda_context_bytes
        sizes.update(measured_reserved_bytes=reserved, predicted_reserved_bytes=want)
        text += (f"; reserved {{measured_reserved_bytes}}, "
                 f"{_versus(sizes, 'reserved', reserved, want)} the estimate's "
                 "{predicted_reserved_bytes} (its peak less the CUDA context)")
    over = measured > predicted * (1 + DEVIATION_PCT / 100)
    if over:
        text += (f"; more than {DEVIATION_PCT:g}% over: something the estimate does not count "
                 "is alive, or the job's configuration differs from the one given")
    return Finding("monitor_peak", text, sizes, cause=over)


def _cache(rec: dict[str, Any]) -> int:
    """Reserved bytes the step never allocated: reserved less the step's allocated peak (less
    allocated at step end when the record has no peak)."""
    return rec["reserved_bytes"] - rec.get("peak_bytes", rec.get("allocated_bytes", 0))


def _fragmentation(m: Monitored) -> Finding | None:
    """The worst rank's step with the most unused cache or free split blocks, against a share
    of its reserved bytes (``overheads.NOTABLE_CACHE_FRACTION``), as ``explain`` judges an OOM
    message. Reserved less allocated at step end (the monitor's ``fragmentation_bytes``) is
    shown but not judged: it includes the step's activations, freed and cached for the next."""
    rows = [r for r in m.records[m.worst_rank] if "reserved_bytes" in r]
    if not rows:
        return None
    rec = max(rows, key=lambda r: (max(_cache(r), r.get("inactive_split_bytes", 0)), r["step"]))
    reserved, cache = rec["reserved_bytes"], _cache(rec)
    split = rec.get("inactive_split_bytes", 0)
    if max(cache, split) <= NOTABLE_CACHE_FRACTION * reserved:
        return None
    sizes = {"reserved_bytes": reserved, "cache_bytes": cache, "split_bytes": split,
             "unallocated_bytes": rec.get("fragmentation_bytes", reserved
                                          - rec.get("allocated_bytes", 0))}
    less = "its allocated peak" if "peak_bytes" in rec else "allocated at its end"
    return Finding("fragmentation", f"measured on rank {m.worst_rank} at step {rec['step']}: "
                   "{cache_bytes} of the {reserved_bytes} reserved was never allocated in that "
                   f"step (reserved less {less}), and {{split_bytes}} sits in free pieces of split blocks (reserved less "
                   "allocated at step end: {unallocated_bytes}), above the "
                   f"{NOTABLE_CACHE_FRACTION:.0%} of the reserved bytes; "
                   "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces it",
                   sizes, cause=True)


_COUNTERS = (
    ("alloc_retries", "allocation retries", ("cudaMalloc failed, so the allocator freed its "
     "cache and tried again: memory ran short, and each retry synchronises the device")),
    ("num_ooms", "out-of-memory errors", "the allocator raised even after freeing its cache"),
)


def _counters(m: Monitored) -> list[Finding]:
    """Allocation retries and OOMs (cumulative counters: each rank's last value)."""
    ranks = m.summary["ranks"]
    out = []
    for key, what, why in _COUNTERS:
        hit = {k: r[key] for k, r in ranks.items() if r.get(key)}
        if hit:
            top = max(hit, key=lambda k: hit[k])
            out.append(Finding(key, f"{hit[top]} {what} on rank {top} ({len(hit)} of "
                               f"{len(ranks)} ranks have some): {why}", cause=True))
    return out


# what a leak in each series the monitor trends exhausts
_LEAKS_INTO = {"allocated_bytes": "the GPU", "tensor_bytes": "the device",
               "rss_bytes": "the host's memory"}


def _leak(m: Monitored) -> Finding | None:
    """The largest leak ``memplan.monitor.summarize`` found on any rank (its trend over the
    rank's run: Theil-Sen growth with the floor rising in each third)."""
    leaks = {(k, series): t for k, row in m.summary["ranks"].items()
             for series, t in row.get("trend", {}).items() if t["leak"]}
    if not leaks:
        return None
    (rank, series), t = max(leaks.items(), key=lambda kv: kv[1]["growth_bytes"])
    num_ranks = len({k for k, _ in leaks})
    return Finding("leak", f"memory grows on rank {rank}: {series.removesuffix('_bytes')} at "
                   f"step end rose from step {t['first_step']} to {t['last_step']} "
                   f"(+{{growth_bytes}}, {t['slope_bytes_per_step']:.0f} bytes a step by a "
                   f"robust trend, its floor rising in each third of the run; {num_ranks} of "
                   f"{len(m.records)} ranks grow so, the monitor's leak rule): tensors kept "
                   "across steps (a loss kept without .item(), a growing cache or list) will "
                   f"exhaust {_LEAKS_INTO.get(series, 'the memory')}",
                   {"growth_bytes": t["growth_bytes"]}, cause=True)


def _headroom(est: Estimate, capacity_bytes: int, m: Monitored) -> Finding | None:
    row, cap = m.worst, m.capacity_bytes
    if "min_headroom_bytes" not in row or not cap:
        return None
    room = row["min_headroom_bytes"]
    s = est.stage_of_rank(m.worst_rank)
    pct = 100.0 * room / cap
    low = pct < MIN_HEADROOM_PCT
    return Finding("headroom", f"measured headroom on rank {m.worst_rank}: {{headroom_bytes}} of "
                   f"{{device_bytes}} ({pct:.1f}%; capacity less the larger of reserved and the "
                   "step's peak, at its smallest); the estimate leaves {predicted_headroom_bytes} "
                   f"on stage {s.stage}"
                   + (f": under the monitor's {MIN_HEADROOM_PCT:g}%" if low else ""),
                   {"headroom_bytes": room, "device_bytes": cap,
                    "predicted_headroom_bytes": capacity_bytes - s.peak_bytes}, cause=low)


def monitor_findings(est: Estimate, capacity_bytes: int, m: Monitored) -> list[Finding]:
    """The worst rank's measured peak and reserved bytes against the estimate of its stage,
    its allocator cache and headroom; retries, OOMs and step-over-step growth on any rank."""
    out = [_peak(est, m)]
    for found in (_fragmentation(m), *_counters(m), _leak(m),
                  _headroom(est, capacity_bytes, m)):
        if found is not None:
            out.append(found)
    # the evidence is partial where a killed job cut a file: say so beside what it shows
    out += [Finding("monitor_partial", "partial monitor evidence: " + note.replace(
        "{", "{{").replace("}", "}}")) for note in m.partial]
    return out

