"""``memplan diagnose``: the diagnosis as text (sizes in GiB, or MiB below 1 GiB, labelled) and
as JSON (int bytes)."""

from __future__ import annotations

from typing import Any

from memplan.report.sizes import format_gib, size

# The diagnosis's types (memplan.diagnose: DiagnoseResult, explain.Finding, fixes.Fix,
# oom.OomReport) are read by attribute and not imported, so that rendering sits below the
# code that diagnoses: ``memplan.check`` renders its error here from the API layer.
DiagnoseResult = Finding = Fix = OomReport = Any


def sentence(f: Finding) -> str:
    return f.text.format(**{name: size(value) for name, value in f.sizes.items()})


def _oom_line(oom: OomReport) -> str:
    if oom.kind == "driver":
        return "error: CUDA runtime out of memory (no sizes in the message)"
    if oom.kind == "nccl":
        where = "".join(f", {label} {value}" for label, value in (
            ("GPU", oom.device), ("rank", oom.rank)) if value is not None)
        failed = "" if oom.requested_bytes is None else \
            f": an allocation of {size(oom.requested_bytes)} failed"
        return f"error: NCCL out of memory{where}{failed}"
    parts = [f"error ({oom.version} format"
             + (f", GPU {oom.device}" if oom.device is not None else "")
             + (f", rank {oom.rank}" if oom.rank is not None else "") + "):"]
    for label, value in (("requested", oom.requested_bytes), ("total", oom.total_bytes),
                         ("free", oom.free_bytes), ("allowed", oom.allowed_bytes),
                         ("allocated", oom.allocated_bytes),
                         ("of it in private pools", oom.private_pool_bytes),
                         ("reserved", oom.reserved_bytes),
                         ("this process", oom.process_bytes),
                         ("other processes", oom.other_processes_bytes or None),
                         ("largest free block", oom.largest_free_block_bytes)):
        if value is not None:
            parts.append(f"{label} {size(value)}")
    return " ".join(parts[:1]) + " " + ", ".join(parts[1:])


def _monitor_line(m: Any) -> str:
    """The monitor's worst rank in one line (``m``: memplan.diagnose.monitored.Monitored)."""
    row = m.worst
    head = (f"monitor ({len(m.files)} files, {len(m.records)} ranks): worst rank "
            f"{m.worst_rank}, {row['num_steps']} steps")
    parts = [head]
    for label, key in (("peak", "max_peak_bytes"), ("reserved", "max_reserved_bytes"),
                       ("least headroom", "min_headroom_bytes")):
        if key in row:
            parts.append(f"{label} {size(row[key])}")
    return ", ".join(parts)


def fix_note(f: Fix) -> str:
    """What else a fix needs to be known: its own note, else the host memory it takes per GPU
    (an offloaded optimizer)."""
    host = f.estimate.worst.host_bytes
    return f.note or (f"host memory {format_gib(host)} per GPU" if host else "")


def _fix_row(f: Fix, base_step_s: float) -> str:
    cost = f.time.step_s / base_step_s - 1.0
    status = "fits" if f.safe else "tight" if f.fits else "over"
    return (f"  {status:5} {f.name}: peak {size(f.peak_bytes)} "
            + (f"(saves {size(f.saved_bytes)})" if f.saved_bytes > 0 else
               f"(saves {size(f.phase_saved_bytes)} in the phase the job died in, none at the "
               "estimate's peak)")
            + f", step {f.time.step_s:.3g} s ({cost:+.1%})  "
            f"[{f.flags}]" + (f"; {fix_note(f)}" if fix_note(f) else "")
            + ("; shrinks the phase the job died in" if f.addresses_failure else ""))


def render_text(r: DiagnoseResult) -> str:
    d, est = r.diagnosis, r.diagnosis.estimate
    par, wl = est.parallel, est.workload
    config = (f"{est.spec.name} on {par.world_size} x {est.gpu.name}: tp={par.tp} pp={par.pp} "
              f"vpp={par.vpp} dp={par.dp} cp={par.cp} zero={int(par.zero)} "
              f"mbs={wl.micro_batch_size} gbs={est.global_batch_size} seq={wl.seq_len} "
              f"recompute={wl.recompute.label}")
    verdict = "fits" if est.peak_bytes <= d.capacity_bytes else "over"
    peak = (f"estimate: peak {size(est.peak_bytes)} (stage {est.worst.stage}, "
            f"{est.worst.peak_phase}) of {size(d.capacity_bytes)} capacity "
            f"({r.capacity_source}): {verdict}")
    lines = [config, peak]
    if d.oom is not None:
        lines.append(_oom_line(d.oom))
    if r.fragmentation is not None:
        from memplan.diagnose.fragmentation import lines as fragmentation_lines

        lines += fragmentation_lines(r.fragmentation, size)
    if r.monitor is not None:
        lines.append(_monitor_line(r.monitor))
    lines.append("why:")
    lines += [f"  {'*' if f.cause else '-'} {sentence(f)}" for f in d.findings]
    if r.fixes is not None:
        base = r.fixes.baseline_time.step_s
        first = ("that shrink the phase the job died in first, each group "
                 if d.died_in is not None else "")
        lines.append(f"fixes (re-estimated; step time from the step-time model, baseline "
                     f"{base:.3g} s; fitting ones {first}fastest first; tight: inside the 5% "
                     "safety margin):")
        margin = r.fixes.ranked[0].margin_bytes if r.fixes.ranked else 0
        if margin:
            lines.append(f"  (fit judged with {size(margin)} added to each peak: what the job "
                         "held beyond the estimate when it failed)")
        lines += [_fix_row(f, base) for f in r.fixes.ranked] or ["  none lowers the peak"]
    u = r.utilisation
    lines.append(f"utilisation: {u.bound}-bound; step {u.time.step_s:.3g} s, MFU "
                 f"{u.time.mfu:.2f} (step-time model)")
    lines += [f"  - {a}" for a in u.advice]
    return "\n".join(lines)


