"""The terms a device profile fits, computed from an analytic estimate.

For one pipeline stage, step kind (first step or steady state) and phase, the measured tensor
peak is modelled as the analytic phase peak plus a linear correction::

    measured = analytic + fixed_bytes
               + c[saved_<policy>] * saved activations other than attention scores
               + c[eager_scores]   * saved attention scores and score-sized masks (s^2)
               + c[sharding_buffers] * ZeRO / FSDP gather and reduce buffers (their analytic
                                       peak; real collectives keep buffers a fake group frees)
               + c[optimizer_temp] * optimizer-step temporaries      (optimizer phase only)

with one set of coefficients per phase (named ``<phase>.<term>``). The saved-activation terms
enter the forward and backward phases (they are alive at both peaks), the optimizer phase has
only its fixed bytes and temporaries; ``<policy>`` is the step's recompute policy, so each policy
gets its own coefficient.
One coefficient per policy rather than per saved tensor: inside one model every saved tensor of
a policy grows with b*s alike, so per-tensor coefficients could not be told apart by any grid.
"""

from __future__ import annotations

from memplan.hardware import DEFAULT_GPU, GpuSpec, load_gpu
from memplan.model.estimate import PHASES, Estimate, StageMemory, estimate
from memplan.overheads import no_overheads
from memplan.parallel import ParallelConfig
from memplan.spec import ModelSpec
from memplan.workload import Recompute, Workload

STEP_KINDS = ("first_step", "steady")
_ACTIVATION_TERMS = ("fixed_bytes", "saved_none", "saved_selective", "saved_full",
                     "eager_scores", "sharding_buffers")
# every phase has its own coefficients: what the device adds differs by phase (backward's
# collectives and temporaries, the optimizer's foreach buffers)
FEATURES = (*(f"forward.{t}" for t in _ACTIVATION_TERMS),
            *(f"backward.{t}" for t in _ACTIVATION_TERMS),
            "optimizer.fixed_bytes", "optimizer.optimizer_temp")


def is_score_term(name: str) -> bool:
    """Saved tensors of b*heads*s*s elements (or s*s): the eager attention's s-squared part."""
    return name.startswith("attn.") and any(k in name for k in ("softmax", "score", "causal_mask"))


def analytic(spec: ModelSpec, par: ParallelConfig, wl: Workload,
             gpu: GpuSpec | None = None) -> Estimate:
    """Tensor bytes only (no fixed overheads), as the exact tracker counts them."""
    return estimate(spec, gpu or load_gpu(DEFAULT_GPU), par, wl, overheads=no_overheads())


def score_bytes(stage: StageMemory) -> int:
    per_mb = sum(t.size_bytes for t in stage.activation_terms if is_score_term(t.name))
    return per_mb * stage.microbatches_in_flight


def stage_features(stage: StageMemory, wl: Workload) -> dict[str, dict[str, float]]:
    """phase -> feature -> value (bytes) for one stage; features absent are 0."""
    scores = score_bytes(stage)
    policy = "saved_" + (Recompute.FULL if wl.recompute_layers else wl.recompute).label
    saved = {"fixed_bytes": 1.0, policy: float(stage.activations_bytes - scores),
             "eager_scores": float(scores),
             "sharding_buffers": float(stage.sharding_buffers_bytes)}
    optimizer = {"fixed_bytes": 1.0, "optimizer_temp": float(stage.optimizer_temp_bytes)}
    return {phase: {f"{phase}.{k}": v for k, v in feats.items()}
            for phase, feats in (("forward", saved), ("backward", saved),
                                 ("optimizer", optimizer))}


def analytic_phases(stage: StageMemory) -> dict[tuple[str, str], int]:
    """(step kind, phase) -> the analytic tensor peak of that phase."""
    return {(kind, phase): getattr(getattr(stage, kind), phase)
            for kind in STEP_KINDS for phase in PHASES}


def correction(coefficients: dict[str, float], feats: dict[str, float]) -> float:
    return sum(coefficients.get(name, 0.0) * value for name, value in feats.items())


# --- model profiles: residual polynomials in micro-batch b and sequence s ---------------------

MONOMIALS = ("1", "b", "s", "b*s", "s^2", "b*s^2")
PHASE_TARGETS = tuple(f"{k}.{p}" for k in STEP_KINDS for p in PHASES)
MODEL_TARGETS = ("saved", "layer", *PHASE_TARGETS)
# targets that grow by one block's residual per extra layer (the optimizer phase holds none)
DEPTH_SCALED = ("saved", *(t for t in PHASE_TARGETS if not t.endswith("optimizer")))


def monomials(b: int, s: int) -> list[float]:
    return [1.0, float(b), float(s), float(b * s), float(s * s), float(b * s * s)]


def evaluate(coef: list[float], b: int, s: int) -> float:
    return sum(c * m for c, m in zip(coef, monomials(b, s)))


def analytic_layer_bytes(spec: ModelSpec, wl: Workload, layout: ParallelConfig) -> int:
    """Saved bytes of one dense block of the analytic reference (``memplan.model.layer``)."""
    from memplan.model.dims import Dims
    from memplan.model.memo import layer_kind

    policy = Recompute.FULL if wl.recompute_layers else wl.recompute
    return layer_kind(spec, wl, Dims.of(spec, layout, wl), False, policy).saved_bytes


def analytic_targets(spec: ModelSpec, wl: Workload, layout: ParallelConfig) -> dict[str, int]:
    """The model-profile targets (``MODEL_TARGETS``) of the analytic reference."""
    stage = analytic(spec, layout, wl).stages[0]
    phases = analytic_phases(stage)
    return {"saved": stage.activations_bytes, "layer": analytic_layer_bytes(spec, wl, layout),
            **{f"{k}.{p}": v for (k, p), v in phases.items()}}


def regime_of(b: int) -> str:
    return "b=1" if b == 1 else "b>=2"


def model_deltas(regimes: dict, b: int, s: int, traced: dict[str, int] | None,
                 extra_layers: int = 0) -> dict[str, float]:
    """Implementation minus analytic reference per target at (b, s) (a ``RegimeFit`` per
    regime). ``traced``: the analytic targets at the traced depth, to which the envelopes are
    compared; ``extra_layers`` blocks beyond the traced depth add their block residual."""
    fit = regimes.get(regime_of(b)) or next(iter(regimes.values()))
    layer = evaluate(fit.residuals["layer"], b, s)
    out = {}
    for t in MODEL_TARGETS:
        if t in fit.envelopes and traced is not None:
            delta = max(evaluate(c, b, s) for c in fit.envelopes[t]) - traced[t]
        else:
            delta = evaluate(fit.residuals[t], b, s)
        out[t] = delta + (extra_layers * layer if t in DEPTH_SCALED else 0.0)
    return out
