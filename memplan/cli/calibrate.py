"""``memplan calibrate``: measure this machine (or a user's model) and fit a profile."""

from __future__ import annotations

import enum
import json
import os
import re
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Annotated

import typer

from memplan.cli.options import Job, Json, uses
from memplan.errors import Interrupted, MemplanError, deferred_interrupts
from memplan.outputs import check_inside, check_out_dir
from memplan.report.versioned import dumps
from memplan.workload import Precision, Workload

# the most CPU ranks on a small machine: each rank is a process running the model; more
# than the machine's CPUs (or this, on a machine with fewer) only queue for them
MIN_CPU_RANKS = 8


class DeviceChoice(str, enum.Enum):
    CUDA = "cuda"
    CPU = "cpu"


DeviceOpt = Annotated[DeviceChoice, typer.Option(
    "--device", help="cuda: the GPU's allocator, context and NCCL; cpu: the same pipeline "
    "against the exact tracker (tensors only).")]
Quick = Annotated[bool, typer.Option("--quick", help="A 10-run grid (3 steps each) instead of 42.")]
Resume = Annotated[bool, typer.Option("--resume", help="Skip points already recorded.")]
Nproc = Annotated[int, typer.Option(
    "--nproc", help="Ranks launched through torchrun (NCCL on CUDA, gloo on CPU): per-rank "
    "memory under FSDP2 and TP.")]
Module = Annotated[str | None, typer.Option(
    "--module", help="pkg.mod:factory (or file.py:factory) building your nn.Module "
    "(factory(*, dtype, device)); traced under fake tensors for a model profile.")]
RefModel = Annotated[str | None, typer.Option(
    "--model", "-m", help="Grid: the reference model's spec (default: sized for the device). "
    "--module: the spec the module implements (default: read from its Hugging Face config).")]
Out = Annotated[Path, typer.Option(
    "--out", help="Calibration folder: records go to OUT/records/NAME, the profile to "
    "OUT/profiles/NAME.json.")]
Name = Annotated[str | None, typer.Option(
    "--name", help="Run name (default: the GPU's catalog name, cpu, or model-<factory>).")]
GpuName = Annotated[str | None, typer.Option(
    "--gpu", help="Catalog name of this GPU when its device name does not match one.")]
MaxSeq = Annotated[int | None, typer.Option(
    "--seq", help="--module: the longest sequence traced, up to the model's positions "
    "(default: min(max positions, 1024)).")]
Real = Annotated[bool, typer.Option(
    "--real", help="--module: real CPU tensors instead of fake ones (for a small config whose "
    "forward reads tensor values).")]
Refit = Annotated[bool, typer.Option(
    "--refit", help="Re-fit every profile under OUT/profiles from its records; measure nothing.")]


def _command(**opts: object) -> str:
    """The command line that reproduces this run (for the records' metadata)."""
    parts = ["memplan calibrate"]
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value not in (None, False):
            parts.append(f"{flag} {getattr(value, 'value', value)}")
    return " ".join(parts)


def _progress(total: int):
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    console=Console(stderr=True))


# the reference model, layouts and the rest of the workload are the grid's own; --module
# traces the user's model with the implementation these options describe
MODULE_ONLY = ("optimizer_impl", "attention", "norm", "framework")


