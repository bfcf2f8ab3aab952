"""``memplan profile``: a memory timeline of real training steps, by phase, next to the estimate."""

from __future__ import annotations

import io
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer

from memplan.api import resolve
from memplan.cli import command_line
from memplan.cli.options import (
    FRAMEWORK_ONLY,
    WORKLOAD,
    Html,
    Job,
    Json,
    uses,
    check_html,
    write_html,
)
from memplan.errors import Interrupted, MemplanError, deferred_interrupts
from memplan.outputs import check_out_dir, staged_dir, write_atomic
from memplan.report.versioned import dumps

Steps = Annotated[int, typer.Option("--steps", help="Training steps (>= 2).")]
Device = Annotated[str, typer.Option("--device", help="cpu (exact tensor tracker) or cuda "
                                     "(caching allocator, device used, memory snapshot).")]
Fake = Annotated[bool, typer.Option(
    "--fake/--real", help="CPU: fake tensors (no memory, any size) or real tensors.")]
Layers = Annotated[int | None, typer.Option(
    "--layers", help="Run only this many layers of the model (a shorter copy of the spec).")]
Perf = Annotated[bool, typer.Option(
    "--perf", help="Also time the steps under torch.profiler (real tensors): top ops and "
    "kernels, compute/communication/copies/idle, FLOP/s, bytes/s, MFU, the bound (a roofline "
    "on CUDA); trace.json in --out, with phase ranges and memory counters.")]
Out = Annotated[Path | None, typer.Option(
    "--out", help="Write timeline.json, timeline.csv, summary.json (and timeline.png with "
    "matplotlib; snapshot.pickle on CUDA) here.")]
PlotFormat = Annotated[str, typer.Option(
    "--plot-format", help="The timeline plot's format in --out: png or svg.")]


# one rank, no layout; the global batch is the micro-batch
@uses("model", *(n for n in WORKLOAD if n != "gbs" and n not in FRAMEWORK_ONLY),
      "gpu")
def profile(
    job: Job,
    layers: Layers = None,
    steps: Steps = 3,
    device: Device = "cpu",
    fake: Fake = True,
    out: Out = None,
    perf: Perf = False,
    plot_format: PlotFormat = "png",
    json_out: Json = False,
    html: Html = None,
) -> None:
    """Run training steps of the reference model on one rank and record memory by phase.

    Per step and phase (forward, backward, optimizer, other): the peak bytes by category, the
    first step against the steady state with the bytes of each cause, and the estimate's
    per-phase peaks for the same workload (tensors only on CPU; with --gpu's fixed overheads
    on CUDA). Needs torch (the torch extra).

    Examples:

      memplan profile --model llama-7b --layers 2 --mbs 2 --seq 2048 --out prof/

      memplan profile -m tiny --real --steps 4 --json

      memplan profile -m tiny --real --perf --out prof/

      memplan profile -m tiny --real --html profile.html
    """
    if device not in ("cpu", "cuda"):
        raise MemplanError(f"--device {device!r}: profile runs on cpu or cuda")
    if out is not None:  # where the results go is checked before anything runs
        out = check_out_dir(out)
    html = check_html(html)

    if plot_format not in ("png", "svg"):
        raise MemplanError(f"--plot-format ({plot_format!r}) must be png or svg")
    spec, par, wl = resolve(job.model, **job.kwargs(resolve_only=True))
    if layers is not None:
        if not 0 < layers <= spec.num_layers:
            raise MemplanError(f"layers ({layers}) must be between 1 and {spec.num_layers}")
        spec = spec.model_copy(update={"num_layers": layers, "name": f"{spec.name}[:{layers}]"})
    if steps < 2:
        raise MemplanError(f"steps ({steps}) must be at least 2: the first step and a later one")
    if perf and device == "cpu" and fake:
        raise MemplanError("--perf times real tensors: add --real (or --device cuda)")
    from memplan.hardware import load_gpu

    gpu_spec = load_gpu(job.gpu)
    try:
        from memplan.profile.reference_profile import predicted, profile_reference
    except ImportError as err:  # torch missing
        raise MemplanError(f"profile needs torch: pip install 'memplan[torch]' ({err})") from err
    # every file goes to a staging folder, moved into --out only when all are written: a
    # failure or Ctrl-C leaves --out as it was (memplan.outputs.staged_dir)
    try:
        with (staged_dir(out) if out is not None else nullcontext(None) as stage,
              deferred_interrupts()):  # Ctrl-C taken between torch operators
            result = _run(spec, par, wl, gpu_spec, steps, device, fake, perf, stage,
                          profile_reference, predicted, plot_format)
    except KeyboardInterrupt:
        kept = f"nothing was written to {out}" if out is not None else "nothing was written"
        raise Interrupted(f"{kept}; rerun with: {command_line()}") from None
    if out is not None:  # name the files where they are now
        for key in ("files",):
            result[key] = [str(out / Path(p).name) for p in result.get(key, [])]
        if perf and result["perf"].get("trace"):
            result["perf"]["trace"] = str(out / Path(result["perf"]["trace"]).name)
    if html is not None:
        result["html"] = str(html)
        text = io.StringIO()
        _print(result, _console(text))
        if perf:
            _print_perf(result["perf"], _console(text))
        write_html(html, "profile", result, text.getvalue())
    if json_out:
        typer.echo(dumps("profile", result))
        return
    _print(result)
    if perf:
        _print_perf(result["perf"])
    if html is not None:
        typer.echo(f"wrote {html}")


