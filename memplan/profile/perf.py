"""Run a training step under ``torch.profiler`` and reduce what it saw (``memplan.measure.perf``).

``profile_perf(model, optimizer, step_fn)`` runs ``warmup`` steps then ``steps`` profiled
steps (CPU activity, plus CUDA when the model is on a GPU, ``with_flops=True``,
``profile_memory=True``), writes the chrome trace to ``trace.json`` (open it in Perfetto,
ui.perfetto.dev, or Holistic Trace Analysis) and returns the summary. Before them a first step
runs plain (the optimizer makes its states) and a second under ``TrafficCounter``, for the
bytes a steady step's ops move (the roofline's denominator).

The trace carries, besides the profiler's own events:
- a ``record_function`` range per phase inside each ``ProfilerStep#N``: ``forward`` (the
  model's forward, from its hooks), ``backward`` (each ``torch.autograd.backward`` call, which
  ``Tensor.backward`` makes), ``optimizer`` (the optimizer's step, from its hooks); all on the
  thread that runs the step, so they nest under the step on one track;
- memory counters: each ``[memory]`` event the profiler records (an allocation or a free, with
  the device's total allocated after it) is also a counter event (``"ph": "C"``) named
  ``memory allocated (bytes)``, one series per device, which Perfetto draws as a track.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memplan.errors import raise_if_interrupted
from memplan.hardware import GpuSpec
from memplan.measure.perf import summarize
from memplan.measure.profiler_traces import analyze, load
from memplan.outputs import write_atomic
from memplan.profile.step import StepFn, _device_of

COUNTER = "memory allocated (bytes)"
_DEVICE_TYPES = {0: "cpu", 1: "cuda"}  # c10::DeviceType of the profiler's [memory] events


class TrafficCounter(TorchDispatchMode):
    """Bytes every aten op reads and writes: its tensor inputs and outputs, each once (an
    in-place op reads and writes its target). An op whose output is a view of an input (view,
    transpose, detach, expand) moves nothing. Caches and fused kernels make the true traffic
    differ; this is the traffic of ops that keep nothing between them."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not func._schema.is_mutable:
            held = {_storage(t) for t in ins} - {None}
            if any(_storage(t) in held for t in outs):
                return out  # a view of an input: no data moved
        self.bytes += sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs)
        return out


def _storage(t: torch.Tensor) -> int | None:
    st = t.untyped_storage()
    return st.data_ptr() if st.nbytes() else None


class _Range:
    """A ``record_function`` range entered and left from hooks (at most one open)."""

    def __init__(self, name: str) -> None:
        self.name, self.open, self.depth = name, None, 0

    def enter(self, *_: Any) -> None:
        self.depth += 1
        if self.depth == 1:
            self.open = record_function(self.name)
            self.open.__enter__()

    def leave(self, *_: Any) -> None:
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0 and self.open is not None:
            self.open.__exit__(None, None, None)
            self.open = None


@contextlib.contextmanager
def phase_ranges(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """While inside, each forward, backward and optimizer step is a ``record_function`` range
    named after its phase (see the module docstring)."""
    fwd, opt = _Range("forward"), _Range("optimizer")
    handles = [model.register_forward_pre_hook(fwd.enter),
               model.register_forward_hook(lambda *a: fwd.leave()),
               optimizer.register_step_pre_hook(opt.enter),
               optimizer.register_step_post_hook(lambda *a: opt.leave())]
    plain = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        with record_function("backward"):
            return plain(*args, **kwargs)

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = plain
        for h in handles:
            h.remove()
        fwd.leave()
        opt.leave()


def _ops(averages: Any, cuda: bool) -> list[dict[str, Any]]:
    rows = []
    for e in averages:
        if e.is_user_annotation or e.key.startswith("ProfilerStep"):
            continue
        self_us = float(e.self_device_time_total if cuda else e.self_cpu_time_total)
        rows.append({"name": e.key, "calls": int(e.count), "self_us": self_us,
                     "flops": int(e.flops or 0)})
    return rows


def _kernels(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            agg[e["name"]][0] += 1
            agg[e["name"]][1] += float(e["dur"])
    return [{"name": k, "calls": int(v[0]), "time_us": v[1]} for k, v in agg.items()]


def add_memory_counters(data: dict[str, Any]) -> int:
    """Add a counter event for every ``[memory]`` event of a chrome trace (in place); returns
    how many were added."""
    counters = []
    for e in data.get("traceEvents", []):
        args = e.get("args") or {}
        if e.get("name") != "[memory]" or "Total Allocated" not in args:
            continue
        device = _DEVICE_TYPES.get(args.get("Device Type"), f"device {args.get('Device Type')}")
        if args.get("Device Id", -1) >= 0:
            device += f":{args['Device Id']}"
        counters.append({"ph": "C", "name": COUNTER, "pid": e.get("pid"), "ts": e["ts"],
                         "cat": "memplan", "args": {device: int(args["Total Allocated"])}})
    data.setdefault("traceEvents", []).extend(counters)
    return len(counters)


def profile_perf(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step_fn: StepFn,
                 *, steps: int = 3, warmup: int = 1, out_dir: Path | None = None,
                 gpu: GpuSpec | None = None, top: int = 10) -> dict[str, Any]:
    """Profile ``steps`` steps after ``warmup``; ``gpu`` gives the catalog peaks (MFU, the
    roofline)."""
    cuda = _device_of(model) == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    step_fn(model, optimizer, 0)  # the first step (lazily made optimizer states): not counted
    counter = TrafficCounter()
    with counter:  # a steady step's traffic
        step_fn(model, optimizer, 0)
    with tempfile.TemporaryDirectory() as tmp:
        path = (out_dir or Path(tmp)) / "trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        seen: dict[str, Any] = {}

        def ready(prof: Any) -> None:
            seen["averages"] = prof.key_averages()
            prof.export_chrome_trace(str(path))

        with profile(activities=activities, with_flops=True, profile_memory=True,
                     on_trace_ready=ready, acc_events=True,
                     schedule=schedule(wait=0, warmup=warmup, active=steps)) as prof, \
                phase_ranges(model, optimizer):
            for k in range(1, warmup + steps + 1):
                raise_if_interrupted()  # Ctrl-C between steps (memplan.errors)
                step_fn(model, optimizer, k)
                if cuda:
                    torch.cuda.synchronize()
                prof.step()
        data = json.loads(path.read_text())
        add_memory_counters(data)
        write_atomic(path, json.dumps(data))
        ops = _ops(seen["averages"], cuda)
        kernels = _kernels(data.get("traceEvents", []))
        trace = analyze(load(path))
    on_gpu = gpu is not None and cuda
    out = summarize(ops, kernels, trace, device="cuda" if cuda else "cpu",
                    bytes_per_step=counter.bytes,
                    peak_flops=gpu.bf16_flops if on_gpu else None,
                    peak_bytes_per_s=gpu.hbm_bytes_per_s if on_gpu else None,
                    gpu_name=gpu.name if gpu is not None else None, n=top)
    out["trace"] = str(path) if out_dir is not None else None
    return out


__all__ = ["COUNTER", "TrafficCounter", "add_memory_counters", "phase_ranges", "profile_perf"]
