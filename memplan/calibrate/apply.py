"""Apply calibration profiles to an estimate (and to a plan's candidates).

The analytic lines stay as they are; a profile adds its correction of the tensor peak as its own
line (``StageMemory.calibration_bytes``), its calibrated phase peaks replace the analytic ones
(``StageMemory.steady`` / ``first_step``, the analytic ones kept beside them as
``StageMemory.analytic_phases``) and, when it measured them on the estimate's GPU,
replaces the fixed-overhead defaults: the memory outside the caching allocator (CUDA context,
kernels, NCCL) and the allocator's reserve (max reserved = ratio * max allocated + rounding).
At most one device profile and one model profile apply together; their tensor corrections add.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from memplan.calibrate.calibration_profile import Profile, find_profile, load_profile
from memplan.calibrate.features import (
    FEATURES,
    STEP_KINDS,
    analytic_phases,
    model_deltas,
    stage_features,
)
from memplan.errors import MemplanError
from memplan.hardware import GpuSpec
from memplan.model.estimate import PHASES, Estimate, PhasePeaks, StageMemory
from memplan.overheads import Overheads
from memplan.planning.batch_sizes import micro_batch_sizes
from memplan.spec import ModelSpec

# Spec fields a model profile may differ in from the estimate's spec (the traced model may be
# a shallower copy; names and sources are labels).
_SPEC_FREE = {"name", "source", "num_layers", "max_seq_len"}
_WORKLOAD_FIXED = ("framework", "precision", "optimizer", "optimizer_impl", "recompute",
                   "recompute_layers", "attention", "norm_impl", "logits_fp32", "logits_held",
                   "keep_grads", "loss_chunks", "loss_chunk_backward")


@dataclass(frozen=True)
class Loaded:
    path: str
    profile: Profile


@dataclass(frozen=True)
class StageCalibration:
    """One stage's calibrated figures (bytes) and the correction by term at its peak."""

    stage: int
    tensor_peak_bytes: int
    activations_bytes: int
    phases: dict[str, dict[str, int]]
    terms: dict[str, int]


@dataclass(frozen=True)
class Calibration:
    """What was applied, for the report: profiles, per-stage figures, notes."""

    profiles: tuple[str, ...]
    stages: tuple[StageCalibration, ...]
    notes: tuple[str, ...]
    mfu: float | None = None

    def amend(self, base: tuple[str, ...]) -> tuple[str, ...]:
        nccl_measured = any("NCCL" in n for n in self.notes)
        kept = tuple(a for a in base if not (nccl_measured and a.startswith("NCCL")))
        return kept + self.notes

    def stage(self, index: int) -> StageCalibration:
        return self.stages[index]

    def json(self, worst: int) -> dict[str, Any]:
        s = self.stages[worst]
        return {"profiles": list(self.profiles), "tensor_peak_bytes": s.tensor_peak_bytes,
                "activations_bytes": s.activations_bytes, "phases": s.phases,
                "terms_bytes": s.terms, "mfu": self.mfu, "notes": list(self.notes)}


def resolve(values: list[str] | None, gpu: GpuSpec) -> list[Loaded]:
    """``--calibration`` values: a profile file, a folder to search for ``gpu``'s device
    profile, or ``auto`` for the committed one."""
    out = []
    for value in values or []:
        if value == "auto":
            path = find_profile(gpu.name)
        elif Path(value).is_dir():
            path = find_profile(gpu.name, Path(value))
        else:
            path = Path(value)
        out.append(Loaded(str(path), load_profile(path)))
    kinds = [x.profile.kind for x in out]
    for kind in ("device", "model"):
        if kinds.count(kind) > 1:
            raise MemplanError(f"calibration: at most one {kind} profile applies, got "
                               f"{kinds.count(kind)}")
    return out


def calibrate(est: Estimate, loaded: list[Loaded]) -> Estimate:
    """``est`` with the profiles' corrections and measured overheads applied."""
    if not loaded:
        return est
    device = next((x for x in loaded if x.profile.kind == "device"), None)
    model = next((x for x in loaded if x.profile.kind == "model"), None)
    notes: list[str] = []
    if model is not None:
        _check_model(model, est)
        notes.append(_model_note(model, est.spec))
    ovh = est.overheads
    if device is not None:
        _check_device(device, est.gpu)
        ovh, dev_notes = _overheads(device, est.overheads)
        notes += dev_notes
    stages, cals = [], []
    for st in est.stages:
        new, cal = _stage(st, est, device, model, ovh)
        stages.append(new)
        cals.append(cal)
    mfu = device.profile.device.mfu if device and device.profile.device else None
    info = Calibration(tuple(x.path for x in loaded), tuple(cals), tuple(notes), mfu)
    return est._replace(stages=tuple(stages), overheads=ovh, calibration=info)


