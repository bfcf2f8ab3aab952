"""Run a training step under ``torch.profiler`` and reduce what it saw (``memplan.perf``).

``profile_perf(model, optimizer, step_fn)`` runs ``warmup`` steps then ``steps`` profiled
steps (CPU activity, plus CUDA when the model is on a GPU, ``with_flops=True``), writes the
chrome trace to ``trace.json`` (open it in Perfetto, ui.perfetto.dev) and returns the summary.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from memplan.hardware import GpuSpec
from memplan.perf import summarize
from memplan.profile.step import StepFn, _device_of
from memplan.profiler_traces import analyze, load


def _ops(averages: Any, cuda: bool) -> list[dict[str, Any]]:
    rows = []
    for e in averages:
        if e.is_user_annotation or e.key.startswith("ProfilerStep"):
            continue
        self_us = float(e.self_device_time_total if cuda else e.self_cpu_time_total)
        rows.append({"name": e.key, "calls": int(e.count), "self_us": self_us,
                     "flops": int(e.flops or 0)})
    return rows


def _kernels(trace_path: Path) -> list[dict[str, Any]]:
    import json

    data = json.loads(trace_path.read_text())
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in data.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            agg[e["name"]][0] += 1
            agg[e["name"]][1] += float(e["dur"])
    return [{"name": k, "calls": int(v[0]), "time_us": v[1]} for k, v in agg.items()]


def profile_perf(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step_fn: StepFn,
                 *, steps: int = 3, warmup: int = 1, out_dir: Path | None = None,
                 gpu: GpuSpec | None = None, top: int = 10) -> dict[str, Any]:
    """Profile ``steps`` steps after ``warmup``; ``gpu`` gives the catalog peak for MFU."""
    cuda = _device_of(model) == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with tempfile.TemporaryDirectory() as tmp:
        path = (out_dir or Path(tmp)) / "trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        seen: dict[str, Any] = {}

        def ready(prof: Any) -> None:
            seen["averages"] = prof.key_averages()
            prof.export_chrome_trace(str(path))

        with profile(activities=activities, with_flops=True, on_trace_ready=ready, acc_events=True,
                     schedule=schedule(wait=0, warmup=warmup, active=steps)) as prof:
            for k in range(1, warmup + steps + 1):
                step_fn(model, optimizer, k)
                if cuda:
                    torch.cuda.synchronize()
                prof.step()
        ops = _ops(seen["averages"], cuda)
        kernels = _kernels(path)
        trace = analyze(load(path))
    out = summarize(ops, kernels, trace, device="cuda" if cuda else "cpu",
                    peak_flops=gpu.bf16_flops if gpu is not None and cuda else None,
                    gpu_name=gpu.name if gpu is not None else None, n=top)
    out["trace"] = str(path) if out_dir is not None else None
    return out


__all__ = ["profile_perf"]
