"""``MemoryMonitor``: per-step memory of a running training job, one JSONL file per rank.

    with MemoryMonitor("runs/mem", predicted_peak_bytes=est.peak_bytes) as monitor:
        for batch in loader:
            train_step(batch)
            monitor.step()

Each ``step()`` appends one record to ``<dir>/memory_rank<R>.jsonl``: the step's wall time
and, from ``reader`` (default: the CUDA caching allocator's ``torch.cuda.memory_stats`` when
torch is already imported and CUDA is up), allocated, reserved and peak bytes (the peak counter
is reset after each read, so it is this step's), fragmentation (reserved - allocated, and the
allocator's inactive split blocks), allocation retries and OOMs so far, and headroom (device
capacity - max(reserved, peak)). Without CUDA only step times are recorded, unless ``reader``
is given (any callable returning a dict with those ``*_bytes`` keys).

Warnings, kept in the step's record and logged (each kind once) to ``memplan.monitor``:
- headroom under ``min_headroom_pct`` of capacity;
- a leak: allocated bytes at step end grew for ``leak_steps`` steps in a row;
- the step's peak departs from ``predicted_peak_bytes`` by more than ``deviation_pct``.

It never raises into the training loop: a failing read or write is counted in ``errors`` and
logged once. torch-free at import; nothing is read until the first step.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

log = logging.getLogger("memplan.monitor")

Reader = Callable[[], dict[str, int]]
_STAT_KEYS = {"allocated_bytes": "allocated_bytes.all.current",
              "reserved_bytes": "reserved_bytes.all.current",
              "peak_bytes": "allocated_bytes.all.peak",
              "inactive_split_bytes": "inactive_split_bytes.all.current",
              "alloc_retries": "num_alloc_retries", "num_ooms": "num_ooms"}


def cuda_reader() -> Reader | None:
    """The CUDA allocator's counters, or None when torch is not imported or CUDA is not up
    (the monitor never initialises CUDA itself)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    device = torch.cuda.current_device()
    capacity = torch.cuda.get_device_properties(device).total_memory

    def read() -> dict[str, int]:
        stats = torch.cuda.memory_stats(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = {k: int(stats.get(v, 0)) for k, v in _STAT_KEYS.items()}
        out["capacity_bytes"] = capacity
        return out

    return read


def _rank() -> int:
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


class MemoryMonitor:
    """Record one JSONL line per training step for this rank; see the module docstring."""

    def __init__(self, out_dir: str | Path, *, rank: int | None = None,
                 reader: Reader | None = None, predicted_peak_bytes: int | None = None,
                 deviation_pct: float = 10.0, min_headroom_pct: float = 5.0,
                 leak_steps: int = 5, clock: Callable[[], float] = time.perf_counter) -> None:
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.reader = reader
        self.predicted_peak_bytes = predicted_peak_bytes
        self.deviation_pct = deviation_pct
        self.min_headroom_pct = min_headroom_pct
        self.leak_steps = leak_steps
        self.clock = clock
        self.records: list[dict[str, Any]] = []
        self.warnings: list[str] = []
        self.errors = 0
        self._file: Any = None
        self._last: float | None = None
        self._growth = 0
        self._started = False
        self._logged: set[str] = set()

    # --- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Open this rank's file and start the first step's clock (``step()`` does it too)."""
        try:
            if self.rank is None:
                self.rank = _rank()
            if self.reader is None:
                self.reader = cuda_reader()
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._file = (self.out_dir / f"memory_rank{self.rank}.jsonl").open("a")
        except Exception as err:  # noqa: BLE001 - the training loop must go on
            self._fail(err)
        self._started = True
        self._last = self.clock()

    def close(self) -> None:
        try:
            if self._file is not None:
                self._file.close()
        except Exception as err:  # noqa: BLE001
            self._fail(err)
        self._file = None

    def __call__(self, *_: Any, **__: Any) -> dict[str, Any] | None:
        """Callback form: any arguments are ignored (e.g. a trainer's callback signature)."""
        return self.step()

    # --- one step --------------------------------------------------------------------------
    def step(self) -> dict[str, Any] | None:
        """Record the step that just ended; returns the record, or None if it failed."""
        try:
            return self._step()
        except Exception as err:  # noqa: BLE001 - never raise into the training loop
            self._fail(err)
            return None

    def _step(self) -> dict[str, Any]:
        if not self._started:
            self.start()
        now = self.clock()
        rec: dict[str, Any] = {"rank": self.rank, "step": len(self.records) + 1,
                               "time": time.time(), "step_time_s": now - (self._last or now)}
        self._last = now
        if self.reader is not None:
            rec.update(self.reader())
            rec["fragmentation_bytes"] = rec.get("reserved_bytes", 0) - rec.get(
                "allocated_bytes", 0)
            if "capacity_bytes" in rec:
                rec["headroom_bytes"] = rec["capacity_bytes"] - max(
                    rec.get("reserved_bytes", 0), rec.get("peak_bytes", 0))
        rec["warnings"] = self._check(rec)
        self.records.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        return rec

    def _check(self, rec: dict[str, Any]) -> list[str]:
        out: list[tuple[str, str]] = []
        cap, room = rec.get("capacity_bytes"), rec.get("headroom_bytes")
        if cap and room is not None and 100.0 * room / cap < self.min_headroom_pct:
            out.append(("headroom", (f"headroom {room} bytes is under {self.min_headroom_pct}% of "
                       f"{cap} bytes")))
        prev = self.records[-1] if self.records else None
        if prev is not None and "allocated_bytes" in rec:
            grew = rec["allocated_bytes"] > prev.get("allocated_bytes", rec["allocated_bytes"])
            self._growth = self._growth + 1 if grew else 0
            if self._growth == self.leak_steps:
                first = self.records[-self.leak_steps]["allocated_bytes"]
                out.append(("leak", (f"allocated grew {self.leak_steps} steps in a row "
                            f"(+{rec['allocated_bytes'] - first} bytes): possible leak")))
        want, peak = self.predicted_peak_bytes, rec.get("peak_bytes")
        if want and peak is not None:
            pct = 100.0 * (peak - want) / want
            if abs(pct) > self.deviation_pct:
                out.append(("prediction", (f"peak {peak} bytes is {pct:+.1f}% from the "
                                          f"predicted {want} bytes")))
        for kind, text in out:  # each kind is logged once; every record keeps its own
            if kind not in self._logged:
                self._logged.add(kind)
                log.warning("rank %s step %s: %s", self.rank, rec["step"], text)
        self.warnings += [text for _, text in out]
        return [text for _, text in out]

    def _fail(self, err: Exception) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning("memory monitor disabled part of its work: %s", err)


def read_records(paths: list[str | Path]) -> list[dict[str, Any]]:
    """Every record of the given JSONL files or directories (``memory_rank*.jsonl`` in them)."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("memory_rank*.jsonl")) if p.is_dir() else [p]
    out = []
    for f in files:
        with f.open() as fh:
            out += [json.loads(line) for line in fh if line.strip()]
    return out


def _median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return (v[n // 2] + v[(n - 1) // 2]) / 2 if n else 0.0


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rank: the largest peak, reserved and fragmentation, the smallest headroom, retries
    and OOMs (cumulative counters: the last value), median step time, warnings; and the worst
    rank, the one with the largest peak (or the slowest median step when no bytes were read)."""
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_rank.setdefault(int(r["rank"]), []).append(r)
    ranks = {}
    for rank, recs in sorted(by_rank.items()):
        recs.sort(key=lambda r: r["step"])
        row: dict[str, Any] = {"num_steps": len(recs),
                               "median_step_time_s": _median([r["step_time_s"] for r in recs]),
                               "num_warnings": sum(len(r.get("warnings", [])) for r in recs)}
        for key in ("peak_bytes", "reserved_bytes", "fragmentation_bytes",
                    "inactive_split_bytes"):
            vals = [r[key] for r in recs if key in r]
            if vals:
                row[f"max_{key}"] = max(vals)
        rooms = [r["headroom_bytes"] for r in recs if "headroom_bytes" in r]
        if rooms:
            row["min_headroom_bytes"] = min(rooms)
        for key in ("alloc_retries", "num_ooms"):
            if key in recs[-1]:
                row[key] = recs[-1][key]
        ranks[rank] = row
    if not ranks:
        return {"ranks": {}, "worst_rank": None}
    has_peak = all("max_peak_bytes" in r for r in ranks.values())
    key = "max_peak_bytes" if has_peak else "median_step_time_s"
    worst = max(ranks, key=lambda k: ranks[k][key])
    return {"ranks": ranks, "worst_rank": worst, "worst_by": key, "worst": ranks[worst]}


__all__ = ["MemoryMonitor", "cuda_reader", "read_records", "summarize"]
