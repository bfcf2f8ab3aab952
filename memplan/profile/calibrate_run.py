"""Run the calibration grid: short training runs of the reference model, measured per phase.

CUDA: the model runs without the tracker (its per-op hook would distort the step time); at each
phase boundary the device is synchronised and the caching allocator's peaks since the last
boundary are read (``max_memory_allocated`` / ``max_memory_reserved``, then
``reset_peak_memory_stats``), with ``mem_get_info`` and ``memory_stats`` at the boundary. An
out-of-memory point is recorded as such, its memory freed (``empty_cache``), and the grid goes
on. CPU (``--device cpu``): the same steps under the exact tracker on real CPU tensors, which
sees tensors only (no context, no allocator).

Each record is written atomically as soon as its point finishes; ``resume`` skips points whose
record exists.
"""

from __future__ import annotations

import gc
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Self

import torch

from memplan.calibrate.grid import Point
from memplan.calibrate.records import (
    PHASES,
    Meta,
    PhaseMeasure,
    RankMeasure,
    Record,
    StepMeasure,
    cpu_name,
    finished_keys,
    write_record,
)
from memplan.errors import MemplanError
from memplan.hardware import gpu_catalog, load_gpu
from memplan.planning.timing import step_flops
from memplan.profile.reference import ReferenceModel
from memplan.profile.trace import TraceResult, ref_options, run_steps
from memplan.profile.tracker import MemoryTracker, PhasePeak


def _today() -> str:
    return datetime.now(UTC).date().isoformat()


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0] if out.returncode == 0 and lines else None


def match_gpu(device_name: str, total_bytes: int) -> str | None:
    """The catalog GPU for ``torch.cuda.get_device_name()``: its name or an alias, normalised,
    is the device name (or, failing that, a part of it: the longest such part wins), and its
    memory is within 2% of ``total_bytes``; None when nothing matches."""
    from memplan.hardware import _normal

    name = _normal(device_name)
    found = []
    for key, gpu in gpu_catalog().items():
        if abs(gpu.memory_bytes - total_bytes) > 0.02 * total_bytes:
            continue
        for alias in (key, *gpu.aliases):
            alias = _normal(alias)
            if alias == name or alias in name:
                found.append((alias == name, len(alias), key))
    return max(found)[2] if found else None


def make_meta(device: str, command: str, gpu: str | None = None, num_devices: int = 1) -> Meta:
    """Metadata of this machine for ``device``; ``gpu`` overrides the catalog match."""
    common = {"torch": torch.__version__, "python": platform.python_version(),
              "date": _today(), "command": command, "num_devices": num_devices}
    if device == "cpu":
        return Meta(device="cpu", device_name=cpu_name(),
                    attention_backend="flash: scaled_dot_product_attention's CPU flash kernel; "
                                      "eager: matmul + softmax", **common)
    props = torch.cuda.get_device_properties(0)
    name = torch.cuda.get_device_name(0)
    catalog = load_gpu(gpu).name if gpu else match_gpu(name, props.total_memory)
    if catalog is None:
        raise MemplanError(f"GPU {name!r} ({props.total_memory:,} bytes) matches no catalog "
                           "GPU; pass --gpu NAME (`memplan gpus`)")
    backend = ("flash: scaled_dot_product_attention restricted to SDPBackend.FLASH_ATTENTION "
               f"(flash_sdp_enabled={torch.backends.cuda.flash_sdp_enabled()}); eager: matmul + "
               "softmax")
    return Meta(device="cuda", device_name=name, gpu=catalog, total_bytes=props.total_memory,
                driver=_driver(), cuda=torch.version.cuda, attention_backend=backend, **common)


