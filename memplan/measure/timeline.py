"""A measured memory timeline of training steps: per-phase peaks, the first-step anomaly, files.

torch-free. ``memplan.profile.step`` fills a ``Timeline`` with one ``Sample`` per recorded
event (every aten op under the exact CPU tracker; every phase change on CUDA). Each sample
carries the bytes alive at that moment for one rank, its step (1-based) and phase.

Phases: ``forward``, ``backward`` (inside autograd's engine), ``optimizer`` (inside
``optimizer.step``) and ``other`` (anything after backward that is not the optimizer step:
gradient clipping, ``zero_grad``, logging).

Samples of step 0 are setup before the first step (e.g. fp32 master copies made with the
optimizer); they are drawn but belong to no step's peak. The first sample of a step is taken
when the step starts and the last one when it has ended (optimizer states relabelled), so the
bytes a step leaves alive are ``end - start``.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memplan import units

# a step's phases, and "other": after backward, outside the optimizer step (clipping, zero_grad)
PHASES = (*units.PHASES, "other")
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")


@dataclass(frozen=True)
class Sample:
    """Bytes alive on one rank at one event. ``total_bytes``: tensors (CPU tracker) or the
    CUDA caching allocator's allocated bytes; ``reserved_bytes`` and ``device_used_bytes``
    (``cudaMemGetInfo`` total - free) only on CUDA."""

    index: int
    step: int
    phase: str
    total_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)
    op: str = ""
    reserved_bytes: int | None = None
    device_used_bytes: int | None = None
    peak_bytes: int | None = None  # CUDA: allocator peak since the previous sample
    time_s: float | None = None  # seconds since the timeline's first sample


@dataclass
class Timeline:
    """Samples of ``num_steps`` steps on one rank, and where they were measured."""

    device: str  # "cpu-tracker" or "cuda"
    source: str  # how the bytes were measured, printed next to them
    num_steps: int
    samples: list[Sample] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)  # model, workload, CUDA baseline

    def of_step(self, step: int) -> list[Sample]:
        return [s for s in self.samples if s.step == step]


def _high(s: Sample) -> int:
    return s.total_bytes if s.peak_bytes is None else max(s.total_bytes, s.peak_bytes)


def phase_peaks(tl: Timeline) -> dict[int, dict[str, Sample]]:
    """The sample with the most bytes in each (step, phase); ties keep the earliest."""
    peaks: dict[int, dict[str, Sample]] = {}
    for s in tl.samples:
        if s.step < 1:
            continue
        best = peaks.setdefault(s.step, {}).get(s.phase)
        if best is None or _high(s) > _high(best):
            peaks[s.step][s.phase] = s
    return peaks


def step_peak_bytes(tl: Timeline) -> dict[int, int]:
    return {step: max(_high(s) for s in phases.values())
            for step, phases in phase_peaks(tl).items()}


def _boundary(tl: Timeline, step: int) -> tuple[Sample, Sample]:
    samples = tl.of_step(step)
    return samples[0], samples[-1]


def first_step_anomaly(tl: Timeline) -> dict[str, Any]:
    """Step 1 against the last (steady) step, the measured bytes of each cause, and warnings.

    Causes, each measured from step 1's first and last samples:
    - ``optimizer_states``: optimizer-category bytes step 1 left alive (states created lazily
      by the first ``optimizer.step``; later steps carry them through every phase).
    - ``other_persistent``: all other bytes step 1 left alive (lazily built buffers, grads kept
      by ``zero_grad(set_to_none=False)``).
    On CUDA, also ``allocator_cache`` (reserved minus allocated after step 1 and after the
    last step: the caching allocator's warm-up) and ``outside_allocator`` (device used minus
    reserved, grown during step 1: cuBLAS/cuDNN workspaces and lazy CUDA initialisation).
    """
    peaks = step_peak_bytes(tl)
    last = tl.num_steps
    start, end = _boundary(tl, 1)
    opt = end.by_category.get("optimizer", 0) - start.by_category.get("optimizer", 0)
    persistent = end.total_bytes - start.total_bytes
    causes = [{"cause": "optimizer_states", "bytes": opt,
               "why": "created by the first optimizer step, alive in every later phase"},
              {"cause": "other_persistent", "bytes": persistent - opt,
               "why": "other bytes the first step left alive"}]
    if tl.device == "cuda":
        causes += _cuda_causes(tl, start, end, last)
    out = {"first_step_peak_bytes": peaks[1], "steady_step": last,
           "steady_peak_bytes": peaks[last], "steady_minus_first_bytes": peaks[last] - peaks[1],
           "causes": causes, "later_steps_above_first": [], "warnings": []}
    for step in range(2, last + 1):
        excess = peaks[step] - peaks[1]
        if excess > 0:
            out["later_steps_above_first"].append({"step": step, "peak_bytes": peaks[step],
                                                   "excess_bytes": excess})
    if out["later_steps_above_first"]:
        worst = max(out["later_steps_above_first"], key=lambda r: r["excess_bytes"])
        explained = "within" if worst["excess_bytes"] <= opt + max(persistent - opt, 0) else \
            "beyond"
        out["warnings"].append(
            f"step {worst['step']} peaked {worst['excess_bytes']} bytes above step 1 "
            f"({explained} the {persistent} bytes step 1 left alive): a job that survives its "
            "first step can still run out of memory later")
    growth = [peaks[k] - peaks[k - 1] for k in range(3, last + 1)]
    out["peak_growth_bytes"] = growth  # step over step from step 2 on
    if growth and all(g > 0 for g in growth):
        out["warnings"].append(f"peak grew at every step after step 2 ({growth} bytes): "
                               "memory may be leaking")
    return out


def _cuda_causes(tl: Timeline, start: Sample, end: Sample, last: int) -> list[dict[str, Any]]:
    steady_end = tl.of_step(last)[-1]

    def cache(s: Sample) -> int:
        return (s.reserved_bytes or 0) - s.total_bytes

    def outside(s: Sample) -> int:
        return (s.device_used_bytes or 0) - (s.reserved_bytes or 0)

    return [{"cause": "allocator_cache", "bytes": cache(end),
             "steady_bytes": cache(steady_end),
             "why": "reserved minus allocated after step 1 (allocator warm-up)"},
            {"cause": "outside_allocator", "bytes": outside(end) - outside(start),
             "why": "device used minus reserved, grown during step 1 (cuBLAS workspace, "
                    "lazy CUDA initialisation)"}]


def summary(tl: Timeline, predicted: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per-step, per-phase peaks by category; predicted vs measured; the first-step anomaly.
    ``predicted``: ``{"source", "first_step": {phase: bytes}, "steady": {phase: bytes}}``."""
    peaks = phase_peaks(tl)
    steps = {str(k): {ph: {"peak_bytes": _high(s), "by_category": dict(s.by_category),
                           "index": s.index,
                           **({"reserved_bytes": s.reserved_bytes}
                              if s.reserved_bytes is not None else {})}
                      for ph, s in sorted(v.items(), key=lambda kv: PHASES.index(kv[0]))}
             for k, v in sorted(peaks.items())}
    out: dict[str, Any] = {"device": tl.device, "source": tl.source, "num_steps": tl.num_steps,
                           **tl.context, "step_peak_bytes": {str(k): v for k, v in
                                                             step_peak_bytes(tl).items()},
                           "phases": steps, "first_step": first_step_anomaly(tl)}
    if predicted is not None:
        out["predicted"] = predicted
        out["measured_vs_predicted"] = _versus(peaks, predicted, tl.num_steps)
    return out


