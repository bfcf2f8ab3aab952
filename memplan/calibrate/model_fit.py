"""A user model's records -> a model profile: how its implementation differs from the analytic
reference, per target, as a polynomial in micro-batch b and sequence s.

Targets, each measured by the exact tracker under fake tensors and each compared with the
analytic estimate for the same spec and workload:

- ``saved``: saved activations of the whole model (born in forward, alive when backward starts);
- ``layer``: those born inside one transformer block (``ModelTerms.layer_index``);
- ``first_step.<phase>`` and ``steady.<phase>``: the phase peaks of the first and a later step.

A transformer's tensors are products of b, s and fixed widths: b*s (the residual stream, MLP,
logits), b*s^2 (eager attention's scores, a 4-D mask), s and s^2 (position ids, a causal mask),
b (a per-sequence tensor, e.g. a label shift's missing last token) and constants. The residual
(measured minus analytic) of every target is fitted on exactly these six monomials by least
squares, weighted by 1 / measured (relative error). With the analytic reference and the
implementation both polynomials in them, the fit is exact up to rounding, which the held-out
points check.

Depth: the profile is measured at the traced model's depth; an estimate for a deeper or
shallower copy of the same spec adds (L - L_traced) * the block residual to the saved
activations and to the forward and backward peaks (one more block saves one more block's worth).
"""

from __future__ import annotations

import numpy as np
import scipy.linalg

from memplan.activations import Dims
from memplan.calibrate.features import (
    MODEL_TARGETS,
    MONOMIALS,
    PHASE_TARGETS,
    STEP_KINDS,
    analytic,
    analytic_phases,
    evaluate,
    monomials,
)
from memplan.calibrate.fit import sig
from memplan.calibrate.profile import ErrorFigure, ModelTerms, PointFit
from memplan.calibrate.records import PHASES, Record
from memplan.errors import MemplanError
from memplan.layers import layer_kind
from memplan.spec import ModelSpec
from memplan.workload import Recompute, Workload

def analytic_layer_bytes(spec: ModelSpec, wl: Workload, layout) -> int:
    """Saved bytes of one dense block of the analytic reference (``memplan.activations``)."""
    policy = Recompute.FULL if wl.recompute_layers else wl.recompute
    return layer_kind(spec, wl, Dims.of(layout, wl), False, policy).saved_bytes


def analytic_targets(spec: ModelSpec, wl: Workload, layout) -> dict[str, int]:
    stage = analytic(spec, layout, wl).stages[0]
    phases = analytic_phases(stage)
    return {"saved": stage.activations_bytes, "layer": analytic_layer_bytes(spec, wl, layout),
            **{f"{k}.{p}": v for (k, p), v in phases.items()}}


def measured_targets(rec: Record, layer_index: int) -> dict[str, int]:
    steps = rec.ranks[0].steps
    steady = steps[-1]
    if steady.saved_activations_bytes is None or not steady.layer_saved_bytes:
        raise MemplanError(f"model record {rec.key} lacks the traced saved activations")
    out = {"saved": steady.saved_activations_bytes,
           "layer": steady.layer_saved_bytes[layer_index]}
    for kind, step in zip(STEP_KINDS, (steps[0], steady)):
        for phase in PHASES:
            out[f"{kind}.{phase}"] = step.phases[phase].allocated_bytes
    return out


def layer_index_for(num_blocks: int) -> int:
    """A block in the middle: its input comes from a block and its output goes to one."""
    return num_blocks // 2


def _solve(bs: list[tuple[int, int]], residual: list[float], measured: list[float]) -> list[float]:
    x = np.array([monomials(b, s) for b, s in bs], dtype=np.float64)
    w = 1.0 / np.maximum(np.abs(np.array(measured, dtype=np.float64)), 1.0)
    a = x * w[:, None]
    scale = np.abs(a).max(axis=0)
    beta = scipy.linalg.lstsq(a / scale, np.array(residual) * w, lapack_driver="gelsd")[0]
    return [float(v) for v in beta / scale]


