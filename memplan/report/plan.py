"""``memplan plan``: the ranked candidates as JSON (int bytes) and as a table (GiB)."""

from __future__ import annotations

from itertools import groupby
from typing import TYPE_CHECKING, Any

from memplan.parallel import ParallelConfig, offload_names, rank_layers
from memplan.report.sizes import format_gib, gib

if TYPE_CHECKING:
    from memplan.planning.planner import PlanResult


def plan_json(result: PlanResult, top: int) -> dict[str, Any]:
    """The first ``top`` candidates, the rejections by reason and the closest miss; int bytes."""
    return {
        "global_batch_size": result.global_batch_size,
        "evaluated": result.evaluated,
        "searched": result.searched,
        "candidates": [{
            "layout": _layout_json(c.layout),
            "mbs": c.micro_batch_size, "recompute": c.recompute.label,
            "recompute_layers": c.recompute_layers,
            **({"recompute_save": list(c.recompute_save)} if c.recompute.label == "ops" else {}),
            "peak_bytes": c.peak_bytes, "capacity_bytes": c.capacity_bytes,
            "step_time_s": c.time.step_s, "tokens_per_s_per_gpu": c.time.tokens_per_s_per_gpu,
            "mfu": c.time.mfu, "bound": c.time.bound.value, "fits": True,
            **_bucket_json(c),
        } for c in result.candidates[:top]],
        "rejected": dict(result.rejected),
        "oom_excess_bytes": result.oom_excess_bytes,
        "budget_bytes": result.budget_bytes,
        "closest_miss": None if result.closest_miss is None else {
            "layout": _layout_json(result.closest_miss.layout),
            "mbs": result.closest_miss.micro_batch_size,
            "recompute": result.closest_miss.recompute.label,
            "recompute_layers": result.closest_miss.recompute_layers,
            "peak_bytes": result.closest_miss.peak_bytes,
            "stage": result.closest_miss.stage},
        "no_fit": no_fit_reason(result) if not result.candidates else None,
        "notes": list(result.notes),
    }


def _layout_json(p: ParallelConfig) -> dict[str, Any]:
    return {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "dp": p.dp, "cp": p.cp, "ep": p.ep,
            "zero": int(p.zero), "sp": p.sequence_parallel,
            "stage_layers": list(p.stage_layers) if p.stage_layers else None,
            "dp_shard": p.shard_group, "etp": p.expert_tp, "offload": offload_names(p.offload),
            **({"vpp_group": p.vpp_group} if p.vpp_group is not None else {})}


def _bucket_json(c: Any) -> dict[str, Any]:
    """DeepSpeed's reduce bucket of a candidate (elements, buffers), where it has one."""
    wl = c.workload
    if not wl.zero_bucket_buffers:
        return {}
    return {"reduce_bucket_numel": wl.zero_bucket_numel, "reduce_buckets": wl.zero_bucket_buffers}


def _candidate_layout(c: Any) -> str:
    """The layout, and DeepSpeed's reduce bucket size where the candidate has one."""
    wl = c.workload
    bucket = f" bucket {_elements(wl.zero_bucket_numel)}" if wl.zero_bucket_buffers else ""
    return _layout(c.layout) + bucket


def _elements(n: int) -> str:
    """An element count as a ds_config writes it where it is d x 10^k (5e8), else whole."""
    k = len(str(n)) - 1
    return f"{n // 10**k}e{k}" if k > 2 and n % 10**k == 0 else f"{n:,}"


def no_fit_reason(result: PlanResult) -> str:
    """Why a plan has no candidate, in one line: the closest configuration and by how much it
    misses the usable capacity, else the rules that ruled every layout out."""
    miss = result.closest_miss
    if miss is not None:
        recompute = miss.recompute.label + (f" {miss.recompute_layers} layers"
                                            if miss.recompute_layers else "")
        return (f"nothing fits: the closest is {_layout(miss.layout)} at micro-batch "
                f"{miss.micro_batch_size} with recompute {recompute}, peak "
                f"{format_gib(miss.peak_bytes)} on stage {miss.stage}, "
                f"{format_gib(miss.peak_bytes - result.budget_bytes)} over the usable "
                f"{format_gib(result.budget_bytes)} (capacity less the safety margin)")
    reasons = "; ".join(f"{n} x {reason}" for reason, n in result.rejected.most_common(3))
    return f"no layout to search: {reasons or 'no layout of these GPUs'}"


_BOUND = {"compute": "compute", "communication": "comm", "pipeline bubble": "bubble"}


def _layout(p: ParallelConfig) -> str:
    parts = [f"tp{p.tp}" + ("+sp" if p.sequence_parallel else ""), f"pp{p.pp}"]
    parts += [f"v{p.vpp}"] if p.vpp > 1 else []
    parts += [f"g{p.vpp_group}"] if p.vpp_group is not None else []
    parts += [f"[{split_label(p.stage_layers)}]"] if p.stage_layers else []
    parts += [f"cp{p.cp}"] if p.cp > 1 else []
    parts += [f"ep{p.ep}"] if p.ep > 1 else []
    parts += [f"etp{p.etp}"] if p.etp is not None and p.etp != p.tp else []
    dp = f"dp{p.dp}" + (f"/{p.shard_group}" if p.replicas > 1 else "")
    host = [f"offload {offload_names(p.offload)}"] if p.offload else []
    return " ".join([*parts, dp, f"z{int(p.zero)}", *host])


def split_label(split: tuple[int, ...]) -> str:
    """Layers per stage, runs of equal stages written once with their count: 15,16x6,15."""
    out: list[str] = []
    for key, group in groupby(split):
        n = len(list(group))
        out.append(f"{key}x{n}" if n > 1 else str(key))
    return ",".join(out)