def _versus(peaks: dict[int, dict[str, Sample]], predicted: dict[str, Any],
            last: int) -> list[dict[str, Any]]:
    rows = []
    for label, step in (("first_step", 1), ("steady", last)):
        for phase, want in predicted.get(label, {}).items():
            got = peaks[step].get(phase)
            if got is None:
                continue
            rows.append({"step": step, "label": label, "phase": phase,
                         "measured_bytes": _high(got), "predicted_bytes": want,
                         "diff_bytes": want - _high(got),
                         "diff_pct": round(100.0 * (want - _high(got)) / _high(got), 4)
                         if _high(got) else 0.0})
    return rows


def write(tl: Timeline, out_dir: Path, predicted: dict[str, Any] | None = None) -> list[Path]:
    """``timeline.json``, ``timeline.csv`` and ``summary.json`` in ``out_dir``, each written
    whole or not at all (``memplan.outputs.write_atomic``)."""
    from memplan.outputs import write_atomic

    tj, tc, sj = out_dir / "timeline.json", out_dir / "timeline.csv", out_dir / "summary.json"
    write_atomic(tj, json.dumps({"device": tl.device, "source": tl.source,
                                 "num_steps": tl.num_steps, **tl.context,
                                 "samples": [asdict(s) for s in tl.samples]}) + "\n")
    table = io.StringIO(newline="")
    w = csv.writer(table)
    w.writerow(["index", "step", "phase", "time_s", "total_bytes", *CATEGORIES,
                "reserved_bytes", "device_used_bytes", "peak_bytes", "op"])
    for s in tl.samples:
        w.writerow([s.index, s.step, s.phase, _blank(s.time_s), s.total_bytes,
                    *(s.by_category.get(c, "") for c in CATEGORIES),
                    _blank(s.reserved_bytes), _blank(s.device_used_bytes),
                    _blank(s.peak_bytes), s.op])
    write_atomic(tc, table.getvalue())
    write_atomic(sj, json.dumps(summary(tl, predicted), indent=2) + "\n")
    return [tj, tc, sj]


def _blank(v: float | None) -> float | str:
    return "" if v is None else v


__all__ = ["CATEGORIES", "PHASES", "Sample", "Timeline", "first_step_anomaly", "phase_peaks",
           "step_peak_bytes", "summary", "write"]