def _check_design(bs: list[tuple[int, int]]) -> None:
    x = np.array([monomials(b, s) for b, s in bs])
    rank = np.linalg.matrix_rank(x / np.abs(x).max(axis=0))
    if rank < len(MONOMIALS):
        raise MemplanError(f"user-model fit needs (mbs, seq) points spanning {len(MONOMIALS)} "
                           f"terms ({', '.join(MONOMIALS)}); the {len(bs)} points span {rank}: "
                           "use at least 2 micro-batch sizes and 3 sequence lengths")


def _fit(points: list[tuple[tuple[int, int], dict[str, int], dict[str, int]]]
         ) -> dict[str, list[float]]:
    bs = [p[0] for p in points]
    return {t: _solve(bs, [m[t] - a[t] for _, m, a in points], [m[t] for _, m, a in points])
            for t in MODEL_TARGETS}


def fit_model(records: list[Record]) -> tuple[ModelTerms, list[ErrorFigure], list[PointFit]]:
    ok = [r for r in records if r.ok and r.kind == "model"]
    if not ok:
        raise MemplanError("no finished user-model records to fit")
    first = ok[0]
    blocks = len(first.ranks[0].steps[-1].layer_saved_bytes or [])
    layer = layer_index_for(blocks)
    data = [((r.workload.micro_batch_size, r.workload.seq_len), measured_targets(r, layer),
             analytic_targets(r.spec, r.workload, r.layout), r) for r in ok]
    fit_set = [d[:3] for d in data if d[3].role == "fit"]
    _check_design([d[0] for d in fit_set])
    coef = _fit(fit_set)
    errors, table = _errors(data, fit_set, coef)
    terms = ModelTerms(
        module=first.module or "", monomials=list(MONOMIALS),
        residuals={t: [sig(c, 12) for c in v] for t, v in coef.items()},
        spec=first.spec, workload=first.workload,
        traced_layers=blocks, layer_index=layer, num_params=first.num_params or 0,
        analytic_num_params=first.spec.num_params)
    return terms, errors, table


def _pct(pred: float, meas: float) -> float:
    return 100.0 * (pred - meas) / meas if meas else 0.0


def _figure(quantity: str, method: str, pcts: list[float]) -> ErrorFigure | None:
    if not pcts:
        return None
    arr = np.abs(np.array(pcts))
    return ErrorFigure(quantity=quantity, method=method, num_points=len(pcts),
                       max_abs_pct=sig(float(arr.max()), 4),
                       rms_pct=sig(float(np.sqrt(np.mean(arr ** 2))), 4))


def _errors(data, fit_set, coef) -> tuple[list[ErrorFigure], list[PointFit]]:
    figures: list[ErrorFigure | None] = []
    held = [d for d in data if d[3].role == "holdout"]
    loo: dict[tuple[int, int], dict[str, list[float]]] = {}
    if len(fit_set) > len(MONOMIALS):
        for i, (bs, _, _) in enumerate(fit_set):
            loo[bs] = _fit(fit_set[:i] + fit_set[i + 1:])
    for t in ("saved", "steady.backward", "first_step.forward", "steady.forward"):
        pred = lambda d, c: d[2][t] + evaluate(c[t], *d[0])  # noqa: E731
        figures.append(_figure(t, "analytic", [_pct(d[2][t], d[1][t]) for d in data]))
        figures.append(_figure(t, "held-out", [_pct(pred(d, coef), d[1][t]) for d in held]))
        figures.append(_figure(t, "leave-one-out", [_pct(pred(d, loo[d[0]]), d[1][t])
                                                    for d in fit_set if d[0] in loo]))
    table = []
    for bs, meas, ana, rec in data:
        peak_t = max(PHASE_TARGETS, key=lambda t: meas[t])
        table.append(PointFit(
            key=rec.key, role=rec.role, measured_bytes=meas[peak_t],
            analytic_bytes=max(ana[t] for t in PHASE_TARGETS),
            fitted_bytes=round(max(ana[t] + evaluate(coef[t], *bs) for t in PHASE_TARGETS)),
            loo_bytes=(round(max(ana[t] + evaluate(loo[bs][t], *bs) for t in PHASE_TARGETS))
                       if bs in loo and rec.role == "fit" else None)))
    return [f for f in figures if f is not None], table