def _oom_json(oom: OomReport | None) -> dict[str, Any] | None:
    if oom is None:
        return None
    fields = ("kind", "version", "device", "rank", "requested_bytes", "total_bytes",
              "free_bytes", "allowed_bytes", "allocated_bytes", "reserved_bytes",
              "process_bytes", "other_processes_bytes", "rounding_bytes",
              "largest_free_block_bytes", "num_segments", "private_pool_bytes")
    out = {name: getattr(oom, name) for name in fields}
    out["unallocated_bytes"] = oom.unallocated_bytes
    out["non_pytorch_bytes"] = oom.non_pytorch_bytes
    return out


def _change_json(change: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in change.items():
        if key == "overheads":
            out["allocator_fraction"] = value.allocator_fraction
        else:
            out[key] = getattr(value, "value", value)
    return out


def to_json(r: DiagnoseResult) -> dict[str, Any]:
    from memplan.report.estimate import estimate_json

    d = r.diagnosis
    u = r.utilisation
    out: dict[str, Any] = {
        "oom": _oom_json(d.oom),
        "died_in": None if d.died_in is None else {
            "phase": d.died_in.phase, "operation": d.died_in.operation,
            "frame": d.died_in.frame, "rule_source": d.died_in.source,
            "innermost_frame": d.died_in.innermost, "rank": d.died_in.rank},
        "capacity_bytes": d.capacity_bytes,
        "capacity_source": r.capacity_source,
        "failing_stage": d.stage.stage,
        "failing_step": d.failing_step,
        "failing_phase": d.failing_phase,
        "components_bytes": d.components,
        "dominant": {"component": d.dominant[0], "bytes": d.dominant[1]},
        "findings": [{"kind": f.kind, "cause": f.cause, "message": sentence(f),
                      "sizes": f.sizes} for f in d.findings],
        "utilisation": {"bound": u.bound, "step_time_s": u.time.step_s, "mfu": u.time.mfu,
                        "compute_s": u.time.compute_s, "exposed_comm_s": u.time.exposed_comm_s,
                        "comm_s": u.time.comm_s, "bubble_s": u.time.bubble_s,
                        "headroom_bytes": u.headroom_bytes,
                        "recompute_share": u.recompute_share, "advice": list(u.advice)},
        "estimate": estimate_json(d.estimate),
    }
    if r.fragmentation is not None:
        from memplan.diagnose.fragmentation import as_json

        out["fragmentation"] = as_json(r.fragmentation)
    if r.monitor is not None:
        m = r.monitor
        out["monitor"] = {"files": list(m.files), "worst_rank": m.worst_rank,
                          "worst_stage": d.estimate.stage_of_rank(m.worst_rank).stage,
                          "capacity_bytes": m.capacity_bytes,
                          "ranks": {str(k): v for k, v in m.summary["ranks"].items()}}
    if r.fixes is not None:
        out["baseline_step_time_s"] = r.fixes.baseline_time.step_s
        out["fixes"] = [{"name": f.name, "flags": f.flags, "change": _change_json(f.change),
                         "peak_bytes": f.peak_bytes, "saved_bytes": f.saved_bytes,
                         "capacity_bytes": f.capacity_bytes, "margin_bytes": f.margin_bytes,
                         "fits": f.fits, "within_safety_margin": f.safe,
                         "addresses_failure": f.addresses_failure,
                         "phase_saved_bytes": f.phase_saved_bytes,
                         "step_time_s": f.time.step_s, "mfu": f.time.mfu, "note": fix_note(f)}
                        for f in r.fixes.ranked]
        out["not_applicable"] = [{"name": n, "reason": why} for n, why in r.fixes.skipped]
    return out