@uses("precision", *MODULE_ONLY, attention=None)
def calibrate(
    job: Job,
    device: DeviceOpt = DeviceChoice.CUDA,
    quick: Quick = False,
    resume: Resume = False,
    nproc: Nproc = 1,
    module: Module = None,
    model: RefModel = None,
    seq: MaxSeq = None,
    real: Real = False,
    out: Out = Path("calibration"),
    name: Name = None,
    gpu: GpuName = None,
    refit: Refit = False,
    json_out: Json = False,
) -> None:
    """Measure memory and step time on this machine and fit a calibration profile.

    Runs short training steps of the reference model over a grid (micro-batch, sequence,
    recompute, precision, attention), each record written as soon as it finishes, then fits
    the profile that `estimate --calibration` and `plan --calibration` apply. With --module it
    traces your own model instead; --framework, --precision, --optimizer-impl, --attention and
    --norm then say what it runs (the profile applies to estimates of that workload only).

    Examples:

      memplan calibrate --quick

      memplan calibrate --device cpu --quick --out /tmp/cal

      memplan calibrate --nproc 8

      memplan calibrate --device cpu --module mypkg.models:build --seq 512

      memplan calibrate --device cpu --module mypkg.models:build --framework hf

      memplan calibrate --refit
    """
    precision = job.precision
    out = check_out_dir(out)
    for inner in ("records", "profiles"):  # before any work: no link inside --out
        check_inside(out, out / inner)
    if refit:
        return _refit(out, json_out)
    if name is not None:
        _check_name(name)
    if nproc < 1:
        raise MemplanError(f"nproc ({nproc}) must be at least 1")
    cpu_ranks = max(os.cpu_count() or 1, MIN_CPU_RANKS)
    if device is DeviceChoice.CPU and nproc > cpu_ranks:  # each rank is a process
        raise MemplanError(f"nproc ({nproc}) must be at most {cpu_ranks} on --device cpu (this "
                           f"machine's {os.cpu_count()} CPUs, at least {MIN_CPU_RANKS}): each "
                           "rank is a process")
    if module is not None and (nproc > 1 or device is not DeviceChoice.CPU):
        raise MemplanError("module: a user model is traced under fake tensors on one CPU "
                           "process; use --device cpu without --nproc")
    if module is None:
        given = [name for name in MODULE_ONLY if job.values[name] is not None]
        given += ["seq"] if seq is not None else []
        given += ["real"] if real else []
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise MemplanError(f"{given[0].replace('_', '-')}: {flags} only apply with --module "
                               "(they describe the model it traces); the grid runs its own "
                               "reference model over its own sequences and implementations")
    if precision is Precision.FSDP_BF16:
        raise MemplanError("precision: fsdp-bf16 needs an FSDP layout; calibrate runs it "
                           "with --nproc")
    torch = _torch()
    if device is DeviceChoice.CUDA:
        _check_cuda(torch, nproc)
    command = _command(device=device, quick=quick, nproc=nproc if nproc > 1 else None,
                       module=module, model=model, precision=None if module is None
                       else precision, **{n: job.values[n] for n in MODULE_ONLY}, seq=seq,
                       real=real, gpu=gpu, name=name,
                       out=None if out == Path("calibration") else out)
    from memplan.profile.calibrate_run import make_meta

    meta = make_meta(device.value, command, gpu, num_devices=max(1, nproc))
    if module is not None:
        name = name or "model-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", module.split(":")[-1])
    else:
        name = name or (meta.gpu or "cpu") + (f"-nproc{nproc}" if nproc > 1 else "")
    _check_name(name)
    folder = out / "records" / name
    _check_folder(folder, resume)
    try:
        if nproc > 1:  # torch runs in the ranks; here Ctrl-C stops them (_run_dist)
            _run_dist(device.value, nproc, quick, resume, gpu, command, folder)
        else:
            with deferred_interrupts():  # Ctrl-C taken between torch operators and steps
                if module is not None:
                    _run_module(module, model, job, seq, meta, folder, resume, fake=not real)
                else:
                    _run_grid(device.value, model, quick, resume, meta, folder)
        _fit_and_report(folder, out / "profiles" / f"{name}.json", name, json_out)
    except KeyboardInterrupt:
        raise Interrupted(_kept(folder, name)) from None


# a run name is one folder and one file name inside --out: no separators, no "..", no
# leading dot or dash (a hidden file, an option)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name) or ".." in name:
        raise MemplanError(f"name: {name!r} is not a plain run name (letters, digits, '.', '_' "
                           "and '-', at most 128, no '/' or '..'): the run is written to "
                           "OUT/records/NAME and OUT/profiles/NAME.json, inside --out")


