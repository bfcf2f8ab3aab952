"""Memory over time by phase, from the files a job already wrote: a ``torch.profiler`` chrome
trace made with ``profile_memory=True``, or a ``torch.cuda.memory._record_memory_history``
snapshot. torch-free.

A profiler trace (``prof.export_chrome_trace``, the TensorBoard handler) holds one instant
event per allocation and free, named "[memory]" (``torch/autograd/profiler_util.py``
``MEMORY_EVENT_NAME``; written by kineto from the profiler's memory reports), with args
"Bytes" (negative for a free), "Total Allocated" and "Total Reserved" after it (the caching
allocator's, on CUDA; on the CPU only what was allocated while the profiler ran,
``c10/core/CPUAllocator.cpp`` ``ProfiledCPUMemoryReporter::New``, and "Total Reserved" 0), "Device Type" (c10's DeviceType: 0
CPU, 1 CUDA) and "Device Id". Its phases come from the ranges around each event's time:
``ProfilerStep#N`` (``prof.step()`` under a schedule), "Optimizer.step#<Class>.step" (torch's
own ``record_function`` in ``torch/optim/optimizer.py`` ``profile_hook_step``) and the
autograd engine's operators ("autograd::engine::evaluate_function: ..."): a step is forward
until its first backward operator, backward to its last, then "other" (zero_grad, clipping)
except inside the optimizer step. Events before the first step are "setup" (step 0).

A snapshot's ``device_traces`` (``memplan.measure.snapshot_trace``) holds the allocator's
actions with the frames of each, innermost first; the phase of each is read from its frames
(``memplan.diagnose.traceback.phase_of_frames``; the autograd engine's own thread, whose
frames are C++ only, is backward), an action with no known frame keeping the phase before
it. A snapshot marks no steps: a step ends where an optimizer step gives way to another
phase. The ring buffer may begin mid-run, so the allocated bytes are anchored at the end:
the segments' allocated bytes when the snapshot was taken, less the trace's net change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from memplan.diagnose.traceback import frames_of, phase_of_frames
from memplan.errors import MemplanError
from memplan.measure.snapshot_trace import _RESERVE

MEMORY_EVENT = "[memory]"
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_OPTIMIZER = "Optimizer.step#"
_BACKWARD = "autograd::engine::evaluate_function:"
# c10/core/DeviceType.h: CPU = 0, CUDA = 1, ..., XPU = 12
_DEVICE_TYPES = {0: "cpu", 1: "cuda", 12: "xpu"}
# the step phases the estimate has, and the timeline's names for them
ESTIMATED = {"forward": "forward", "backward": "backward", "optimizer step": "optimizer"}


@dataclass(frozen=True)
class Point:
    """The bytes one device held after one allocator action."""

    time_us: float | None
    allocated_bytes: int
    reserved_bytes: int | None
    step: int  # 0: before the first step
    phase: str


@dataclass
class MemoryTimeline:
    source: str  # what it was read from, in words
    path: str
    device: str  # "cuda:0", "cpu"
    points: list[Point] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rank: int | None = None  # the trace's distributedInfo.rank, when it has one

    def phase_peaks(self) -> list[dict[str, Any]]:
        """The largest allocated (and reserved) bytes of each (step, phase), in order."""
        rows: dict[tuple[int, str], dict[str, Any]] = {}
        for p in self.points:
            row = rows.setdefault((p.step, p.phase), {"step": p.step, "phase": p.phase,
                                                      "peak_allocated_bytes": 0,
                                                      "peak_reserved_bytes": None,
                                                      "events": 0})
            row["events"] += 1
            row["peak_allocated_bytes"] = max(row["peak_allocated_bytes"], p.allocated_bytes)
            if p.reserved_bytes is not None:
                row["peak_reserved_bytes"] = max(row["peak_reserved_bytes"] or 0,
                                                 p.reserved_bytes)
        return list(rows.values())


# --- torch.profiler traces -------------------------------------------------------------------


def _ranges(events: list[dict[str, Any]]) -> tuple[list, list, list]:
    """(steps (number, lo, hi), optimizer steps (lo, hi), backward operators (lo, hi))."""
    steps, optim, backward = [], [], []
    for e in events:
        name, cat = e.get("name", ""), e.get("cat", "")
        lo, hi = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        step = _STEP.match(name)
        if step and cat == "user_annotation":
            steps.append((int(step.group(1)), lo, hi))
        elif name.startswith(_OPTIMIZER) and cat == "user_annotation":
            optim.append((lo, hi))
        elif name.startswith(_BACKWARD):
            backward.append((lo, hi))
    return sorted(steps), optim, backward


def _phase_at(t: float, step: tuple[int, float, float] | None, optim: list,
              backward: list) -> str:
    if any(lo <= t <= hi for lo, hi in optim):
        return "optimizer step"
    lo, hi = (step[1], step[2]) if step is not None else (float("-inf"), float("inf"))
    inside = [b for b in backward if lo <= b[0] <= hi]
    if not inside or t < min(b[0] for b in inside):
        return "forward"
    return "backward" if t <= max(b[1] for b in inside) else "other"


def _step_and_phase(t: float, steps: list, optim: list, backward: list) -> tuple[int, str]:
    """The step of time ``t`` (ProfilerStep#N is step N + 1: ``prof.step()`` counts every
    step since the profiler was made, those of its wait and warmup too) and its phase: before
    the first profiled step "setup" (step 0), between steps "other" of the step before."""
    if not steps:
        return 1, _phase_at(t, None, optim, backward)
    started = [s for s in steps if s[1] <= t]
    if not started:
        return 0, "setup"
    last = started[-1]
    return last[0] + 1, _phase_at(t, last, optim, backward) if t <= last[2] else "other"


def profiler_timelines(path: str) -> list[MemoryTimeline]:
    """One timeline per device of the "[memory]" events in the trace at ``path``."""
    from memplan.measure.trace_files import read_trace

    trace = read_trace(path)
    steps, optim, backward = _ranges(trace.events)
    out: dict[str, MemoryTimeline] = {}
    for e in sorted(trace.instants, key=lambda e: float(e["ts"])):
        args = e.get("args") or {}
        kind = _DEVICE_TYPES.get(args.get("Device Type"), f"device type {args.get('Device Type')}")
        dev = args.get("Device Id")
        device = kind if kind == "cpu" or dev is None or dev < 0 else f"{kind}:{dev}"
        tl = out.setdefault(device, MemoryTimeline(
            "torch.profiler trace (profile_memory=True)", str(path), device,
            rank=(trace.meta.get("distributedInfo") or {}).get("rank")))
        number, phase = _step_and_phase(float(e["ts"]), steps, optim, backward)
        reserved = args.get("Total Reserved") if kind != "cpu" else None
        tl.points.append(Point(float(e["ts"]), int(args["Total Allocated"]), reserved, number,
                               phase))
    if trace.partial:
        for tl in out.values():
            tl.notes.append(trace.partial)
    if not steps:
        for tl in out.values():
            tl.notes.append("no ProfilerStep#N ranges (prof.step() under a schedule): the "
                            "whole trace is one step")
    return list(out.values())


# --- memory snapshots ------------------------------------------------------------------------


def _phase_of_entry(entry: dict[str, Any]) -> str | None:
    frames = frames_of(entry.get("frames") or [])
    if any(f.function.startswith("torch::autograd::Engine::") for f in frames):
        return "backward"  # torch/csrc/autograd/engine.cpp: the device threads' Engine
    found = phase_of_frames(frames)
    return None if found is None else found.phase


def snapshot_timelines(data: dict[str, Any], path: str) -> list[MemoryTimeline]:
    """One timeline per device of the snapshot ``data``'s allocator trace."""
    from memplan.diagnose.snapshot import snapshot_report

    traces = data.get("device_traces")
    if not isinstance(traces, list) or not any(traces):
        raise MemplanError(f"--snapshot: {path} holds no allocator trace (device_traces): "
                           "record it with torch.cuda.memory._record_memory_history() before "
                           "the steps")
    out = []
    for device, entries in enumerate(traces):
        if not entries:
            continue
        now = snapshot_report(data, device)
        tl = MemoryTimeline("memory snapshot (_record_memory_history)", path, f"cuda:{device}")
        rows, allocated, reserved = [], 0, 0
        step, phase, seen = 1, "other", False
        for entry in entries:
            action = entry.get("action")
            if action == "alloc":
                allocated += int(entry["size"])
            elif action == "free_completed":
                allocated -= int(entry["size"])
            elif action in _RESERVE:
                reserved += _RESERVE[action] * int(entry["size"])
            else:
                continue
            found = _phase_of_entry(entry)
            if found is not None:
                if phase == "optimizer step" and found != phase and seen:
                    step += 1
                phase, seen = found, True
            rows.append((entry.get("time_us"), allocated, reserved, step, phase))
        base_alloc = now.allocated_bytes - allocated
        base_reserved = now.reserved_bytes - reserved
        tl.points = [Point(t, a + base_alloc, r + base_reserved, s, p)
                     for t, a, r, s, p in rows]
        tl.notes.append("steps inferred: a step ends where its optimizer step gives way to "
                        "another phase (a snapshot marks none)")
        out.append(tl)
    return out


