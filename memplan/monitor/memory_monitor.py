"""``MemoryMonitor``: per-step memory of a running training job, one JSONL file per rank.

    with MemoryMonitor("runs/mem", predicted_peak_bytes=est.peak_bytes) as monitor:
        for batch in loader:
            train_step(batch)
            monitor.step()

Each ``step()`` appends one record to ``<dir>/memory_rank<R>.jsonl``: the step's wall time and
what ``reader`` returns (default ``memplan.monitor.readers.default_reader``): on CUDA the
caching allocator's allocated, reserved and peak bytes (this step's), inactive split blocks,
allocation retries and OOMs, and the device capacity; on every device the process's resident
set (``rss_bytes``), the memory it may still grow into, and, while a
``memplan.profile.tracker.MemoryTracker`` is active, the exact live tensor bytes. From those it
derives fragmentation (reserved - allocated) and, on CUDA, headroom (capacity - max(reserved,
peak)). ``reader`` may be any callable returning a dict of int counters (``*_bytes`` keys).

Warnings, kept in the step's record and logged to ``memplan.monitor``, each kind at its first
step and then at most once every ``warn_every`` steps while it lasts (saying how many steps it
held in between):
- headroom under ``min_headroom_pct`` of capacity;
- a leak in ``allocated_bytes``, ``tensor_bytes`` or ``rss_bytes``: a robust trend over a window
  (``memplan.monitor.trend``: Theil-Sen growth of ``leak_bytes`` or more with the floor rising in
  each third of the window) at three time scales, the last ``leak_window`` steps and the floors of
  blocks of 8 and 64 steps, so a leak every few steps and a slow one are both caught and a
  periodic sawtooth is left alone;
- the step's peak (CUDA) or tensor peak (tracker) departs from ``predicted_peak_bytes`` by more
  than ``deviation_pct``.

The record file is opened as this job's own, never through a link (a symbolic or hard link
planted at ``memory_rank<R>.jsonl`` in a shared folder is refused, with one line, rather than
followed), and each record is appended whole or not at all (a write cut by a full disk is
truncated back), so the file never ends in half a record.

Opt-in, the same numbers also go where the job is watched (``memplan.monitor.sinks``), after
the record's line is written and without changing it: ``tensorboard=`` a folder (scalars
``memplan/<key>`` under ``<folder>/memplan_rank<R>``, TensorBoard's own writer, no torch) or
the job's ``SummaryWriter``; ``wandb=True`` (``wandb.log`` on the active run) or a run.

Arguments are checked when it is made (``MemplanError`` naming the argument, before training
starts). After that it never raises into the training loop: a failing reader, clock, disk or
sink is counted in ``errors`` and logged (rate-limited); a reader or clock that raises
``SystemExit``, ``KeyboardInterrupt`` or any other ``BaseException`` stops the monitor
(``stopped`` says why, and a last record with ``monitor_stopped``) and the job goes on. Memory
stays bounded: the monitor keeps a running summary (``summary``) and the trend windows, not its
records.
torch-free at import; nothing is read until the first step.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from memplan.arguments import plain
from memplan.errors import MemplanError
from memplan.monitor.callbacks import TrainerHooks
from memplan.monitor.readers import Reader, cuda_reader, default_reader, host_reader
from memplan.monitor.records import read_records, run_trend, summarize
from memplan.monitor.sinks import TensorBoardSink, WandbSink, scalars
from memplan.monitor.trend import Trend
from memplan.monitor.window import LEAK_BYTES, LEAK_WINDOW, LeakWindows
from memplan.outputs import open_append, refuse_link

log = logging.getLogger("memplan.monitor")

# A warning of one kind is logged again after this many steps while it holds.
WARN_EVERY = 100


def _rank() -> int:
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _int(name: str, value: Any, low: int, *, allow_none: bool = False) -> Any:
    """``value`` as an int >= ``low`` (numpy's integers too: ``memplan.arguments.plain``), or
    None where allowed."""
    if value is None and allow_none:
        return None
    value = plain(name, value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise MemplanError(f"MemoryMonitor: {name} must be an int >= {low}"
                           f"{' or None' if allow_none else ''}, not {value!r}")
    return int(value)


def _pct(name: str, value: Any, high: float) -> None:
    if not _number(value) or not 0 <= value < high:
        raise MemplanError(f"MemoryMonitor: {name} must be a number from 0 to under {high:g}, "
                           f"not {value!r}")


def _out_dir(value: Any) -> Path:
    if isinstance(value, bool) or not isinstance(value, str | os.PathLike) or value == "":
        raise MemplanError(f"MemoryMonitor: out_dir must be a folder path (str or "
                           f"os.PathLike), not {value!r}")
    path = Path(value)
    for part in (path, *path.parents):  # the nearest existing one must be a folder
        if part.exists():
            if not part.is_dir():
                raise MemplanError(f"MemoryMonitor: out_dir {path}: {part} is a file, not a "
                                   "folder")
            break
    return path


def _clock(clock: Any) -> Callable[[], float]:
    if not callable(clock):
        raise MemplanError(f"MemoryMonitor: clock must be a callable returning seconds, not "
                           f"{clock!r}")
    try:
        now = clock()
    except BaseException as err:  # any failure, SystemExit too, is the argument's: said here
        raise MemplanError(f"MemoryMonitor: clock() failed when tried: {err!r}") from err
    if not _number(now):
        raise MemplanError(f"MemoryMonitor: clock() must return a number of seconds, not "
                           f"{now!r}")
    return clock


# the keys of a record the monitor writes itself; a reader cannot replace them
_OWN_KEYS = frozenset({"rank", "step", "time", "step_time_s", "warnings", "monitor_stopped"})


# the counters whose largest value the running summary keeps
_MAX_KEYS = ("allocated_bytes", "reserved_bytes", "peak_bytes", "fragmentation_bytes",
             "inactive_split_bytes", "alloc_retries", "num_ooms", "rss_bytes",
             "peak_rss_bytes", "tensor_bytes", "tensor_peak_bytes")


class _Stop(Exception):
    """A reader or clock raised a BaseException: the monitor stops."""


class MemoryMonitor(TrainerHooks):
    """Record one JSONL line per training step for this rank; see the module docstring. It is
    a callback of transformers' ``Trainer`` and Lightning's as it is
    (``memplan.monitor.callbacks.TrainerHooks``)."""

    def __init__(self, out_dir: str | os.PathLike[str], *, rank: int | None = None,
                 reader: Reader | None = None, predicted_peak_bytes: int | None = None,
                 deviation_pct: float = 10.0, min_headroom_pct: float = 5.0,
                 leak_window: int = LEAK_WINDOW, leak_bytes: int = LEAK_BYTES,
                 warn_every: int = WARN_EVERY,
                 clock: Callable[[], float] = time.perf_counter,
                 tensorboard: Any = None, wandb: Any = None) -> None:
        self.out_dir = _out_dir(out_dir)
        rank = _int("rank", rank, 0, allow_none=True)
        if reader is not None and not callable(reader):
            raise MemplanError(f"MemoryMonitor: reader must be a callable returning a dict of "
                               f"counters, or None, not {reader!r}")
        predicted_peak_bytes = _int("predicted_peak_bytes", predicted_peak_bytes, 1,
                                    allow_none=True)
        _pct("deviation_pct", deviation_pct, math.inf)
        _pct("min_headroom_pct", min_headroom_pct, 100)
        leak_window = _int("leak_window", leak_window, 6)
        leak_bytes = _int("leak_bytes", leak_bytes, 1)
        warn_every = _int("warn_every", warn_every, 1)
        self.clock = _clock(clock)
        self.sinks = _sinks(tensorboard, wandb)
        if rank is not None:  # said before training starts; start() checks again
            refuse_link(self.out_dir / f"memory_rank{rank}.jsonl", "MemoryMonitor")
        self.rank, self.reader = rank, reader
        self.predicted_peak_bytes = predicted_peak_bytes
        self.deviation_pct, self.min_headroom_pct = deviation_pct, min_headroom_pct
        self.leak_window, self.leak_bytes, self.warn_every = leak_window, leak_bytes, warn_every
        self.errors = 0
        self.stopped: str | None = None
        self.last_record: dict[str, Any] | None = None
        self._windows = LeakWindows(leak_window, leak_bytes)
        self._num_steps = 0
        self._file: Any = None
        self._last: float | None = None
        self._started = False
        self._warned: dict[str, list[int]] = {}  # kind -> [step logged, steps since, total]
        self._max: dict[str, int] = {}
        self._min_headroom: int | None = None
        self._no_run: set[str] = set()  # sinks that found no run to log to (said once)

    # --- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Open this rank's file and start the first step's clock (``step()`` does it too)."""
        self._started = True
        try:
            if self.rank is None:
                self.rank = _rank()
        except Exception as err:  # noqa: BLE001 - a bad RANK variable: rank 0, said once
            self.rank = 0
            self._error("rank", err)
        try:
            if self.reader is None:
                self.reader = default_reader()
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._file = open_append(self.out_dir / f"memory_rank{self.rank}.jsonl",
                                     "MemoryMonitor")
        except Exception as err:  # noqa: BLE001 - the training loop must go on
            self._error("start", err)
        try:
            self._last = self._now()
        except _Stop:
            pass

    def close(self) -> None:
        """Close the file and flush the sinks (both reopen, appending, if ``step()`` is
        called again)."""
        try:
            if self._file is not None:
                self._file.close()
        except Exception as err:  # noqa: BLE001
            self._error("close", err)
        for name, sink in self.sinks.items():
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001
                self._error(name, err)
        self._file = None
        self._started = False

    def __call__(self, *_: Any, **__: Any) -> dict[str, Any] | None:
        """Callback form: any arguments are ignored (e.g. a trainer's callback signature)."""
        return self.step()

    # --- one step --------------------------------------------------------------------------
    def step(self) -> dict[str, Any] | None:
        """Record the step that just ended; returns the record, or None if none was made."""
        if self.stopped is not None:
            return None
        try:
            return self._step()
        except _Stop:
            return None
        except Exception as err:  # noqa: BLE001 - never raise into the training loop
            self._error("step", err)
            return None

    def _step(self) -> dict[str, Any]:
        if not self._started:
            self.start()
        if self.stopped is not None:
            raise _Stop
        self._num_steps += 1
        now = self._now()
        took = now - self._last if self._last is not None and now >= self._last else 0.0
        rec: dict[str, Any] = {"rank": self.rank, "step": self._num_steps,
                               "time": time.time(), "step_time_s": took}
        self._last = now
        if self.reader is not None:
            rec.update(self._read())
        if "reserved_bytes" in rec and "allocated_bytes" in rec:
            rec["fragmentation_bytes"] = rec["reserved_bytes"] - rec["allocated_bytes"]
        if "capacity_bytes" in rec and "headroom_bytes" not in rec and (
                "reserved_bytes" in rec or "peak_bytes" in rec):
            rec["headroom_bytes"] = rec["capacity_bytes"] - max(
                rec.get("reserved_bytes", 0), rec.get("peak_bytes", 0))
        rec["warnings"] = self._check(rec)
        self._keep(rec)
        self._write(rec)
        self.last_record = rec
        self._send(rec)
        return rec

    def _send(self, rec: dict[str, Any]) -> None:
        """The record's scalars to each sink (TensorBoard, W&B) after its line is written; a
        failing sink is counted in errors like a failing disk."""
        if not self.sinks:
            return
        values = scalars(rec)
        if self.predicted_peak_bytes is not None:
            values["memplan/predicted_peak_bytes"] = self.predicted_peak_bytes
        for name, sink in self.sinks.items():
            try:
                if (sink.write(rec["rank"], rec["step"], values, rec["time"]) is False
                        and name not in self._no_run):  # said once: W&B is often rank 0's
                    self._no_run.add(name)
                    log.warning("rank %s step %s: memory monitor: no %s run to log to (%s.init "
                                "not called on this rank); its steps are skipped", self.rank,
                                rec["step"], name, name)
            except Exception as err:  # noqa: BLE001 - never raise into the training loop
                self._error(name, err)

    def _hook(self, what: str, fn: Callable[[], Any]) -> Any:
        """Call a user hook; a BaseException that is not an Exception stops the monitor."""
        try:
            return fn()
        except Exception:
            raise
        except BaseException as err:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, ...
            self._stop(f"{what} raised {type(err).__name__}({', '.join(map(repr, err.args))})")
            raise _Stop from None

    def _now(self) -> float:
        try:
            now = self._hook("clock", self.clock)
            if not _number(now):
                raise TypeError(f"clock() returned {now!r}, not a number of seconds")
            return float(now)
        except _Stop:
            raise
        except Exception as err:  # noqa: BLE001 - step times from here on: perf_counter
            self._error("clock", err)
            self.clock, self._last = time.perf_counter, None
            return time.perf_counter()

    def _read(self) -> dict[str, int]:
        try:  # the reader's dict is read inside the hook too: its items() is its own code
            got, bad = self._hook("reader", lambda: _counters(self.reader()))  # type: ignore[misc]
        except _Stop:
            raise
        except Exception as err:  # noqa: BLE001
            self._error("reader", err)
            return {}
        if bad is not None:
            self._error("reader", TypeError(bad))
        return got

    def _check(self, rec: dict[str, Any]) -> list[str]:
        out: list[tuple[str, str]] = []
        cap, room = rec.get("capacity_bytes"), rec.get("headroom_bytes")
        if cap and room is not None and 100.0 * room / cap < self.min_headroom_pct:
            out.append(("headroom", (f"headroom {room} bytes is under {self.min_headroom_pct}% "
                                     f"of {cap} bytes")))
        for found in self._windows.add(rec):
            out.append((f"leak:{found.series}", _leak_text(found)))
        want = self.predicted_peak_bytes
        peak = rec.get("peak_bytes", rec.get("tensor_peak_bytes"))
        if want and peak is not None:
            pct = 100.0 * (peak - want) / want
            if abs(pct) > self.deviation_pct:
                out.append(("prediction", (f"peak {peak} bytes is {pct:+.1f}% from the "
                                          f"predicted {want} bytes")))
        for kind, text in out:
            self._warn(kind, text, rec["step"])
        return [text for _, text in out]

    def _warn(self, kind: str, text: str, step: int) -> None:
        """Log ``kind`` at its first step, then at most once every ``warn_every`` steps."""
        seen = self._warned.get(kind)
        if seen is not None and step - seen[0] < self.warn_every:
            seen[1] += 1
            seen[2] += 1
            return
        since = f" (held {seen[1]} more steps since step {seen[0]})" if seen and seen[1] else ""
        log.warning("rank %s step %s: %s%s", self.rank, step, text, since)
        self._warned[kind] = [step, 0, (seen[2] if seen else 0) + 1]

    def _keep(self, rec: dict[str, Any]) -> None:
        for key in _MAX_KEYS:
            value = rec.get(key)
            if value is not None and (key not in self._max or value > self._max[key]):
                self._max[key] = value
        room = rec.get("headroom_bytes")
        if room is not None:
            self._min_headroom = room if self._min_headroom is None else min(
                self._min_headroom, room)

    def _write(self, rec: dict[str, Any]) -> None:
        """Append the record's line whole, or nothing: a write that fails part-way (a full
        disk) is cut back to where the line began, so the file never ends in half a record
        that the next one would be appended to."""
        if self._file is None:
            return
        line = (json.dumps(rec) + "\n").encode()
        end = None
        try:
            end = self._file.seek(0, os.SEEK_END)
            done = 0
            while done < len(line):  # unbuffered: each write is one system call
                wrote = self._file.write(line[done:])
                if not wrote:
                    raise OSError(errno.ENOSPC, f"wrote {done} of {len(line)} bytes")
                done += wrote
        except Exception as err:  # noqa: BLE001 - a full or failing disk: counted
            if end is not None:
                try:
                    self._file.truncate(end)
                except Exception:  # noqa: BLE001, S110 - the write's error is the one counted
                    pass
            self._error("write", err)

    def _stop(self, why: str) -> None:
        self.stopped = why
        self.errors += 1
        log.warning("rank %s: memory monitor stopped: %s; training goes on", self.rank, why)
        rec = {"rank": self.rank, "step": max(self._num_steps, 1), "time": time.time(),
               "step_time_s": 0.0, "monitor_stopped": why, "warnings": [f"stopped: {why}"]}
        self._write(rec)
        self.close()

    def _error(self, what: str, err: BaseException) -> None:
        self.errors += 1
        self._warn(f"error:{what}", f"memory monitor: {what} failed ({err!r}); counted in "
                   f"errors ({self.errors} so far)", max(self._num_steps, 1))

    # --- what it has seen -------------------------------------------------------------------
    @property
    def summary(self) -> dict[str, Any]:
        """The running summary: steps, the largest of each byte counter, the smallest
        headroom, warnings by kind (how many steps each held), errors, why it stopped, and the
        latest trend of each series."""
        out: dict[str, Any] = {"rank": self.rank, "num_steps": self._num_steps,
                               "errors": self.errors, "stopped": self.stopped,
                               **{f"max_{k}": v for k, v in sorted(self._max.items())},
                               "warnings": {k: v[2] for k, v in sorted(self._warned.items())},
                               "trends": {k: t.as_dict() for k, t in
                                          self._windows.latest().items()}}
        if self._min_headroom is not None:
            out["min_headroom_bytes"] = self._min_headroom
        return out


def _sinks(tensorboard: Any, wandb: Any) -> dict[str, Any]:
    """The sinks asked for (``memplan.monitor.sinks``); None or False: none."""
    out: dict[str, Any] = {}
    if tensorboard is not None and tensorboard is not False:
        out["tensorboard"] = TensorBoardSink(tensorboard, "MemoryMonitor: tensorboard")
    if wandb is not None and wandb is not False:
        out["wandb"] = WandbSink(wandb, "MemoryMonitor: wandb")
    return out


def _counters(got: Any) -> tuple[dict[str, int], str | None]:
    """The int counters of a reader's answer, and what was wrong with the rest (or None)."""
    if not isinstance(got, dict):
        return {}, f"returned {type(got).__name__}, not a dict"
    out = {k: v for k, v in got.items() if type(v) is int and k not in _OWN_KEYS
           and type(k) is str}
    if len(out) == len(got):
        return out, None
    key = next(k for k in got if k not in out)
    return out, f"{key!r} is {got[key]!r}, not an int counter of its own"


def _leak_text(t: Trend) -> str:
    return (f"{t.series} grew {t.growth_bytes} bytes over steps {t.first_step}-{t.last_step} "
            f"({t.slope_bytes_per_step:.0f} bytes/step, Theil-Sen; its floor rose in each "
            "third of the window): possible leak")


__all__ = ["LEAK_BYTES", "LEAK_WINDOW", "WARN_EVERY", "MemoryMonitor", "cuda_reader",
           "host_reader", "read_records", "run_trend", "summarize"]
