"""Why the estimate's large or surprising terms are what they are, and what would change them.

Each explanation is one short line: the term, why it is there, and the one setting that would
change it with the figure that setting gives, re-estimated through the same cached function
``memplan.estimate`` calls (``memplan.model.estimate.cached_estimate``: a repeated input
costs nothing). Shown only when the term matters: a term of at least ``LARGE`` of the peak,
an MFU below ``GAP`` of the assumed one, a pipeline whose stages differ.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from memplan.model.estimate import Estimate, StageMemory, cached_estimate
from memplan.planning.timing import DEFAULT_MFU, estimate_step_time
from memplan.report.sizes import format_gib
from memplan.workload import OptimizerImpl, Recompute, Workload

LARGE = 0.10  # a term of at least this share of the peak is worth a line
GAP = 0.9  # a modelled MFU below this share of the assumed one is a real gap
COMM_NAMES = {"tp": "tensor-parallel", "dp": "data-parallel gradient", "pp": "pipeline send",
              "cp": "context-parallel", "ep": "expert all-to-all",
              "host_grads": "gradient copies to host", "host_step": "host optimizer step",
              "host_params": "weight copies from host"}


class Explanation(NamedTuple):
    term: str
    why: str
    change: str | None = None
    peak_bytes_after: int | None = None

    def line(self) -> str:
        return self.why + (f"; {self.change}" if self.change else "")

    def json(self) -> dict[str, Any]:
        return self._asdict()


def again(est: Estimate, **workload: Any) -> Estimate | None:
    """``est`` re-estimated with the given workload fields changed; None when that setting is
    not valid for it (the estimate refuses it) or when a calibration was applied (the
    re-estimate would be analytic, not comparable)."""
    if est.calibration is not None:
        return None
    try:
        wl = Workload.model_validate({**est.workload.model_dump(), **workload})
        return cached_estimate(est.spec, est.gpu, est.parallel, wl,
                               capacity_bytes=est.capacity_bytes, overheads=est.overheads,
                               schedule=est.schedule)
    except ValueError:  # a MemplanError or a Workload's ValidationError
        return None


def optimizer_temporaries(est: Estimate) -> Explanation | None:
    """A foreach / for-loop step's temporaries and the peak with the fused kernel."""
    w, wl = est.worst, est.workload
    if wl.optimizer_impl is OptimizerImpl.FUSED or w.optimizer_temp_bytes < LARGE * est.peak_bytes:
        return None
    why = (f"{wl.optimizer_impl.value} {wl.optimizer.value} makes "
           f"{format_gib(w.optimizer_temp_bytes)} of temporaries at the step")
    fused = again(est, optimizer_impl=OptimizerImpl.FUSED)
    if fused is None:
        return Explanation("optimizer_temp_bytes", why)
    if fused.peak_bytes >= est.peak_bytes:  # the step is not the peak: not worth a line
        return None
    return Explanation("optimizer_temp_bytes", why,
                       f"--optimizer-impl fused: peak {format_gib(fused.peak_bytes)}",
                       fused.peak_bytes)


def mfu_gap(est: Estimate) -> Explanation | None:
    """The modelled MFU against the assumed (or measured) one, and which time costs it."""
    t = estimate_step_time(est)
    assumed = (est.calibration.mfu if est.calibration is not None else None) or DEFAULT_MFU
    if t.mfu >= GAP * assumed:
        return None
    costs = []
    if t.exposed_comm_s > 0:
        kind = max(t.comm_s, key=lambda k: t.comm_s[k])
        costs.append(f"exposed comm {t.exposed_comm_s:.3g} s (largest: "
                     f"{COMM_NAMES.get(kind, kind)}, {t.comm_s[kind]:.3g} s before overlap)")
    if t.bubble_s > 0:
        costs.append(f"bubble {t.bubble_s:.3g} s")
    if t.hardware_flops > t.model_flops * 1.05:
        costs.append(f"recompute +{t.hardware_flops / t.model_flops - 1:.0%} FLOPs")
    why = (f"MFU {t.mfu:.2f}, not {assumed:.2f}: step {t.step_s:.3g} s = compute "
           f"{t.compute_s:.3g} s" + "".join(f" + {c}" for c in costs))
    gbs = 2 * est.global_batch_size
    more = again(est, global_batch_size=gbs)
    if more is None or not (t.exposed_comm_s or t.bubble_s):
        return Explanation("mfu", why)
    return Explanation("mfu", why, f"--gbs {gbs}: MFU {estimate_step_time(more).mfu:.2f}",
                       more.peak_bytes)


def _parts(s: StageMemory) -> dict[str, int]:
    return {"activations in flight": s.activations_bytes,
            "weights, gradients and optimizer states": s.params_bytes + s.grads_bytes
            + s.optimizer_bytes + s.optimizer_temp_bytes + s.sharding_buffers_bytes,
            "loss logits": s.loss_bytes}


def busiest_stage(est: Estimate) -> Explanation | None:
    """Which pipeline stage is the most loaded, against the least loaded, and by what."""
    if len(est.stages) < 2:
        return None
    w = est.worst
    low = min(est.stages, key=lambda s: s.peak_bytes)
    if w.peak_bytes - low.peak_bytes < 0.01 * w.peak_bytes:
        return None
    mine, theirs = _parts(w), _parts(low)
    more = sorted(((mine[k] - theirs[k], k) for k in mine if mine[k] > theirs[k]), reverse=True)
    because = ", ".join(f"{k} +{format_gib(d)}" for d, k in more)
    edge = (" (embedding)" if w.stage == 0 else
            " (output head)" if w.stage == len(est.stages) - 1 else "")
    why = (f"stage {w.stage}{edge} is the most loaded, {format_gib(w.peak_bytes - low.peak_bytes)}"
           f" above stage {low.stage}: {because}; micro-batches in flight "
           f"{w.microbatches_in_flight} against {low.microbatches_in_flight}")
    if est.workload.recompute is Recompute.FULL or not more or \
            more[0][1] != "activations in flight":
        return Explanation("most_loaded_stage", why)
    full = again(est, recompute=Recompute.FULL, recompute_layers=None, recompute_every=None)
    if full is None:
        return Explanation("most_loaded_stage", why)
    return Explanation("most_loaded_stage", why,
                       f"--recompute full: peak {format_gib(full.peak_bytes)}", full.peak_bytes)


def explanations(est: Estimate) -> list[Explanation]:
    """The lines that apply to ``est``, in the order the output shows its terms."""
    found = (busiest_stage(est), optimizer_temporaries(est), mfu_gap(est))
    return [e for e in found if e is not None]
