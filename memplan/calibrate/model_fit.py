"""A user model's records -> a model profile: its implementation's bytes as polynomials in
micro-batch b and sequence s, next to the analytic reference.

Targets, each measured by the exact tracker under fake tensors:

- ``saved``: saved activations of the whole model (born in forward, alive when backward starts);
- ``layer``: those born inside one transformer block (``ModelTerms.layer_index``);
- ``first_step.<phase>`` and ``steady.<phase>``: the phase peaks of the first and a later step.

Every tensor of a transformer step is a product of b, s and fixed widths: b*s (the residual
stream, MLP, logits), b*s^2 (eager attention's scores, a 4-D mask), s and s^2 (position ids, a
causal mask), b (a per-sequence tensor, e.g. a label shift's missing token) and constants. So
``saved`` and ``layer`` minus their analytic values are fitted on exactly these six monomials.

A phase peak is the largest of the live totals after each op, and which op holds the peak can
change with (b, s): a single polynomial would be off where it changes. So the live bytes after
every op of the phase are fitted (the same ops run in the same order at every point), and the
profile keeps the ops that are the peak somewhere on a wide (b, s) grid; the predicted peak is
their maximum (the ``envelope``). When the op sequences differ between points, the phase falls
back to a polynomial of its residual.

Micro-batch 1 is a regime of its own (see ``ModelTerms``), fitted apart from b >= 2. Fits are
least squares weighted by 1 / measured (relative error); with exact polynomials they reproduce
the traces to rounding, which leave-one-out and the held-out points check.

Depth: an estimate for a deeper or shallower copy of the spec adds (L - L_traced) * the block
residual to the saved activations and to the forward and backward peaks.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg

from memplan.calibrate.calibration_profile import ErrorFigure, ModelTerms, PointFit, RegimeFit
from memplan.calibrate.features import (
    MODEL_TARGETS,
    MONOMIALS,
    PHASE_TARGETS,
    STEP_KINDS,
    analytic_targets,
    evaluate,
    model_deltas,
    monomials,
    regime_of,
)
from memplan.calibrate.fit import sig
from memplan.calibrate.records import PHASES, Record
from memplan.errors import MemplanError

# rank each regime's fit points must reach: b = 1 leaves {1, s, s^2}
RANK = {"b=1": 3, "b>=2": len(MONOMIALS)}


class Data:
    """One finished record: (b, s), measured and analytic targets, the ops' live bytes."""

    def __init__(self, rec: Record, layer_index: int) -> None:
        steps = rec.ranks[0].steps
        steady = steps[-1]
        if steady.saved_activations_bytes is None or not steady.layer_saved_bytes:
            raise MemplanError(f"model record {rec.key} lacks the traced saved activations")
        self.key, self.role = rec.key, rec.role
        self.bs = (rec.workload.micro_batch_size, rec.workload.seq_len)
        self.measured = {"saved": steady.saved_activations_bytes,
                         "layer": steady.layer_saved_bytes[layer_index]}
        self.ops: dict[str, list[int]] = {}
        for kind, step in zip(STEP_KINDS, (steps[0], steady)):
            for phase in PHASES:
                self.measured[f"{kind}.{phase}"] = step.phases[phase].allocated_bytes
                self.ops[f"{kind}.{phase}"] = (step.op_bytes or {}).get(phase, [])
        self.analytic = analytic_targets(rec.spec, rec.workload, rec.layout)
        self.regime = regime_of(self.bs[0])


def layer_index_for(num_blocks: int) -> int:
    """A block in the middle: its input comes from a block and its output goes to one."""
    return num_blocks // 2