class PhaseClock:
    """Wraps a tracker's ``set_phase``: times each step and, on CUDA, samples the allocator per
    phase. Keys are (step, phase)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.starts: dict[int, float] = {}
        self.samples: dict[tuple[int, str], PhaseMeasure] = {}
        self.current: tuple[int, str] | None = None
        self.end = 0.0

    def attach(self, tracker) -> None:
        inner = tracker.set_phase

        def set_phase(phase: str, step: int | None = None) -> None:
            self.on_phase(phase, step)
            inner(phase, step)

        tracker.set_phase = set_phase

    def on_phase(self, phase: str, step: int | None) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        key = (step if step is not None else (self.current or (0, ""))[0], phase)
        if key == self.current:
            return
        self.close()
        if step is not None:
            self.starts[step] = time.perf_counter()
        self.current = key
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            if self.current is not None:
                self.samples[self.current] = cuda_sample()
        self.end = time.perf_counter()

    def step_times(self) -> dict[int, float]:
        steps = sorted(self.starts)
        ends = [self.starts[k] for k in steps[1:]] + [self.end]
        return {k: end - self.starts[k] for k, end in zip(steps, ends, strict=True)}


def cuda_sample() -> PhaseMeasure:
    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    return PhaseMeasure(allocated_bytes=torch.cuda.max_memory_allocated(),
                        reserved_bytes=torch.cuda.max_memory_reserved(),
                        device_used_bytes=total - free,
                        alloc_retries=int(stats.get("num_alloc_retries", 0)),
                        inactive_split_bytes=int(stats.get("inactive_split_bytes.all.current", 0)))


class NullTracker:
    """The tracker interface ``run_steps`` uses, counting nothing (CUDA runs read the allocator
    instead, without a per-op hook)."""

    def __init__(self) -> None:
        self.timeline: list = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def register(self, *_a) -> None: ...
    def relabel(self, *_a) -> None: ...
    def forget(self, *_a) -> None: ...
    def set_phase(self, phase: str, step: int | None = None) -> None: ...

    def bytes_in(self, _category: str) -> int:
        return 0

    def peak(self, _step: int, _phase: str) -> PhasePeak:
        return PhasePeak()


def rank_flops(point: Point) -> float:
    """Hardware FLOPs one rank runs per step (``memplan.planning.timing``: recompute included)."""
    par, wl = point.layout, point.workload
    return step_flops(point.spec, wl, wl.micro_batch_size * par.dp, pp=par.pp,
                      vpp=par.vpp)[1] / par.world_size


def steps_of(point: Point, clock: PhaseClock, traced: TraceResult | None) -> list[StepMeasure]:
    """Per-step measures: phases from the tracker (CPU) or the allocator samples (CUDA)."""
    flops, times, out = rank_flops(point), clock.step_times(), []
    for k in sorted(times):
        t = max(times[k], 1e-9)
        if traced is not None:
            st = traced.steps[k - 1]
            phases = {p: PhaseMeasure(allocated_bytes=st.phases[p].total_bytes) for p in PHASES}
            saved = st.saved_activations_bytes
        else:
            phases = {p: clock.samples[(k, p)] for p in PHASES}
            saved = None
        out.append(StepMeasure(step=k, time_s=t, hardware_flops=flops,
                               achieved_flops_per_s=flops / t, phases=phases,
                               saved_activations_bytes=saved))
    return out


def _record(point: Point, meta: Meta, **fields) -> Record:
    return Record(kind="grid", key=point.key, spec=point.spec, layout=point.layout,
                  workload=point.workload, meta=meta, **fields)


def measure_cpu(point: Point, meta: Meta, steps: int) -> Record:
    torch.manual_seed(0)
    model = ReferenceModel(point.spec, ref_options(point.workload))
    tracker, clock = MemoryTracker(), PhaseClock(cuda=False)
    clock.attach(tracker)
    traced = run_steps(model, point.spec, point.workload, tracker, steps=steps)
    clock.close()
    num = sum(p.numel() for p in model.parameters())
    return _record(point, meta, status="ok", num_params=num,
                   ranks=[RankMeasure(rank=0, steps=steps_of(point, clock, traced))])


def measure_cuda(point: Point, meta: Meta, steps: int) -> Record:
    torch.manual_seed(0)
    tracker, clock = NullTracker(), PhaseClock(cuda=True)
    clock.attach(tracker)
    with torch.device("cuda"):  # the step's token ids are created on the default device
        model = ReferenceModel(point.spec, ref_options(point.workload), device="cuda")
        run_steps(model, point.spec, point.workload, tracker, steps=steps)
    clock.close()
    num = sum(p.numel() for p in model.parameters())
    return _record(point, meta, status="ok", num_params=num,
                   ranks=[RankMeasure(rank=0, steps=steps_of(point, clock, None))])


def measure(point: Point, meta: Meta, steps: int) -> Record:
    """One point; an out-of-memory error becomes a record with status ``oom``."""
    oom = (torch.cuda.OutOfMemoryError, MemoryError)
    run = measure_cuda if meta.device == "cuda" else measure_cpu
    message = None
    try:
        return run(point, meta, steps)
    except oom as err:  # leave the handler first, so its frames (and tensors) can be freed
        message = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    finally:
        gc.collect()
        if meta.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return _record(point, meta, status="oom", error=message)


Progress = Callable[[Point, Record | None], None]


def run_grid(points: list[Point], folder: Path, meta: Meta, *, steps: int, resume: bool,
             progress: Progress | None = None) -> list[Record]:
    """Measure every point not yet recorded in ``folder`` (with ``resume``), writing each
    record as soon as it finishes. Returns the records written now."""
    done = finished_keys(folder) if resume else set()
    written = []
    for point in points:
        if point.key in done:
            if progress:
                progress(point, None)
            continue
        rec = measure(point, meta, steps)
        write_record(folder, rec)
        written.append(rec)
        if progress:
            progress(point, rec)
    return written


def device_summary() -> str:
    """One line for error messages: what torch sees."""
    return (f"torch {torch.__version__}, CUDA build {torch.version.cuda}, "
            f"cuda available: {torch.cuda.is_available()}, python {sys.version.split()[0]}")
