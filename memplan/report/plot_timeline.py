"""A plot of a memory timeline: one rank's training steps on a time axis, for a design doc.

``plot_timeline`` puts the samples of a ``memplan.measure.timeline.Timeline`` on a
time axis in seconds. Under the exact CPU tracker the live bytes are stacked by category
(parameters, gradients, optimizer states, activations, temporaries), the optimizer's bytes
split as the model splits them: those made at setup (an fp32 master copy) from setup on, its
states (moments) from step 1's optimizer step on; on CUDA the allocated,
reserved and device-used bytes are lines through the samples (one at each phase's end). Each
phase's measured peak is a black line over the phase (on CUDA the allocator's peak in the
phase, which the sample at its end reads though no sample sees it). Phases are shaded
and labelled per step, the setup before step 1 apart; the estimate's phase peaks are markers
over their phases (step 1's first-step peaks, the steady peaks on later steps).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memplan.measure.timeline import CATEGORIES, Sample, Timeline
from memplan.report.plot import CATEGORY_COLOURS, PHASE_LABELS, PHASE_SHADES, figure
from memplan.report.sizes import axis_unit


def _phase_of(s: Sample) -> str:
    return "setup" if s.step < 1 else s.phase


def phase_spans(tl: Timeline, xs: list[float]) -> list[tuple[float, float, int, str]]:
    """(start, end, step, phase) of each run of samples in one step and phase, on ``xs``.
    Under the CPU tracker a sample is taken at an op of its phase, so a run spans from its
    first sample to the next run's; on CUDA a sample is taken at the end of its phase, so a
    run spans from the sample before it to its last one."""
    spans: list[list[Any]] = []
    for k, (x, s) in enumerate(zip(xs, tl.samples, strict=True)):
        key = (s.step, _phase_of(s))
        start = xs[k - 1] if tl.device == "cuda" and k else x
        if spans and (spans[-1][2], spans[-1][3]) == key:
            spans[-1][1] = x if tl.device == "cuda" else spans[-1][1]
            continue
        if spans and tl.device != "cuda":
            spans[-1][1] = x
        spans.append([start, x, *key])
    if spans and tl.device != "cuda":
        spans[-1][1] = xs[-1]
    return [tuple(sp) for sp in spans]  # type: ignore[misc]


def _xs(tl: Timeline) -> tuple[list[float], str]:
    if tl.samples and all(s.time_s is not None for s in tl.samples):
        what = "under the exact tensor tracker" if tl.device == "cpu-tracker" else "on the GPU"
        return [float(s.time_s) for s in tl.samples], f"time since the first sample (s; {what})"
    return [float(k) for k in range(len(tl.samples))], "sample (no times recorded)"


def plot_timeline(tl: Timeline, path: Path, *, predicted: dict[str, Any] | None = None,
                  predicted_peak_bytes: int | None = None) -> Path:
    """Write ``path`` (PNG or SVG); ``predicted``:
    the estimate's ``{"first_step": {phase: bytes}, "steady": {phase: bytes}}`` (markers);
    ``predicted_peak_bytes``: a line at the estimate's peak."""
    xs, xlabel = _xs(tl)
    with figure(path, figsize=(12, 5)) as fig:
        ax = fig.add_subplot()
        top = max([_high(s) for s in tl.samples] + list(_predicted_values(predicted))
                  + [predicted_peak_bytes or 0])
        unit, label = axis_unit(top)
        if tl.device == "cuda":
            _cuda_lines(ax, tl, xs, unit)
        else:
            _stack(ax, tl, xs, unit)
        spans = phase_spans(tl, xs)
        ax.set_ylim(0, top / unit * 1.18)
        _shade(ax, spans, xs[-1] - xs[0])
        _measured_peaks(ax, tl, spans, unit)
        if predicted:
            _markers(ax, spans, predicted, unit)
        if predicted_peak_bytes is not None:
            ax.axhline(predicted_peak_bytes / unit, color="#c00000", ls="--", lw=1,
                       label="estimate: peak")
        ax.set_xlim(xs[0], xs[-1])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.set_title(_title(tl), fontsize=10)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return path


def _title(tl: Timeline) -> str:
    wl = tl.context.get("workload") or {}
    what = [str(tl.context.get("model", "training step"))]
    if wl:
        batch = f"mbs {wl.get('micro_batch_size')} x seq {wl.get('seq_len')}"
        what += [str(wl.get("precision")), batch, str(wl.get("optimizer"))]
    return (f"{', '.join(what)}: memory over {tl.num_steps} steps, "
            f"{tl.source.split(' (')[0]}")


def _high(s: Sample) -> int:
    return max(s.total_bytes, s.peak_bytes or 0, s.reserved_bytes or 0, s.device_used_bytes or 0)


def _predicted_values(predicted: dict[str, Any] | None) -> Iterator[int]:
    for label in ("first_step", "steady"):
        yield from (predicted or {}).get(label, {}).values()


# The optimizer's bytes as the model splits them (memplan.model.stage, the first step's peaks):
# what exists from optimizer setup (an fp32 master copy, bitsandbytes' quantization maps), then
# the states its first step creates (moments; a GradScaler's state from step 1's loss).
SETUP_LAYER = "master weights (made at setup)"
STATES_LAYER = "optimizer states"
SETUP_COLOUR = "#b5dfbf"


