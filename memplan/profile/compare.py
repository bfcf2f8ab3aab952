"""Measured (traced) next to estimated bytes, per component and phase.

``compare(spec, par, wl)`` traces the reference model (one process, or rank 0 of a parallel
layout through the fake process group) and runs ``memplan.model.estimate.estimate`` with no fixed
overheads, since the tracker counts tensors only. Step 1 is compared with the estimate's
first-step phases, the last traced step with its steady state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memplan.errors import MemplanError
from memplan.hardware import DEFAULT_GPU, load_gpu
from memplan.model.estimate import PHASES, Estimate, StageMemory, estimate
from memplan.overheads import no_overheads
from memplan.parallel import GradBuffers, ParallelConfig, TpStyle
from memplan.profile.trace import TraceResult, trace
from memplan.spec import ModelSpec
from memplan.workload import Workload


@dataclass(frozen=True)
class Row:
    name: str
    measured_bytes: int
    estimated_bytes: int

    @property
    def diff_bytes(self) -> int:
        return self.estimated_bytes - self.measured_bytes

    @property
    def diff_pct(self) -> float:
        return 100.0 * self.diff_bytes / self.measured_bytes if self.measured_bytes else 0.0


@dataclass(frozen=True)
class Comparison:
    spec: ModelSpec
    parallel: ParallelConfig
    workload: Workload
    rows: tuple[Row, ...]
    trace: TraceResult
    estimate: Estimate

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    @property
    def worst_pct(self) -> float:
        return max(abs(r.diff_pct) for r in self.rows)


def run_trace(spec: ModelSpec, par: ParallelConfig, wl: Workload, *, steps: int = 2,
              fake: bool = True) -> TraceResult:
    """One process for a single-rank layout, else rank 0 of the layout via the fake group.
    The reference model has no LoRA adapters (it would measure every weight's gradient and
    optimizer states): LoRA is traced on peft's own model (``memplan.profile.finetune``)."""
    if wl.lora_rank:
        raise MemplanError("the reference model has no LoRA adapters; trace LoRA with peft's "
                           "model (memplan.profile.finetune, the \"peft\" library)")
    if par.world_size == 1:
        return trace(spec, par, wl, steps=steps, fake=fake)
    from memplan.profile.distributed import trace_parallel

    return trace_parallel(spec, par, wl, steps=steps, fake=fake)


def traced_layout(par: ParallelConfig) -> ParallelConfig:
    """The layout the parallel trace actually runs: DDP with its default gradient buckets
    (copies); a TP plan that keeps the embedding and head replicated and, with sequence
    parallelism, DTensor saving full-sequence linear inputs."""
    if par.data_parallel_buffers:  # the trace runs DDP with its defaults
        par = par.model_copy(update={"grad_buffers": GradBuffers.COPY})
    if par.tp == 1:
        return par
    return par.model_copy(update={"vocab_parallel": False, "tp_style": TpStyle.DTENSOR})


def compare(spec: ModelSpec, par: ParallelConfig, wl: Workload, *, steps: int = 2,
            fake: bool = True, trace: Callable[..., TraceResult] | None = None) -> Comparison:
    """The reference model's trace of ``spec`` on rank 0 of ``par`` next to memplan's estimate.
    ``trace`` stands in for ``run_trace`` (the same arguments: a kept trace,
    tests/traced/recorded.py)."""
    par = traced_layout(par)
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (first step and steady state), got {steps}")
    result = (trace or run_trace)(spec, par, wl, steps=steps, fake=fake)
    est = estimate(spec, load_gpu(DEFAULT_GPU), par, wl, overheads=no_overheads())
    return Comparison(spec, par, wl, rows(result, est.stages[0]), result, est)


def rows(trace: TraceResult, stage: StageMemory) -> tuple[Row, ...]:
    """A trace's rows next to ``stage``'s estimate (rank 0 holds pipeline stage 0): the states,
    the saved activations and every phase of the first step and of the steady state."""
    out = [
        Row("params_bytes", trace.params_bytes, stage.params_bytes),
        Row("grads_bytes", trace.steady.grads_bytes, stage.grads_bytes),
        Row("optimizer_bytes", trace.steady.optimizer_bytes, stage.optimizer_bytes),
        Row("activations_bytes", trace.steady.saved_activations_bytes, stage.activations_bytes),
    ]
    for label, measured, phases in (("first_step", trace.first, stage.first_step),
                                    ("steady", trace.steady, stage.steady)):
        for phase in PHASES:
            out.append(Row(f"{label}.{phase}_bytes", measured.phases[phase].total_bytes,
                           getattr(phases, phase)))
    return tuple(out)


def comparison_json(c: Comparison) -> dict[str, Any]:
    """``measured`` and ``estimated`` with the same byte fields, and the differences."""
    def side(attr: str) -> dict[str, Any]:
        flat = {r.name: getattr(r, attr) for r in c.rows}
        return {
            **{k: v for k, v in flat.items() if "." not in k},
            "phases": {step: {k.split(".", 1)[1]: v for k, v in flat.items()
                              if k.startswith(step + ".")}
                       for step in ("first_step", "steady")},
        }

    return {
        "model": c.spec.name,
        "layout": c.parallel.model_dump(mode="json"),
        "workload": c.workload.model_dump(mode="json"),
        "measured": side("measured_bytes"),
        "estimated": side("estimated_bytes"),
        "diff": {r.name: {"bytes": r.diff_bytes, "pct": round(r.diff_pct, 4)} for r in c.rows},
    }