def _kept(folder: Path, name: str) -> str:
    """What an interrupted run kept (each record is written whole as it finishes) and the
    command that resumes it."""
    from memplan.calibrate.records import finished_keys
    from memplan.cli import command_line

    done = len(finished_keys(folder))
    return (f"{done} finished {'record is' if done == 1 else 'records are'} saved in {folder}; "
            f"resume with: {command_line('--resume', '--name', name)}")


def _torch():
    try:
        import torch
    except ImportError as err:
        raise MemplanError(f"calibrate needs torch: pip install 'memplan[torch]' ({err})") from err
    return torch


def _check_cuda(torch, nproc: int) -> None:
    if not torch.cuda.is_available():
        raise MemplanError(
            f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}: "
            "torch.cuda.is_available() is False); run on a GPU machine, or use --device cpu "
            "to exercise the pipeline against the exact tracker")
    if torch.cuda.device_count() < nproc:
        raise MemplanError(f"nproc ({nproc}) needs {nproc} CUDA devices, found "
                           f"{torch.cuda.device_count()} (NCCL puts one rank on each)")


def _check_folder(folder: Path, resume: bool) -> None:
    """The run's records folder, before any point is measured: inside --out (no link on the
    way), and empty unless resuming."""
    from memplan.calibrate.records import finished_keys

    check_inside(folder.parents[1], folder)

    done = finished_keys(folder)
    if done and not resume:
        raise MemplanError(f"{folder} already holds {len(done)} records; pass --resume to "
                           "continue that run, or --name for a new one")


def _run_grid(device: str, model: str | None, quick: bool, resume: bool, meta, folder: Path
              ) -> None:
    from memplan.calibrate.grid import device_grid
    from memplan.calibrate.records import finished_keys, write_probes
    from memplan.profile.calibrate_run import run_grid

    spec = None
    if model is not None:
        from memplan.spec import load_model

        spec = load_model(model)
    points = device_grid(device, quick=quick, total_bytes=meta.total_bytes, spec=spec)
    if device == "cuda" and not (resume and (folder / "probes.json").is_file()):
        from memplan.calibrate.records import ProbeRecord
        from memplan.profile.overhead_probe import run_probes

        write_probes(folder, ProbeRecord(meta=meta, probes=run_probes()))
    done = finished_keys(folder) if resume else set()
    steps = 3 if quick else 4
    with _progress(len(points)) as bar:
        task = bar.add_task(f"{meta.device_name}: {points[0].spec.name}", total=len(points),
                            completed=sum(p.key in done for p in points))
        run_grid(points, folder, meta, steps=steps, resume=resume,
                 progress=lambda p, rec: rec is not None and bar.advance(task))


def _run_dist(device: str, nproc: int, quick: bool, resume: bool, gpu: str | None,
              command: str, folder: Path) -> None:
    from memplan.calibrate.grid import parallel_grid

    total = len(parallel_grid(device, nproc, quick=quick))
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "memplan.profile.calibrate_dist",
            "--folder", str(folder), "--device", device, "--steps", "3" if quick else "4",
            "--command", command, *(["--gpu", gpu] if gpu else []),
            *(["--quick"] if quick else []), *(["--resume"] if resume else [])]
    folder.mkdir(parents=True, exist_ok=True)
    with _progress(total) as bar:
        task = bar.add_task(f"{nproc} ranks ({device})", total=total)
        # One pipe for both streams: reading stdout to its end while torchrun fills a separate
        # stderr pipe would block both processes once that pipe's buffer is full.
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        other: deque[str] = deque(maxlen=400)  # the lines that are not records, last ones
        try:
            for line in proc.stdout:
                if line.startswith("{"):
                    bar.advance(task)
                elif line.strip():
                    other.append(line.strip())
        except BaseException:  # Ctrl-C: the ranks stop too (each record is written whole)
            _stop(proc)
            raise
        if proc.wait() != 0:
            raise MemplanError(f"torchrun with {nproc} ranks failed (exit {proc.returncode}): "
                               f"{failure_line(list(other))}")


_EXCEPTION = re.compile(r"^(\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*:")
_FATAL = ("terminate called", "Fatal Python error")