def setup_optimizer_bytes(tl: Timeline) -> int:
    """The optimizer-category bytes alive when step 1 starts (its first sample): what setup
    made with the optimizer, before any step ran; 0 without a sample of step 1."""
    first = next((s for s in tl.samples if s.step == 1), None)
    return first.by_category.get("optimizer", 0) if first is not None else 0


def stack_layers(tl: Timeline) -> dict[str, list[int]]:
    """The bytes stacked under the CPU tracker, bottom up, per sample: each category, the
    optimizer's split in two (``SETUP_LAYER``: up to ``setup_optimizer_bytes``, from setup on;
    ``STATES_LAYER``: the rest, from where they are made, step 1's optimizer step for the
    moments). The layers sum to the samples' categorised bytes."""
    setup = setup_optimizer_bytes(tl)
    layers: dict[str, list[int]] = {}
    for c in CATEGORIES:
        values = [s.by_category.get(c, 0) for s in tl.samples]
        if c != "optimizer":
            layers[c] = values
            continue
        layers[SETUP_LAYER] = [min(v, setup) for v in values]
        layers[STATES_LAYER] = [v - min(v, setup) for v in values]
    return layers


def _stack(ax: Any, tl: Timeline, xs: list[float], unit: int) -> None:
    """Live bytes stacked by category, drawn as steps (each value holds until the next op);
    a layer that is empty throughout (no master copy under bf16-pure) is left out."""
    layers = {k: v for k, v in stack_layers(tl).items() if any(v) or k in CATEGORIES}
    colours = {**CATEGORY_COLOURS, SETUP_LAYER: SETUP_COLOUR,
               STATES_LAYER: CATEGORY_COLOURS["optimizer"]}
    ax.stackplot(xs, [[v / unit for v in values] for values in layers.values()],
                 labels=list(layers), step="post", lw=0,
                 colors=[colours[k] for k in layers], alpha=0.85)
    ax.step(xs, [s.total_bytes / unit for s in tl.samples], where="post", color="black", lw=0.6,
            label="live tensors (total)")


def _cuda_lines(ax: Any, tl: Timeline, xs: list[float], unit: int) -> None:
    """The allocator's counters where they were read (each phase's end), joined by lines."""
    ax.plot(xs, [s.total_bytes / unit for s in tl.samples], color="black", lw=1.2, marker=".",
            ms=4, label="allocated (at each phase's end)")
    ax.plot(xs, [(s.reserved_bytes or 0) / unit for s in tl.samples], lw=1, color="#4c72b0",
            label="reserved")
    ax.plot(xs, [(s.device_used_bytes or 0) / unit for s in tl.samples], lw=1,
            color="#8172b3", label="device used (all processes)")


def _shade(ax: Any, spans: list[tuple[float, float, int, str]], width: float) -> None:
    """Phases as grey bands labelled at the top (when wide enough to read); step boundaries as
    dotted lines with the step's number centred over the step."""
    y = ax.get_ylim()[1]
    steps: dict[int, list[float]] = {}
    for lo, hi, step, phase in spans:
        ax.axvspan(lo, hi, color=PHASE_SHADES.get(phase, "#dddddd"), alpha=0.45, lw=0,
                   zorder=0)
        if hi - lo > 0.03 * width:
            ax.text((lo + hi) / 2, y * 0.955, PHASE_LABELS.get(phase, phase), ha="center",
                    va="top", fontsize=7, color="#333333")
        steps.setdefault(step, [lo, hi])[1] = hi
    for step, (lo, hi) in sorted(steps.items()):
        if step >= 1:
            ax.axvline(lo, color="black", ls=":", lw=0.8)
            ax.text((lo + hi) / 2, y * 0.995, f"step {step}", ha="center", va="top",
                    fontsize=8, fontweight="bold")


def _measured_peaks(ax: Any, tl: Timeline, spans: list[tuple[float, float, int, str]],
                    unit: int) -> None:
    """Each step's measured phase peaks (``memplan.measure.timeline.phase_peaks``: on CUDA the
    allocator's peak in the phase, which no sample sees) as a black line over the phase."""
    from memplan.measure.timeline import phase_peaks

    peaks = phase_peaks(tl)
    first = True
    for lo, hi, step, phase in spans:
        s = peaks.get(step, {}).get(phase)
        if s is None or hi <= lo:
            continue
        ax.hlines(_sample_high(s) / unit, lo, hi, color="black", lw=1.8,
                  label="measured: phase peak" if first else None, zorder=4)
        first = False


def _sample_high(s: Sample) -> int:
    return s.total_bytes if s.peak_bytes is None else max(s.total_bytes, s.peak_bytes)


def _markers(ax: Any, spans: list[tuple[float, float, int, str]],
             predicted: dict[str, Any], unit: int) -> None:
    """Each of the estimate's phase peaks as a short line with a diamond over its phase."""
    first = True
    for lo, hi, step, phase in spans:
        if step < 1:
            continue
        want = predicted.get("first_step" if step == 1 else "steady", {}).get(phase)
        if want is None:
            continue
        ax.hlines(want / unit, lo, hi, color="#c00000", lw=1.2, ls="--", zorder=5)
        ax.plot([(lo + hi) / 2], [want / unit], marker="D", ms=5, color="#c00000",
                label="estimate: phase peak" if first else None, ls="none", zorder=6)
        first = False


__all__ = ["SETUP_LAYER", "STATES_LAYER", "phase_spans", "plot_timeline", "setup_optimizer_bytes",
           "stack_layers"]
