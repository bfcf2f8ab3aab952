"""Device records -> a device profile's coefficients: weighted least squares, deterministic.

Each finished record contributes six rows (first step and steady state x forward, backward,
optimizer). A row's target is the measured peak allocated minus the analytic phase peak; its
features are ``memplan.calibrate.features``; rows are weighted by 1 / analytic peak, so the fit
minimises relative error. Columns no record exercises (e.g. ``eager_scores`` without eager
runs) are left out and their coefficient is 0. The caching allocator is the model's
(``memplan.model.reserved``: each record's configuration replayed); a record measures only what
it misses, the residual: max reserved less max allocated, less the model's bytes beyond the
tensor peak for that configuration, averaged over the records. The memory outside the allocator
is the mean of device used minus reserved, and the time model as one achieved FLOP/s (least squares on relative step
time). Every figure has a leave-one-record-out error next to the analytic model's own error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.linalg

from memplan.calibrate.calibration_profile import DeviceTerms, ErrorFigure, PointFit
from memplan.calibrate.features import (
    FEATURES,
    STEP_KINDS,
    analytic,
    analytic_phases,
    correction,
    stage_features,
)
from memplan.calibrate.records import PHASES, ProbeRecord, Record
from memplan.errors import MemplanError
from memplan.hardware import load_gpu

SIGNIFICANT = 9  # digits kept in a profile: the fit is deterministic to far more


@dataclass(frozen=True)
class Row:
    record: int
    feats: dict[str, float]
    analytic: int
    allocated: int
    reserved: int | None
    used: int | None


@dataclass(frozen=True)
class Point:
    """One finished record, reduced to what the fit reads."""

    index: int
    key: str
    role: str
    rows: tuple[Row, ...]
    time_s: float
    flops: float
    # the caching-allocator model's bytes beyond the tensor peak for the record's configuration
    # (``memplan.model.reserved``, stage 0, the allocator's defaults, no capacity limit)
    model_gap: int = 0


def sig(x: float, digits: int = SIGNIFICANT) -> float:
    """``x`` to ``digits`` significant digits; below 1e-12 in size (rounding noise of an exact
    fit) it is 0."""
    return 0.0 if abs(x) < 1e-12 else float(f"{x:.{digits}g}")


def _max_or_none(values: list[int | None]) -> int | None:
    return None if any(v is None for v in values) else max(values)  # type: ignore[type-var]


def points_of(records: list[Record]) -> list[Point]:
    """The finished records as rows; records that ran out of memory are skipped."""
    out = []
    for i, rec in enumerate(r for r in records if r.ok):
        stage = analytic(rec.spec, rec.layout, rec.workload).stages[0]
        feats, ana = stage_features(stage, rec.workload), analytic_phases(stage)
        rows = []
        for kind, idx in zip(STEP_KINDS, (0, -1)):
            for phase in PHASES:
                ms = [r.steps[idx].phases[phase] for r in rec.ranks]
                rows.append(Row(i, feats[phase], ana[(kind, phase)],
                                max(m.allocated_bytes for m in ms),
                                _max_or_none([m.reserved_bytes for m in ms]),
                                _max_or_none([m.device_used_bytes for m in ms])))
        steady = rec.ranks[0].steps[-1]
        gap = (allocator_gap(rec) if any(r.reserved is not None for r in rows) else 0)
        out.append(Point(i, rec.key, rec.role, tuple(rows), steady.time_s,
                         steady.hardware_flops, gap))
    return out


def allocator_gap(rec: Record) -> int:
    """The caching-allocator model's reserved bytes beyond the tensor peak (stage 0) for the
    configuration a record ran (``memplan.model.reserved.estimate_reserved``)."""
    from memplan.model.reserved import estimate_reserved

    est = analytic(rec.spec, rec.layout, rec.workload)
    return estimate_reserved(est, limited=False, with_expandable=False)[0].fragmentation_bytes


def solve(rows: list[Row], names: tuple[str, ...] = FEATURES) -> dict[str, float]:
    """Coefficients minimising the relative squared error of the corrected phase peaks."""
    x = np.array([[r.feats.get(n, 0.0) for n in names] for r in rows], dtype=np.float64)
    y = np.array([r.allocated - r.analytic for r in rows], dtype=np.float64)
    w = 1.0 / np.maximum(np.array([r.analytic for r in rows], dtype=np.float64), 1.0)
    keep = [j for j in range(len(names)) if np.any(x[:, j] != 0)]
    coef: dict[str, float] = {}  # only the terms some record exercises
    if not keep or not rows:
        return coef
    a = x[:, keep] * w[:, None]
    scale = np.abs(a).max(axis=0)
    beta = scipy.linalg.lstsq(a / scale, y * w, lapack_driver="gelsd")[0]
    for i, j in enumerate(keep):
        coef[names[j]] = float(beta[i] / scale[i])
    return coef


def solve_residual(points: list[Point]) -> float | None:
    """What the caching-allocator model misses, bytes: per record, its max reserved less its
    max allocated (over phases and ranks) less the model's bytes beyond the tensor peak
    (``Point.model_gap``); the mean over the records that measured reserved memory."""
    gaps = []
    for p in points:
        have = [r for r in p.rows if r.reserved is not None]
        if have:
            gaps.append(max(r.reserved for r in have) - max(r.allocated for r in have)
                        - p.model_gap)
    return float(np.mean(gaps)) if gaps else None


def outside_allocator(rows: list[Row]) -> float | None:
    gaps = [r.used - r.reserved for r in rows if r.used is not None and r.reserved is not None]
    return float(np.mean(gaps)) if gaps else None


def solve_rate(points: list[Point]) -> tuple[float, float] | None:
    """(achieved FLOP/s R, fixed seconds per step t0) minimising sum(((t - t0 - F/R) / t)^2):
    the step's FLOPs at one rate plus what does not scale with them (launches, Python). t0 is
    dropped (0) when the fit makes it negative or the FLOPs do not vary."""
    have = [p for p in points if p.time_s > 0 and p.flops > 0]
    if not have:
        return None
    t = np.array([p.time_s for p in have])
    f = np.array([p.flops for p in have])
    if len(set(f.tolist())) > 1:
        a = np.stack([f / t, 1.0 / t], axis=1)
        inv_rate, t0 = scipy.linalg.lstsq(a, np.ones_like(t), lapack_driver="gelsd")[0]
        if t0 >= 0 and inv_rate > 0:
            return float(1.0 / inv_rate), float(t0)
    ratios = f / t
    return float(np.sum(ratios ** 2) / np.sum(ratios)), 0.0


def peak(point: Point, coef: dict[str, float]) -> float:
    return max(r.analytic + correction(coef, r.feats) for r in point.rows)


def measured(point: Point, field: str = "allocated") -> int | None:
    values = [getattr(r, field) for r in point.rows]
    return None if any(v is None for v in values) else max(values)


def _figure(quantity: str, method: str, pairs: list[tuple[float, float]]) -> ErrorFigure | None:
    """pairs: (predicted, measured)."""
    pairs = [(p, m) for p, m in pairs if m]
    if not pairs:
        return None
    pct = np.array([100.0 * (p - m) / m for p, m in pairs])
    return ErrorFigure(quantity=quantity, method=method, num_points=len(pairs),
                       max_abs_pct=sig(float(np.max(np.abs(pct))), 4),
                       rms_pct=sig(float(np.sqrt(np.mean(pct ** 2))), 4))


@dataclass(frozen=True)
class _Fit:
    coef: dict[str, float]
    reserved: float | None  # the allocator residual (``solve_residual``)
    outside: float | None
    rate: tuple[float, float] | None


def _fit(points: list[Point]) -> _Fit:
    rows = [r for p in points for r in p.rows]
    return _Fit(solve(rows), solve_residual(points), outside_allocator(rows), solve_rate(points))


def _predictions(point: Point, fit: _Fit) -> dict[str, float | None]:
    alloc = peak(point, fit.coef)
    reserved = None if fit.reserved is None else alloc + point.model_gap + fit.reserved
    used = None if reserved is None or fit.outside is None else reserved + fit.outside
    time = point.flops / fit.rate[0] + fit.rate[1] if fit.rate else None
    return {"allocated": alloc, "reserved": reserved, "used": used, "time": time}


def _actual(point: Point) -> dict[str, float | None]:
    return {"allocated": measured(point), "reserved": measured(point, "reserved"),
            "used": measured(point, "used"), "time": point.time_s}


QUANTITIES = {"allocated": "allocated_peak", "reserved": "reserved_peak",
              "used": "device_used_peak", "time": "step_time"}


def fit_device(records: list[Record], probes: ProbeRecord | None = None
               ) -> tuple[DeviceTerms, list[ErrorFigure], list[PointFit]]:
    """Fit a device profile's terms; errors and per-record predictions to show with them."""
    points = points_of(records)
    fit_points = [p for p in points if p.role == "fit"]
    if len(fit_points) < 2:
        raise MemplanError(f"calibration fit needs at least 2 finished records, got "
                           f"{len(fit_points)} (of {len(records)})")
    full = _fit(fit_points)
    loo: dict[int, dict[str, float | None]] = {}
    for p in fit_points:
        rest = [q for q in fit_points if q is not p]
        loo[p.index] = _predictions(p, _fit(rest))
    errors: list[ErrorFigure | None] = [
        _figure("allocated_peak", "analytic",
                [(max(r.analytic for r in p.rows), measured(p)) for p in fit_points])]
    for key, quantity in QUANTITIES.items():
        errors.append(_figure(quantity, "in-sample", [(_predictions(p, full)[key], _actual(p)[key])
                                                      for p in fit_points
                                                      if _predictions(p, full)[key] is not None]))
        errors.append(_figure(quantity, "leave-one-out",
                              [(loo[p.index][key], _actual(p)[key]) for p in fit_points
                               if loo[p.index][key] is not None]))
        held = [p for p in points if p.role == "holdout"]
        errors.append(_figure(quantity, "held-out",
                              [(_predictions(p, full)[key], _actual(p)[key]) for p in held
                               if _predictions(p, full)[key] is not None]))
    table = [PointFit(key=p.key, role=p.role, measured_bytes=measured(p) or 0,
                      analytic_bytes=max(r.analytic for r in p.rows),
                      fitted_bytes=round(peak(p, full.coef)),
                      loo_bytes=round(loo[p.index]["allocated"]) if p.index in loo else None)
             for p in points]
    return _terms(records, full, probes), [e for e in errors if e is not None], table


def _terms(records: list[Record], fit: _Fit, probes: ProbeRecord | None) -> DeviceTerms:
    meta = records[0].meta
    mfu = None
    if fit.rate is not None and meta.device == "cuda" and meta.gpu:
        mfu = sig(fit.rate[0] / load_gpu(meta.gpu).bf16_flops, 4)
    nccl = [r.nccl_bytes for rec in records if rec.ok for r in rec.ranks
            if r.nccl_bytes is not None]
    return DeviceTerms(
        coefficients={k: (round(v) if k.endswith("fixed_bytes") else sig(v))
                      for k, v in fit.coef.items()},
        allocator_residual_bytes=None if fit.reserved is None else round(fit.reserved),
        outside_allocator_bytes=None if fit.outside is None else round(fit.outside),
        nccl_bytes_per_rank=round(float(np.mean(nccl))) if nccl else None,
        probes=dict(probes.probes) if probes else {},
        achieved_flops_per_s=None if fit.rate is None else sig(fit.rate[0], 4),
        step_overhead_s=None if fit.rate is None else sig(fit.rate[1], 4),
        mfu=mfu,
        world_size=max(rec.layout.world_size for rec in records),
    )
