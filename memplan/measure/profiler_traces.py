"""Communication, overlap and stragglers from ``torch.profiler`` chrome traces, offline.

torch-free: reads the JSON (``.json`` or ``.json.gz``) that ``prof.export_chrome_trace`` and
the TensorBoard handler write, one file per rank. All times are microseconds (``*_us``), the
chrome trace unit.

What counts as what:
- GPU traces (any ``kernel`` event): communication = kernels named ``nccl*``; copies =
  ``gpu_memcpy`` and ``gpu_memset``; compute = every other kernel.
- CPU-only traces (gloo): communication = the ``gloo:<collective>`` ranges recorded on gloo's
  worker threads; compute = every ``cpu_op`` except ``c10d::`` launches.
- Steps: ``ProfilerStep#N`` ranges (``gpu_user_annotation`` ones on GPU traces when present).
  The analysed window is the union of the steps, or the whole trace when it has none.

Within the window W, with C, M, Y the unions of compute, communication and copies:
overlapped communication = |M ∩ C|; exposed = |M - C|; and W splits exactly into compute |C|,
exposed communication |M - C|, exposed copies |Y - C - M| and idle |W - (C ∪ M ∪ Y)|.
Each stream's (GPU) or thread's (CPU) own busy time in W is reported too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.measure.intervals import Interval, intersect, length, subtract, union
from memplan.measure.stragglers import STRAGGLER_PCT, stragglers
from memplan.measure.trace_files import RankTrace, read_trace

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_NCCL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)", re.IGNORECASE)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def collective_of(event: dict[str, Any]) -> str | None:
    """The collective an event runs, or None when it is not communication."""
    name = event.get("name", "")
    cat = event.get("cat", "")
    if cat == "kernel":
        m = _NCCL.match(name)
        if m is None:
            return None
        given = (event.get("args") or {}).get("Collective name")
        return str(given) if given else _snake(m.group(1))
    if name.startswith("gloo:") and cat in ("user_annotation", "cpu_op"):
        return name.split(":", 1)[1]
    return None


def load(path: str | Path, index: int = 0) -> RankTrace:
    """Read one chrome trace; the rank comes from ``distributedInfo``, else ``index``. A file
    cut short is read up to its last complete event (``RankTrace.partial`` says where it
    ends; ``memplan.measure.trace_files``)."""
    p = Path(path)
    trace = read_trace(p)
    events = trace.events
    info = trace.meta.get("distributedInfo") or {}
    has_gpu = any(e.get("cat") == "kernel" for e in events)
    rt = RankTrace(path=str(p), rank=int(info.get("rank", index)),
                   world_size=info.get("world_size"), device="gpu" if has_gpu else "cpu",
                   partial=trace.partial)
    gpu_steps = any(e.get("cat") == "gpu_user_annotation" and _STEP.match(e.get("name", ""))
                    for e in events)
    for e in events:
        _classify(rt, e, gpu_steps)
    rt.steps.sort()
    if not events:
        raise MemplanError(f"{p}: no complete ('X') events; " + (
            trace.partial if trace.partial else "export with export_chrome_trace"))

    return rt


def _classify(rt: RankTrace, e: dict[str, Any], gpu_steps: bool) -> None:
    lo = float(e["ts"])
    hi = lo + float(e["dur"])
    cat, name = e.get("cat", ""), e.get("name", "")
    step = _STEP.match(name)
    if step and cat == ("gpu_user_annotation" if gpu_steps else "user_annotation"):
        rt.steps.append((int(step.group(1)), lo, hi))
        return
    coll = collective_of(e)
    if coll is not None:
        rt.comm.append((coll, lo, hi))
    elif rt.device == "gpu":
        if cat == "kernel":
            rt.compute.append((lo, hi))
        elif cat in ("gpu_memcpy", "gpu_memset"):
            rt.copies.append((lo, hi))
        else:
            return
    elif cat == "cpu_op" and not name.startswith("c10d::"):
        rt.compute.append((lo, hi))
    else:
        return
    lane = f"{'stream' if rt.device == 'gpu' else 'thread'} {e.get('tid', '?')}"
    rt.lanes.setdefault(lane, []).append((lo, hi))


def window(rt: RankTrace) -> list[Interval]:
    if rt.steps:
        return union((lo, hi) for _, lo, hi in rt.steps)
    spans = rt.compute + rt.copies + [(lo, hi) for _, lo, hi in rt.comm]
    return [(min(s[0] for s in spans), max(s[1] for s in spans))] if spans else []


def analyze(rt: RankTrace) -> dict[str, Any]:
    """One rank: communication by collective, overlap, exposure per step, the time split."""
    w = window(rt)
    c = intersect(rt.compute, w)
    m = intersect([(lo, hi) for _, lo, hi in rt.comm], w)
    y = intersect(rt.copies, w)
    exposed = subtract(m, c)
    busy = union(c + m + y)
    by_coll: dict[str, dict[str, float]] = {}
    for coll in sorted({k for k, _, _ in rt.comm}):
        spans = intersect([(lo, hi) for k, lo, hi in rt.comm if k == coll], w)
        count = sum(1 for k, lo, hi in rt.comm if k == coll and intersect([(lo, hi)], w))
        by_coll[coll] = {"count": count, "time_us": length(spans),
                         "exposed_us": length(subtract(spans, c))}
    per_step = []
    for num, lo, hi in rt.steps:
        sw = [(lo, hi)]
        per_step.append({"step": num, "duration_us": hi - lo,
                         "compute_us": length(intersect(c, sw)),
                         "comm_us": length(intersect(m, sw)),
                         "exposed_comm_us": length(intersect(exposed, sw))})
    comm_us = length(m)
    return {
        "path": rt.path, "rank": rt.rank, "device": rt.device, "window_us": length(w),
        "num_steps": len(rt.steps),
        "split_us": {"compute": length(c), "exposed_comm": length(exposed),
                     "exposed_copies": length(subtract(y, c + m)),
                     "idle": length(w) - length(busy)},
        "comm_us": comm_us, "overlapped_comm_us": comm_us - length(exposed),
        "overlap_fraction": (comm_us - length(exposed)) / comm_us if comm_us else None,
        "collectives": by_coll, "steps": per_step,
        "lanes_busy_us": {k: length(intersect(v, w)) for k, v in sorted(rt.lanes.items())},
    }


# The names torch.profiler's exporters give a trace (tensorboard_trace_handler writes
# <worker>.<time>.pt.trace.json, gzipped with use_gzip), as a folder of them is read.
TRACE_SUFFIXES = (".json", ".json.gz")


def trace_paths(paths: list[str | Path]) -> list[Path]:
    """``paths`` with each folder replaced by the trace files in it (``TRACE_SUFFIXES``, in
    name order), as Holistic Trace Analysis takes a folder of one run's traces. One line for
    a folder that holds none."""
    out: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            out.append(path)
            continue
        found = sorted(p for p in path.iterdir()
                       if p.name.endswith(TRACE_SUFFIXES) and not p.name.startswith(".")
                       and p.is_file())
        if not found:
            raise MemplanError(f"trace: {path} is a folder without trace files (*.json or "
                               "*.json.gz); give the traces or the folder that holds them")
        out += found
    return out


def load_all(paths: list[str | Path]) -> list[RankTrace]:
    """Every trace of ``paths`` (files, or folders of them: ``trace_paths``), loaded."""
    return [load(p, i) for i, p in enumerate(trace_paths(paths))]


def analyze_paths(paths: list[str | Path], threshold_pct: float | None = None
                  ) -> dict[str, Any]:
    """Every rank's ``analyze``, and across ranks ``memplan.measure.stragglers.stragglers`` (with
    ``threshold_pct``, default ``STRAGGLER_PCT``). ``paths``: trace files, or folders of them."""
    return analyze_traces(load_all(paths), threshold_pct)


def _same_rank(traces: list[RankTrace]) -> MemplanError | None:
    """One line naming the first two traces of one rank, or None."""
    seen: dict[int, RankTrace] = {}
    for rt in traces:
        first = seen.setdefault(rt.rank, rt)
        if first is rt:
            continue
        try:
            same = Path(first.path).samefile(rt.path)
        except OSError:
            same = False
        if same:
            return MemplanError(f"trace: {rt.path} is given twice ({first.path}); give each "
                                "rank's trace once")
        return MemplanError(f"trace: {first.path} and {rt.path} are both rank {rt.rank} (their "
                            "distributedInfo.rank, or their place in the list without one); "
                            "give one trace per rank")
    return None


def analyze_traces(traces: list[RankTrace], threshold_pct: float | None = None
                   ) -> dict[str, Any]:
    """``analyze_paths`` of traces already loaded."""
    twice = _same_rank(traces)
    if twice is not None:
        raise twice
    out: dict[str, Any] = {"unit": "microseconds (chrome trace ts/dur)",
                           "ranks": [analyze(rt) for rt in traces],
                           "partial": [rt.partial for rt in traces if rt.partial]}
    if len(traces) > 1:
        windows = {rt.rank: window(rt) for rt in traces}
        out["across_ranks"] = stragglers(traces, windows, STRAGGLER_PCT if threshold_pct is None
                                         else threshold_pct)
    return out


__all__ = ["TRACE_SUFFIXES", "analyze", "analyze_paths", "analyze_traces",
           "collective_of", "load", "load_all", "trace_paths", "window"]