def versus_estimate(tl: MemoryTimeline, est: Any) -> list[dict[str, Any]]:
    """The measured peak of each (step, phase) next to the estimate's tensor bytes of that
    phase for the stage of the trace's rank (the most loaded stage without one): step 1
    against its first step (no optimizer states before its optimizer step), later steps
    against the steady state."""
    s = est.stage_of_rank(tl.rank)
    out = []
    for row in tl.phase_peaks():
        name = ESTIMATED.get(row["phase"])
        if name is None or row["step"] < 1:
            continue
        peaks = s.first_step if row["step"] == 1 else s.steady
        predicted = getattr(peaks, name)
        out.append({**row, "estimated_bytes": predicted,
                    "diff_bytes": row["peak_allocated_bytes"] - predicted})
    return out


def timeline_json(tl: MemoryTimeline, est: Any = None) -> dict[str, Any]:
    out = {"source": tl.source, "path": tl.path, "device": tl.device, "rank": tl.rank,
           "num_events": len(tl.points), "phases": tl.phase_peaks(), "notes": tl.notes,
           "points": [{"time_us": p.time_us, "allocated_bytes": p.allocated_bytes,
                       "reserved_bytes": p.reserved_bytes, "step": p.step, "phase": p.phase}
                      for p in tl.points]}
    if est is not None:
        out["versus_estimate"] = versus_estimate(tl, est)
    return out


__all__ = ["MEMORY_EVENT", "MemoryTimeline", "Point", "profiler_timelines",
           "snapshot_timelines", "timeline_json", "versus_estimate"]