def _lstsq(bs: list[tuple[int, int]], y: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Coefficients (monomials x columns of y), each row of y weighted by ``weight``."""
    x = np.array([monomials(b, s) for b, s in bs], dtype=np.float64) * weight[:, None]
    scale = np.abs(x).max(axis=0)
    beta = scipy.linalg.lstsq(x / scale, y * weight[:, None], lapack_driver="gelsd")[0]
    return beta / scale[:, None]


def _rank(bs: list[tuple[int, int]]) -> int:
    x = np.array([monomials(b, s) for b, s in bs], dtype=np.float64)
    return int(np.linalg.matrix_rank(x / np.abs(x).max(axis=0)))


def _envelope(points: list[Data], target: str, regime: str) -> list[list[float]] | None:
    """Coefficients of the ops that hold the phase's peak somewhere on a wide grid, or None
    when the points did not run the same op sequence."""
    seqs = [p.ops[target] for p in points]
    if not seqs[0] or len({len(q) for q in seqs}) != 1:
        return None
    y = np.array(seqs, dtype=np.float64)
    peaks = y.max(axis=1)
    coef = _lstsq([p.bs for p in points], y, 1.0 / peaks)  # (monomials, ops)
    bmax = max(p.bs[0] for p in points)
    s_lo, s_hi = min(p.bs[1] for p in points), max(p.bs[1] for p in points)
    bs_grid = [1] if regime == "b=1" else list(range(2, max(8, 2 * bmax) + 1))
    s_grid = np.unique(np.geomspace(max(2, s_lo // 4), 4 * s_hi, 48).astype(int))
    grid = np.array([monomials(b, int(s)) for b in bs_grid for s in s_grid])
    keep = set(np.argmax(grid @ coef, axis=1).tolist())
    keep |= {int(np.argmax(row)) for row in y}  # the peak op of every measured point
    return [[sig(float(c), 12) for c in coef[:, j]] for j in sorted(keep)]


def _fit_regime(points: list[Data], regime: str) -> RegimeFit:
    bs = [p.bs for p in points]
    residuals = {}
    for t in MODEL_TARGETS:
        y = np.array([[p.measured[t] - p.analytic[t]] for p in points], dtype=np.float64)
        w = 1.0 / np.maximum(np.array([p.measured[t] for p in points], dtype=np.float64), 1.0)
        residuals[t] = [sig(float(c), 12) for c in _lstsq(bs, y, w)[:, 0]]
    envelopes = {}
    for t in PHASE_TARGETS:
        env = _envelope(points, t, regime)
        if env is not None:
            envelopes[t] = env
    return RegimeFit(points=sorted(bs), residuals=residuals, envelopes=envelopes)


def _fit(points: list[Data]) -> dict[str, RegimeFit]:
    out = {}
    for regime, need in RANK.items():
        mine = [p for p in points if p.regime == regime]
        if mine and _rank([p.bs for p in mine]) >= need:
            out[regime] = _fit_regime(mine, regime)
    return out


def _check_design(points: list[Data]) -> None:
    for regime, need in RANK.items():
        mine = [p.bs for p in points if p.regime == regime]
        if mine and _rank(mine) < need:
            raise MemplanError(
                f"user-model fit: the {len(mine)} fit points with {regime} span {_rank(mine)} "
                f"of the {need} terms needed; use at least 3 sequence lengths"
                + (" and 2 micro-batch sizes above 1" if regime == "b>=2" else ""))
    if not points:
        raise MemplanError("user-model fit: no fit points")


def predict(regimes: dict[str, RegimeFit], p: Data) -> dict[str, float]:
    deltas = model_deltas(regimes, *p.bs, p.analytic)
    return {t: p.analytic[t] + deltas[t] for t in MODEL_TARGETS}


def fit_model(records: list[Record]) -> tuple[ModelTerms, list[ErrorFigure], list[PointFit]]:
    ok = [r for r in records if r.ok and r.kind == "model"]
    if not ok:
        raise MemplanError("no finished user-model records to fit")
    first = ok[0]
    layer = layer_index_for(len(first.ranks[0].steps[-1].layer_saved_bytes or []))
    data = [Data(r, layer) for r in ok]
    fit_set = [d for d in data if d.role == "fit"]
    _check_design(fit_set)
    regimes = _fit(fit_set)
    errors, table = _errors(data, fit_set, regimes)
    terms = ModelTerms(module=first.module or "", monomials=list(MONOMIALS), regimes=regimes,
                       spec=first.spec, workload=first.workload, layer_index=layer,
                       num_params=first.num_params or 0, analytic_num_params=first.spec.num_params)
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


def _peak(values: dict[str, float]) -> float:
    return max(values[t] for t in PHASE_TARGETS)


def _errors(data: list[Data], fit_set: list[Data], regimes: dict[str, RegimeFit]
            ) -> tuple[list[ErrorFigure], list[PointFit]]:
    held = [d for d in data if d.role == "holdout"]
    loo: dict[str, dict[str, float]] = {}
    for d in fit_set:
        rest = [q for q in fit_set if q is not d]
        same = [q.bs for q in rest if q.regime == d.regime]
        if same and _rank(same) >= RANK[d.regime]:
            loo[d.key] = predict(_fit(rest), d)
    pred = {d.key: predict(regimes, d) for d in data}
    figures: list[ErrorFigure | None] = []
    for t in ("saved", "layer", *PHASE_TARGETS, "peak"):
        get = _peak if t == "peak" else (lambda v, t=t: v[t])
        figures.append(_figure(t, "analytic", [_pct(get(d.analytic), get(d.measured))
                                               for d in data]))
        figures.append(_figure(t, "held-out", [_pct(get(pred[d.key]), get(d.measured))
                                               for d in held]))
        figures.append(_figure(t, "leave-one-out", [_pct(get(loo[d.key]), get(d.measured))
                                                    for d in fit_set if d.key in loo]))
    table = [PointFit(key=d.key, role=d.role, measured_bytes=round(_peak(d.measured)),
                      analytic_bytes=round(_peak(d.analytic)),
                      fitted_bytes=round(_peak(pred[d.key])),
                      loo_bytes=round(_peak(loo[d.key])) if d.key in loo else None)
             for d in data]
    return [f for f in figures if f is not None], table


__all__ = ["evaluate", "fit_model", "layer_index_for"]
