"""How much of an out-of-memory failure is fragmentation, from the message or a memory snapshot,
beside what the caching-allocator model says for the same configuration.

When ``DeviceCachingAllocator::malloc`` fails (``c10/cuda/CUDACachingAllocator.cpp``) it has
already freed every cached segment that is one free block (``release_cached_blocks``), so what
stays "reserved by PyTorch but unallocated" is free blocks inside segments that hold live
tensors: bytes the process has, in pieces none of which holds the request. The allocation
lacked ``requested - device free`` bytes; the unallocated reserve covers ``min(unallocated,
lacked)`` of that, which is the share of the failure that is fragmentation (all of it when the
reserve's free pieces add up to more than what was lacking: with them in one piece, as
``expandable_segments:True`` maps them, it would have fit).

A snapshot's trace (``device_traces``, recorded with ``_record_memory_history``) is replayed
through the allocator model (``memplan.model.allocator``), with the allocator's defaults and
with expandable segments, beside the reserved bytes the real allocator recorded for the same
events (``memplan.measure.snapshot_trace``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from memplan.diagnose.oom import OomReport


class SnapshotReplay(NamedTuple):
    """A snapshot's trace replayed: reserved bytes at its end, relative to its start (the ring
    buffer may start mid-run)."""

    num_events: int
    skipped_frees: int  # frees of blocks the trace never saw allocated
    recorded_reserved_bytes: int  # what the real allocator recorded
    replayed_reserved_bytes: int  # the model's, with the allocator's defaults
    expandable_reserved_bytes: int  # the model's, with expandable_segments:True


class Fragmentation(NamedTuple):
    """The failure's unallocated reserve and the share of it that is fragmentation, beside
    the model's reserved memory for the same configuration (the diagnosed stage)."""

    requested_bytes: int | None
    device_free_bytes: int | None
    unallocated_bytes: int | None  # reserved - allocated when it failed
    share: float | None  # of the bytes the allocation lacked, those the reserve's pieces hold
    model_reserved_peak_bytes: int
    model_fragmentation_bytes: int
    model_expandable_reserved_peak_bytes: int
    replay: SnapshotReplay | None


def replay_trace(entries: list[dict[str, Any]]) -> SnapshotReplay | None:
    """``entries`` (a device's trace) through the allocator model; None without allocations."""
    from memplan.measure.snapshot_trace import trace_events
    from memplan.model.allocator import AllocatorConfig, replay

    got = trace_events(entries)
    if not got.events:
        return None
    default = replay(got.events, AllocatorConfig())
    expandable = replay(got.events, AllocatorConfig(expandable_segments=True))
    return SnapshotReplay(len(got.events), got.skipped_frees, got.reserved_bytes[-1],
                          default.reserved_bytes[-1], expandable.reserved_bytes[-1])


def fragmentation(est: Any, stage: int, report: OomReport,
                  snapshot: dict[str, Any] | None = None) -> Fragmentation:
    """``report``'s unallocated reserve and its share of the failure, the model's reserved
    memory for ``est``'s stage ``stage`` (``memplan.model.reserved``), and a snapshot's trace
    replayed (of the report's device)."""
    from memplan.model.reserved import estimate_reserved

    r = estimate_reserved(est)[stage]
    unallocated = (report.reserved_bytes - report.allocated_bytes
                   if report.reserved_bytes is not None and report.allocated_bytes is not None
                   else None)
    share = None
    if (unallocated is not None and report.requested_bytes is not None
            and report.free_bytes is not None):
        lacked = report.requested_bytes - report.free_bytes
        share = min(unallocated, lacked) / lacked if lacked > 0 else None
    replay = None
    traces = (snapshot or {}).get("device_traces")
    device = report.device or 0
    if isinstance(traces, list) and device < len(traces) and isinstance(traces[device], list):
        replay = replay_trace(traces[device])
    return Fragmentation(report.requested_bytes, report.free_bytes, unallocated, share,
                         r.reserved_peak_bytes, r.fragmentation_bytes,
                         r.expandable_reserved_peak_bytes, replay)


def lines(f: Fragmentation, size) -> list[str]:
    """The text report's lines (``size``: the report's byte formatter)."""
    out = []
    if f.unallocated_bytes is not None:
        part = ("" if f.share is None else
                f"; of the {size(f.requested_bytes - f.device_free_bytes)} the allocation "
                f"lacked, {f.share:.0%} is fragmentation (free pieces of the reserve that "
                "together would have held it)")
        out.append(f"reserved by PyTorch but unallocated when it failed: "
                   f"{size(f.unallocated_bytes)}{part}")
    out.append(f"allocator model for this configuration: reserved peak "
               f"{size(f.model_reserved_peak_bytes)}, {size(f.model_fragmentation_bytes)} of it "
               f"beyond the tensor peak; with expandable_segments:True "
               f"{size(f.model_expandable_reserved_peak_bytes)}")
    if f.replay is not None:
        p = f.replay
        out.append(f"snapshot trace replayed ({p.num_events:,} events): reserved "
                   f"{size(p.recorded_reserved_bytes)} recorded, {size(p.replayed_reserved_bytes)} "
                   f"replayed by the allocator model, {size(p.expandable_reserved_bytes)} with "
                   "expandable_segments:True (relative to the trace's start)")
    return out


def as_json(f: Fragmentation) -> dict[str, Any]:
    return {"requested_bytes": f.requested_bytes, "device_free_bytes": f.device_free_bytes,
            "unallocated_bytes": f.unallocated_bytes, "fragmentation_share": f.share,
            "model_reserved_peak_bytes": f.model_reserved_peak_bytes,
            "model_fragmentation_bytes": f.model_fragmentation_bytes,
            "model_expandable_reserved_peak_bytes": f.model_expandable_reserved_peak_bytes,
            "snapshot_replay": None if f.replay is None else f.replay._asdict()}