def best_line(result: PlanResult, num_layers: int) -> str:
    """The fastest candidate in one line: its layout, micro-batch, recompute, peak against the
    budget, step time and MFU (``plan --quiet``); ``result`` has at least one candidate."""
    c = result.candidates[0]
    return (f"FITS: {_candidate_layout(c)}, mbs {c.micro_batch_size}, recompute "
            f"{_recompute(c, num_layers)}; peak {format_gib(c.peak_bytes)} of "
            f"{format_gib(result.budget_bytes)} usable; step {c.time.step_s:.2f} s, MFU "
            f"{c.time.mfu:.2f} (fastest of {len(result.candidates)})")


def _recompute(c: Any, num_layers: int) -> str:
    """A candidate's recompute policy; full recompute of k of a stage's layers: "full 2 of
    8"."""
    if c.recompute.label == "ops":  # what each layer keeps
        return "ops: " + (",".join(c.recompute_save) or "input only")
    return c.recompute.label + (f" {c.recompute_layers} of "
                                f"{max(rank_layers(num_layers, c.layout))}"
                                if c.recompute_layers else "")


def plan_parts(result: PlanResult, model: str, num_layers: int, gpus: int, gpu: str,
               top: int) -> list[Any]:
    """The first ``top`` candidates as a table (peak in GiB), then the notes, the rejections
    and the closest configuration that did not fit: ``memplan.report.text`` parts, laid out
    as rich lays them out (``render``) without importing it."""
    from memplan.report.text import Paragraph, TextTable

    table = TextTable(f"{model} on {gpus} x {gpu}, global batch {result.global_batch_size}: "
                      f"{len(result.candidates)} fit ({result.evaluated} estimates; GiB = 2^30 "
                      "B)", simple=True)
    # narrower than its content (a small terminal, --width), a cell folds onto a second line
    # rather than being cut
    table.add_column("layout", overflow="fold")
    for col in ("mbs", "recompute", "GiB", "step s", "tok/s/GPU", "MFU", "bound"):
        table.add_column(col, justify="right", overflow="fold")
    for c in result.candidates[:top]:
        table.add_row(_candidate_layout(c), str(c.micro_batch_size), _recompute(c, num_layers),
                      gib(c.peak_bytes, 1), f"{c.time.step_s:.2f}",
                      f"{c.time.tokens_per_s_per_gpu:,.0f}", f"{c.time.mfu:.2f}",
                      _BOUND[c.time.bound.value])
    parts: list[Any] = [table]
    parts += [Paragraph(f"note: {note}") for note in result.notes]
    if result.rejected:
        parts.append(Paragraph("rejected: " + "; ".join(
            f"{n} x {reason}" for reason, n in result.rejected.most_common())))
    if result.oom_excess_bytes is not None:
        # with --top, of the configurations searched (the others were not evaluated)
        from memplan.planning.planner import SLOWER_THAN_TOP

        pruned = SLOWER_THAN_TOP.split("{top}")[0]
        searched = any(r.startswith(pruned) for r in result.rejected)
        parts.append(Paragraph(f"closest configuration {'searched ' if searched else ''}that "
                               f"did not fit: {format_gib(result.oom_excess_bytes)} over the "
                               "usable capacity"))
    return parts


def render_plan(result: PlanResult, model: str, num_layers: int, gpus: int, gpu: str,
                top: int) -> Any:
    """``plan_parts`` as one rich renderable (``--html``'s text)."""
    from memplan.report.text import to_rich

    return to_rich(plan_parts(result, model, num_layers, gpus, gpu, top))


def savers_json(found: Any) -> dict[str, Any]:
    """A plan's savers (``memplan.diagnose.fixes.savers``: ``Fixes`` of its closest
    configuration) as JSON, int bytes: each saver's flags, peak, whether it fits the plan's
    budget, its step time and what it costs against the closest configuration's."""
    base = found.baseline_time.step_s
    return {
        "baseline_peak_bytes": found.baseline.peak_bytes,
        "ranked": [{"name": f.name, "flags": f.flags, "change": _plain(f.change),
                    "peak_bytes": f.peak_bytes, "saved_bytes": f.saved_bytes,
                    "fits": f.fits, "step_time_s": f.time.step_s,
                    "step_time_change": f.time.step_s / base - 1.0,
                    "host_bytes": f.estimate.worst.host_bytes}
                   for f in found.ranked],
        "skipped": [{"name": name, "why": why} for name, why in found.skipped],
    }


def _plain(change: dict[str, Any]) -> dict[str, Any]:
    return {k: getattr(v, "value", v) for k, v in change.items() if k != "overheads"}


def savers_text(found: Any) -> str:
    """The savers in lines: fits or over, peak, saving, step time and its change, flags."""
    base = found.baseline_time.step_s
    lines = [f"savers on the closest configuration (peak {format_gib(found.baseline.peak_bytes)}"
             "), re-estimated, ranked (fits the budget, fastest, first):"]
    for f in found.ranked:
        host = f.estimate.worst.host_bytes
        lines.append(f"  {'fits' if f.fits else 'over':4} {f.name}: peak "
                     f"{format_gib(f.peak_bytes)} (saves {format_gib(f.saved_bytes)}), step "
                     f"{f.time.step_s:.3g} s ({f.time.step_s / base - 1.0:+.1%})  [{f.flags}]"
                     + (f"; host memory {format_gib(host)} per GPU" if host else ""))
    if not found.ranked:
        lines.append("  none lowers the peak")
    return "\n".join(lines)