def _stage(st: StageMemory, est: Estimate, device: Loaded | None, model: Loaded | None,
           ovh: Overheads) -> tuple[StageMemory, StageCalibration]:
    phases = analytic_phases(st)
    delta = dict.fromkeys(phases, 0.0)
    terms: dict[str, dict[tuple[str, str], float]] = {}
    activations = st.activations_bytes
    if model is not None:
        m = _model_deltas(model.profile, est)
        terms["model"] = {k: m[f"{k[0]}.{k[1]}"] for k in phases}
        activations += round(m["saved"])
    if device is not None and device.profile.device is not None:
        feats = stage_features(st, est.workload)
        for name, coef in device.profile.device.coefficients.items():
            terms[name] = {k: coef * feats[k[1]].get(name, 0.0) for k in phases}
    for per_key in terms.values():
        for k, v in per_key.items():
            delta[k] += v
    corrected = {k: phases[k] + round(delta[k]) for k in phases}
    at = max(corrected, key=lambda k: corrected[k])
    tensor = max(corrected[at], st.load_bytes)  # the model's load is not corrected
    alloc = _allocator(device, ovh, tensor)
    def calibrated(kind: str) -> PhasePeaks:
        return PhasePeaks(**{p: corrected[(kind, p)] for p in PHASES})

    new = st._replace(calibration_bytes=tensor - st.tensor_peak_bytes,
                  steady=calibrated("steady"), first_step=calibrated("first_step"),
                  analytic_phases=(st.steady, st.first_step),
                  cuda_context_bytes=ovh.cuda_context_bytes, workspace_bytes=ovh.workspace_bytes,
                  allocator_bytes=alloc, peak_bytes=tensor + ovh.fixed_bytes + alloc)
    cal = StageCalibration(
        stage=st.stage, tensor_peak_bytes=tensor, activations_bytes=activations,
        phases={kind: {f"{p}_bytes": corrected[(kind, p)] for p in PHASES} for kind in STEP_KINDS},
        terms={name: round(v[at]) for name, v in terms.items() if round(v[at])})
    return new, cal


def _allocator(device: Loaded | None, ovh: Overheads, tensor: int) -> int:
    terms = device.profile.device if device is not None else None
    if terms is None or terms.allocator_residual_bytes is None:
        return ovh.allocator_bytes(tensor)
    # what the allocator model misses, measured; one below 0 (the model reserves more than
    # measured) adds nothing
    return max(0, terms.allocator_residual_bytes)


def _overheads(device: Loaded, default: Overheads) -> tuple[Overheads, list[str]]:
    prof, terms = device.profile, device.profile.device
    assert terms is not None
    where = f"calibration {Path(device.path).name}, {prof.num_records} records"
    notes = [(f"calibration: {device.path} ({prof.meta.device_name}, torch {prof.meta.torch}, "
              f"{prof.meta.date}); tensor corrections fitted on the reference model")]
    if terms.outside_allocator_bytes is None:  # CPU: the exact tracker sees tensors only
        notes.append("calibration measured on cpu with the exact tracker: tensor terms only; "
                     "fixed overheads stay the defaults")
        return default, notes
    nccl = terms.world_size > 1
    what = "CUDA context, kernels and NCCL buffers" if nccl else "CUDA context and kernels"
    context = f"measured: device used minus reserved ({what}; mean over {where})"
    workspace = ("measured: inside the calibrated tensor peak (cuBLAS allocates its workspace "
                 "through the caching allocator" + (f"; probe {terms.probes['cublas']:,} bytes)"
                                                     if "cublas" in terms.probes else ")"))
    allocator = ("caching-allocator model (memplan.model.reserved), and measured beyond it: "
                 f"{terms.allocator_residual_bytes or 0:+,} bytes of max reserved less max "
                 f"allocated the model misses ({where})")
    if nccl and terms.nccl_bytes_per_rank is not None:
        notes.append(f"NCCL buffers: measured {terms.nccl_bytes_per_rank:,} bytes per rank "
                     f"on {terms.world_size} ranks, inside the CUDA context line")
    ovh = Overheads(terms.outside_allocator_bytes, context, 0, workspace,
                    default.allocator_fraction, allocator)
    return ovh, notes


def _check_device(device: Loaded, gpu: GpuSpec) -> None:
    meta = device.profile.meta
    unknown = sorted(set(device.profile.device.coefficients) - set(FEATURES)
                     if device.profile.device else [])
    if unknown:
        raise MemplanError(f"calibration: {device.path} has terms this memplan does not know "
                           f"({', '.join(unknown)}); re-fit it with `memplan calibrate --refit`")
    if meta.device == "cuda" and meta.gpu != gpu.name:
        raise MemplanError(f"calibration: {device.path} was measured on "
                           f"{meta.gpu or meta.device_name}, not {gpu.name}; pass --gpu "
                           f"{meta.gpu} or a profile for {gpu.name}")


