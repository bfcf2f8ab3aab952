"""``memplan diagnose``: why a training job ran out of memory, and what fits instead.

``diagnose(model, oom=..., **estimate_kwargs)`` estimates the configuration, sets it next to the
out-of-memory message (``oom``: its text or an ``OomReport``; a snapshot gives one too) and to what was measured
(``profile``: a ``memplan profile`` directory; ``monitor``: ``MemoryMonitor`` JSONL files),
names the failing phase and its largest component, and ranks fixes, each re-estimated and timed.
Torch-free; only ``report`` output turns bytes into GiB (``memplan.report.diagnose``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from memplan.diagnose.explain import Diagnosis, Finding
from memplan.diagnose.fixes import Fix, Fixes
from memplan.diagnose.oom import OOM_KINDS, OomReport, parse_oom
from memplan.diagnose.traceback import DiedIn, died_in
from memplan.diagnose.utilisation import Utilisation
from memplan.errors import MemplanError


@dataclass(frozen=True)
class DiagnoseResult:
    diagnosis: Diagnosis
    fixes: Fixes | None
    utilisation: Utilisation
    capacity_source: str  # where the capacity compared against came from
    monitor: Any = None  # memplan.diagnose.monitored.Monitored when monitor files were given
    # the failure's unallocated reserve beside the allocator model's (an allocator message or
    # a snapshot: memplan.diagnose.fragmentation.Fragmentation)
    fragmentation: Any = None


def diagnose(model: Any, *, oom: OomReport | str | None = None, profile: Any = None,
             monitor: Any = None, fixes: bool = True, traceback: str | DiedIn | None = None,
             snapshot: dict[str, Any] | None = None,
             **estimate_kwargs: Any) -> DiagnoseResult:
    """Estimate ``model`` with ``memplan.estimate``'s keyword arguments and explain ``oom``,
    ``profile`` (a ``memplan profile`` directory, or its ``measured.Measured``) and ``monitor``
    (``MemoryMonitor`` JSONL files or directories of them, or ``monitored.Monitored``).

    ``traceback``: the text around the error (a log), or where the job died already read
    (``memplan.diagnose.traceback.DiedIn``); an ``oom`` given as text is read for it too. The
    phase it names (the optimizer step, the gradient reduction, loading...) is explained, and
    the fixes that shrink that phase come first. ``snapshot``: a loaded memory snapshot
    (``memplan.diagnose.snapshot.load_snapshot``), whose trace is replayed through the
    allocator model.

    Without ``gpu_memory`` the capacity is the total the error reports (what the device gave
    PyTorch), else the device capacity the monitor recorded, else the GPU catalog's. Raises
    MemplanError for invalid input."""
    from memplan.api import estimate
    from memplan.arguments import dataclass_fields, one_of, strings
    from memplan.diagnose.explain import diagnose as explain
    from memplan.diagnose.explain import unexplained_bytes
    from memplan.diagnose.fixes import suggest
    from memplan.diagnose.measured import Measured
    from memplan.diagnose.monitored import Monitored
    from memplan.diagnose.utilisation import utilisation

    one_of("oom", oom, (str, OomReport, type(None)), what="an error message or an OomReport")
    one_of("traceback", traceback, (str, DiedIn, type(None)), what="a log's text or a DiedIn")
    one_of("profile", profile, (str, os.PathLike, Measured, type(None)),
           what="a `memplan profile` folder or a Measured")
    if monitor is not None and not isinstance(monitor, Monitored):
        items = [monitor] if isinstance(monitor, (str, os.PathLike)) else monitor
        if isinstance(items, (list, tuple)):
            items = [os.fspath(m) if isinstance(m, os.PathLike) else m for m in items]
        monitor = strings("monitor", items)

    if isinstance(oom, OomReport):  # objects are checked as a file's numbers would be
        dataclass_fields("oom", oom)
        one_of("oom.kind", oom.kind, (str,), what="a report kind")
        if oom.kind not in OOM_KINDS:
            raise MemplanError(f"oom.kind must be one of {', '.join(OOM_KINDS)}, got "
                               f"{oom.kind!r}")
    if isinstance(profile, Measured):
        dataclass_fields("profile", profile)
    report = parse_oom(oom) if isinstance(oom, str) else oom
    if traceback is None and isinstance(oom, str):
        traceback = oom
    died = (died_in(traceback, None if report is None else report.rank)
            if isinstance(traceback, str) else traceback)
    watched = None
    if monitor is not None:
        from memplan.diagnose.monitored import read_monitor, revalidated

        watched = revalidated(monitor) if isinstance(monitor, Monitored) else read_monitor(
            monitor)
    kwargs = dict(estimate_kwargs)
    source = "--gpu-memory" if kwargs.get("gpu_memory") is not None else "GPU catalog"
    if kwargs.get("gpu_memory") is None and report is not None and report.total_bytes:
        kwargs["gpu_memory"] = report.total_bytes
        source = "the error's total capacity"
    elif kwargs.get("gpu_memory") is None and watched is not None and watched.capacity_bytes:
        kwargs["gpu_memory"] = watched.capacity_bytes
        source = "the monitor's device capacity"
    est = estimate(model, **kwargs)
    found = explain(est, report, died)
    if profile is not None:
        from memplan.diagnose.measured import profile_findings, read_profile

        measured = (profile if isinstance(profile, Measured) else
                    read_profile(os.fspath(profile)))

        found = replace(found, findings=found.findings
                        + tuple(profile_findings(found.stage, measured)))
    if watched is not None:
        from memplan.diagnose.monitored import monitor_findings

        found = replace(found, findings=found.findings
                        + tuple(monitor_findings(est, found.capacity_bytes, watched)))
    ranked = suggest(model, est, kwargs, capacity_bytes=found.capacity_bytes,
                     margin_bytes=unexplained_bytes(found),
                     phase=None if died is None else died.phase) if fixes else None
    from memplan.diagnose.fixes import time_of

    time = ranked.baseline_time if ranked is not None else time_of(est)
    bound = utilisation(est, time, capacity_bytes=found.capacity_bytes, failed=found.fails)
    frag = None
    if report is not None and (report.reserved_bytes is not None or snapshot is not None):
        from memplan.diagnose.fragmentation import fragmentation

        frag = fragmentation(est, est.stages.index(found.stage), report, snapshot)
    return DiagnoseResult(found, ranked, bound, source, watched, frag)


__all__ = ["DiagnoseResult", "DiedIn", "Diagnosis", "Finding", "Fix", "Fixes", "OomReport", "Utilisation",
           "diagnose", "parse_oom"]