def _console(file=None):
    """The terminal's console, or one writing plain text to ``file``."""
    from rich.console import Console

    return Console() if file is None else Console(file=file, width=140, color_system=None)


def _run(spec, par, wl, gpu_spec, steps: int, device: str, fake: bool, perf: bool,
         stage: Path | None, profile_reference, predicted, plot_format: str = "png") -> dict:
    """The profile's result, with its files written into ``stage`` (when given)."""
    snapshot = stage / "snapshot.pickle" if stage is not None and device == "cuda" else None
    tl = profile_reference(spec, par, wl, steps=steps, device=device, fake=fake,
                           snapshot_path=snapshot)
    pred = predicted(spec, gpu_spec, par, wl, tensors_only=device != "cuda")
    from memplan.measure.timeline import summary, write

    result = summary(tl, pred)
    result["files"] = []  # none without --out (the JSON schema requires the list)
    if stage is not None:
        written = write(tl, stage, pred)
        from memplan.report.plot_timeline import plot_timeline

        # the estimate's phase peaks over their phases; on CUDA its whole peak too (with the
        # fixed overheads), against the device's used bytes
        png = plot_timeline(tl, stage / f"timeline.{plot_format}", predicted=pred,
                            predicted_peak_bytes=pred["peak_bytes"] if device == "cuda"
                            else None)
        written += [p for p in (png, snapshot) if p is not None]
        result["files"] = [str(p) for p in written]
    if perf:
        result["perf"] = _perf(spec, wl, device, steps, stage, gpu_spec)
        if stage is not None:
            result["files"] += [str(stage / "perf.json")] + (
                [result["perf"]["trace"]] if result["perf"].get("trace") else [])
    return result


def _perf(spec, wl, device: str, steps: int, out: Path | None, gpu_spec) -> dict:
    from memplan.profile.perf import profile_perf
    from memplan.profile.reference_profile import reference_step

    model, opt, step_fn = reference_step(spec, wl, device)
    result = profile_perf(model, opt, step_fn, steps=steps, out_dir=out, gpu=gpu_spec)
    if out is not None:
        # perf.json names the trace by file name: the folder it is written in is a staging
        # folder, renamed into --out when every file is written
        saved = dict(result, trace=Path(result["trace"]).name if result["trace"] else None)
        write_atomic(out / "perf.json", json.dumps(saved, indent=2) + "\n")
    return result


def _print_perf(p: dict, console=None) -> None:
    from rich.table import Table

    console = console or _console()
    table = Table(title=f"top operators by self time ({p['device']}, {p['num_steps']} steps)")
    for col in ("operator", "calls", "self ms", "GFLOP"):
        table.add_column(col, justify="left" if col == "operator" else "right")
    for r in p["top_ops"]:
        table.add_row(r["name"], str(r["calls"]), f"{r['self_us'] / 1000:.2f}",
                      f"{r['flops'] / 1e9:.3f}")
    console.print(table)
    s = p["split_us"]
    console.print("time in profiled steps, ms: " + ", ".join(
        f"{k.replace('_', ' ')} {v / 1000:.2f}" for k, v in s.items()))
    mfu = "" if p["mfu"] is None else f", MFU {100 * p['mfu']:.1f}% ({p['mfu_source']})"
    moved = "" if p.get("achieved_bytes_per_s") is None else \
        f", {p['achieved_bytes_per_s'] / 1e9:.2f} GB/s moved by its ops"
    console.print(f"mean step {p['mean_step_us'] / 1000:.2f} ms, "
                  f"{p['achieved_flops_per_s'] / 1e12:.4f} TFLOP/s achieved{moved}{mfu}")
    verdict = p["bound"] if p["bound"] == "not classified" else f"{p['bound']}-bound"
    console.print(f"{verdict}: {p['why']}")
    if p["trace"]:
        console.print(f"wrote {p['trace']} (open in ui.perfetto.dev)")


def _print(result: dict, console=None) -> None:
    from rich.table import Table

    def fmt(num_bytes: int) -> str:
        return f"{num_bytes:,}"

    console = console or _console()
    table = Table(title=f"{result.get('model', '')}: peak bytes per step and phase "
                  f"({result['device']})")
    for col in ("step", "phase", "peak", "predicted", "largest category"):
        table.add_column(col, justify="left" if col in ("phase", "largest category") else "right")
    pred = {(r["step"], r["phase"]): r["predicted_bytes"]
            for r in result.get("measured_vs_predicted", [])}
    for step, phases in result["phases"].items():
        for phase, peak in phases.items():
            cats = peak["by_category"]
            big = max(cats, key=cats.get) if cats else ""
            want = pred.get((int(step), phase))
            table.add_row(step, phase, fmt(peak["peak_bytes"]),
                          "" if want is None else fmt(want),
                          f"{big} {fmt(cats[big])}" if big else "")
    console.print(table)
    first = result["first_step"]
    console.print(f"first step peak {fmt(first['first_step_peak_bytes'])} bytes, step "
                  f"{first['steady_step']} peak {fmt(first['steady_peak_bytes'])} bytes")
    for cause in first["causes"]:
        console.print(f"  {cause['cause']}: {fmt(cause['bytes'])} bytes ({cause['why']})")
    for warning in first["warnings"]:
        console.print(f"[bold yellow]warning:[/] {warning}")
    console.print(f"measured: {result['source']}")
    if "predicted" in result:
        console.print(f"predicted: {result['predicted']['source']}")
    for path in result.get("files", []):
        console.print(f"wrote {path}")
