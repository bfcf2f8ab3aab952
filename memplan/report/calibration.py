"""``memplan calibrate``: a calibration profile as rich tables (sizes in bytes and GiB)."""

from __future__ import annotations

from typing import Any

from memplan.report.sizes import bytes_and_gib


def render_profile(profile: Any, path: str) -> Any:
    """A calibration profile: its coefficients, measured overheads and error figures."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    meta = profile.meta
    head = Text(f"{path}: {profile.kind} profile from {profile.num_records} records "
                f"({profile.num_oom} out of memory) on {meta.device_name}"
                f"{f' ({meta.gpu})' if meta.gpu else ''}, torch {meta.torch}, {meta.date}")
    terms = Table(title="Fitted terms")
    terms.add_column("term", no_wrap=True)
    terms.add_column("value", justify="right", no_wrap=True)
    if profile.device is not None:
        d = profile.device
        for name, value in d.coefficients.items():
            terms.add_row(name, f"{int(value):,} B" if name.endswith("fixed_bytes")
                          else f"{value:+.4%}")
        extra = [("allocator residual (beyond the model)",
                  _bytes(d.allocator_residual_bytes)),
                 ("outside the allocator", _bytes(d.outside_allocator_bytes)),
                 ("NCCL per rank", _bytes(d.nccl_bytes_per_rank)),
                 *((f"probe: {k}", _bytes(v)) for k, v in d.probes.items()),
                 ("achieved FLOP/s", d.achieved_flops_per_s and f"{d.achieved_flops_per_s:.4g}"),
                 ("fixed seconds per step", d.step_overhead_s is not None
                  and f"{d.step_overhead_s:.4g}"),
                 ("MFU", d.mfu and f"{d.mfu:.3f}")]
        for label, value in extra:
            if value is not None:
                terms.add_row(label, value)
    if profile.model is not None:
        m = profile.model
        terms.add_row("module", m.module)
        terms.add_row("spec", f"{m.spec.name} ({m.traced_layers} blocks traced)")
        terms.add_row("parameters (implementation / spec)",
                      f"{m.num_params:,} / {m.analytic_num_params:,}")
        for regime, fit in m.regimes.items():
            for target in ("saved", "layer"):
                terms.add_row(f"{regime}: {target} - analytic", " ".join(
                    f"{c:+.4g}*{mono}" for c, mono in zip(fit.residuals[target], m.monomials)
                    if abs(c) > 1e-6) or "0")
            terms.add_row(f"{regime}: phase peaks", ", ".join(
                f"{t} max of {len(v)}" for t, v in fit.envelopes.items()) or "polynomials")
    errors = Table(title="Relative error of the prediction, % (analytic: without the profile)")
    for col in ("quantity", "method", "points", "max |err| %", "rms %"):
        errors.add_column(col, justify="left" if col in ("quantity", "method") else "right")
    for e in profile.errors:
        errors.add_row(e.quantity, e.method, str(e.num_points), f"{e.max_abs_pct:.3f}",
                       f"{e.rms_pct:.3f}")
    return Group(head, terms, errors)


def _bytes(value: int | None) -> str | None:
    return None if value is None else bytes_and_gib(value)