def _check_model(model: Loaded, est: Estimate) -> None:
    terms = model.profile.model
    assert terms is not None
    par = est.parallel
    if par.tp != 1 or par.pp != 1 or par.cp != 1:
        raise MemplanError(f"calibration: model profile {model.path} applies to tp=pp=cp=1 "
                           f"layouts (got tp={par.tp} pp={par.pp} cp={par.cp})")
    ours, theirs = terms.spec.model_dump(), est.spec.model_dump()
    for key in ours:
        if key not in _SPEC_FREE and ours[key] != theirs[key]:
            raise MemplanError(f"calibration: model profile {model.path} was fitted for "
                               f"{terms.spec.name} ({key} {ours[key]!r}), not {est.spec.name} "
                               f"({key} {theirs[key]!r})")
    for key in _WORKLOAD_FIXED:
        want, got = getattr(terms.workload, key), getattr(est.workload, key)
        if want != got:
            raise MemplanError(f"calibration: model profile {model.path} was fitted against the "
                               f"reference with {key} {_show(want)}, the estimate uses "
                               f"{_show(got)} (the profile describes the implementation; "
                               f"estimate with {key} {_show(want)})")


def _show(value: Any) -> Any:
    return getattr(value, "label", getattr(value, "value", value))


def _model_deltas(prof: Profile, est: Estimate) -> dict[str, float]:
    """The implementation minus the analytic reference at the estimate's (b, s), per target."""
    terms = prof.model
    assert terms is not None
    b, s = est.workload.micro_batch_size, est.workload.seq_len
    traced = None
    if any(fit.envelopes for fit in terms.regimes.values()):
        # the envelopes are the implementation's own bytes at the traced depth and layout
        from memplan.calibrate.features import analytic_targets
        from memplan.parallel import ParallelConfig

        wl = est.workload.model_copy(update={"global_batch_size": None})
        traced = analytic_targets(terms.spec, wl, ParallelConfig())
    return model_deltas(terms.regimes, b, s, traced, est.spec.num_layers - terms.traced_layers)


def _model_note(model: Loaded, spec: ModelSpec) -> str:
    terms = model.profile.model
    assert terms is not None
    held = model.profile.error("peak", "held-out")
    err = f"; held-out peak error at most {held.max_abs_pct:.3g}%" if held else ""
    params = ("" if terms.num_params == terms.analytic_num_params else
              f"; the implementation has {terms.num_params:,} parameters, the spec "
              f"{terms.analytic_num_params:,}")
    depth = ("" if spec.num_layers == terms.traced_layers else
             f"; traced at {terms.traced_layers} layers, scaled per block to {spec.num_layers}")
    return (f"calibration: {model.path}: activations of {terms.module} (fitted from fake-tensor "
            f"traces at {model.profile.num_records} (mbs, seq) points{err}{depth}{params})")


def calibrate_plan(result: Any, spec: ModelSpec, gpu: GpuSpec, loaded: list[Loaded], *,
                   capacity_bytes: int | None, safety: float) -> Any:
    """A planner result re-checked with the profiles: each candidate keeps the largest
    micro-batch that fits once calibrated (searched from the analytic choice up and down) and is
    re-timed with the measured utilisation; candidates that no longer fit are rejected."""
    if not loaded:
        return result
    from memplan.model.estimate import estimate
    from memplan.parallel import resolve_batch
    from memplan.planning.timing import step_time

    budget = int((capacity_bytes or gpu.memory_bytes) * (1 - safety))
    gbs = result.global_batch_size
    kept = []
    for c in result.candidates:
        par = c.layout
        sizes = list(micro_batch_sizes(par, gbs))  # the sizes the planner searched

        def fitted(mbs: int, par=par, c=c) -> Estimate | None:
            try:
                est = calibrate(estimate(spec, gpu, par, c.estimate.workload.model_copy(
                    update={"micro_batch_size": mbs}), capacity_bytes=capacity_bytes), loaded)
            except MemplanError:
                return None
            return est if est.peak_bytes <= budget else None

        i, best = sizes.index(c.micro_batch_size), None
        if fitted(sizes[i]) is not None:
            for mbs in sizes[i:]:  # grow while it fits
                est = fitted(mbs)
                if est is None:
                    break
                best = est
        else:
            for mbs in reversed(sizes[:i]):  # shrink until it fits
                best = fitted(mbs)
                if best is not None:
                    break
        if best is None:
            result.rejected["out of memory once calibrated"] += 1
            continue
        _, m = resolve_batch(best.parallel, best.workload)
        mfu = best.calibration.mfu if best.calibration and best.calibration.mfu else None
        time = step_time(spec, gpu, best.parallel, best.workload, result.global_batch_size, m,
                         best.worst.num_params,
                         **({"mfu": mfu, "measured": True} if mfu else {}))
        kept.append(_with_estimate(c, best, time))
    kept.sort(key=lambda c: (c.time.step_s, c.peak_bytes))
    result.candidates = kept
    return result


def _with_estimate(c: Any, est: Estimate, time: Any) -> Any:
    """Candidate ``c`` holding ``est`` (its micro-batch) and ``time``."""
    from dataclasses import fields

    names = {f.name for f in fields(c)}
    update: dict[str, Any] = {"micro_batch_size": est.workload.micro_batch_size, "time": time}
    if "given" in names:  # built lazily from its inputs: hand it the calibrated estimate
        update.update(given=est, known_peak_bytes=est.peak_bytes, inputs=None)
    else:
        update["estimate"] = est
    return replace(c, **update)