def failure_line(lines: list[str]) -> str:
    """The line of torchrun's output that says why a rank failed.

    torchrun ends a failed run with its own ``ChildFailedError`` traceback and a table framed by
    ``=`` and ``-`` lines, so the last line says nothing. In order of preference: the last
    exception a rank raised (``ValueError: ...``, not torchrun's ``ChildFailedError``), a C++ or
    interpreter abort (``terminate called ...``, ``Fatal Python error: ...``), the root cause's
    ``traceback :`` entry (the signal that ended the rank), else the last line that is not a
    frame. ``lines`` are stripped and non-empty."""
    raised = [ln for ln in lines if _EXCEPTION.match(ln) and "ChildFailedError" not in ln]
    if raised:
        return raised[-1]
    fatal = [ln for ln in lines if ln.startswith(_FATAL)]
    if fatal:
        return fatal[0]
    if "Root Cause (first observed failure):" in lines:
        cause = lines[lines.index("Root Cause (first observed failure):"):]
        signal = [ln for ln in cause if ln.startswith("traceback :")]
        if signal:
            return signal[0].removeprefix("traceback :").strip()
    text = [ln for ln in lines if set(ln) - set("=-")]
    return text[-1] if text else "no output"


def _stop(proc: subprocess.Popen) -> None:
    """End torchrun and its ranks: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run_module(target: str, model: str | None, job: Job, seq: int | None, meta,
                folder: Path, resume: bool, *, fake: bool) -> None:
    from memplan.calibrate.records import finished_keys, write_record
    from memplan.profile.user_model import (
        load_factory,
        measure_user_point,
        point_key,
        resolve_spec,
        user_points,
    )

    factory = load_factory(target)
    spec = None
    if model is not None:
        from memplan.spec import load_model

        spec = load_model(model)
    spec, configured = resolve_spec(factory, spec)
    points = user_points(spec, seq)
    wl = module_workload(spec, job, configured)
    done = finished_keys(folder) if resume else set()
    with _progress(len(points)) as bar:
        task = bar.add_task(f"{target} ({spec.name})", total=len(points))
        for point in points:
            if point_key(point[0], point[1]) not in done:
                write_record(folder, measure_user_point(factory, target, spec, wl, point, meta,
                                                        fake=fake))
            bar.advance(task)


def module_workload(spec, job: Job, configured) -> Workload:
    """The workload a user model is traced and fitted against: the options given, the
    framework's defaults (``memplan.presets``) for the rest, and the attention the model's
    Hugging Face config names (``configured``: (attention, its config name) or None), which
    an --attention that says otherwise contradicts."""
    from memplan.api import resolve

    kwargs = job.kwargs()
    if configured is not None:
        found, name = configured
        given = kwargs.get("attention")
        if given is not None and given is not found:
            raise MemplanError(f"attention: the model's config runs {name!r} attention "
                               f"(config._attn_implementation), which memplan describes as "
                               f"{found.value}, not {given.value}; set attn_implementation "
                               "in the factory's config instead")
        kwargs["attention"] = found
    return resolve(spec, **{k: v for k, v in kwargs.items() if v is not None})[2]


def _fit_and_report(folder: Path, path: Path, name: str, json_out: bool) -> None:
    from memplan.calibrate.calibration_profile import save_profile
    from memplan.calibrate.refit import build_profile

    profile = build_profile(folder, path, name)
    save_profile(path, profile)
    if json_out:
        typer.echo(dumps("calibrate", {"profile": profile.model_dump(mode="json",
                                                                   exclude_none=True)}))
        return
    from rich.console import Console

    from memplan.report.calibration import render_profile

    Console().print(render_profile(profile, str(path)))


def _refit(out: Path, json_out: bool) -> None:
    from memplan.calibrate.refit import refit_all

    results = refit_all(out)
    if json_out:
        typer.echo(dumps("calibrate", [{"profile": str(p), "changed": c} for p, c in results],
                         "profiles", indent=None))
        return
    for path, changed in results:
        typer.echo(f"{path}: {'re-fitted, changed' if changed else 'unchanged'}")
