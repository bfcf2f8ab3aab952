"""A memory snapshot's allocator trace as events the allocator model replays, and the reserved
bytes the real allocator recorded in the same trace (torch-free).

``torch.cuda.memory._record_memory_history()`` makes the allocator write a ``TraceEntry`` per
action into a ring buffer, and ``_snapshot()["device_traces"][device]`` returns it (read by
``memplan.diagnose.snapshot.load_snapshot``). The actions and what ``DeviceCachingAllocator``
writes for them (``c10/cuda/CUDACachingAllocator.cpp``, ``record_trace`` calls):

- "alloc" (``alloc_found_block``): the block's address and ``orig_size``, the size requested
  before ``round_size``: an ``Alloc`` here, the model rounds it.
- "free_requested" (``free``) then "free_completed" (``free_block``, at once, or once the
  events of ``record_stream`` streams have completed): the block is reusable at
  "free_completed", which is taken as the ``Free``.
- "segment_alloc" / "segment_free" (``alloc_block`` / ``release_block``: cudaMalloc and
  cudaFree of a segment) and "segment_map" / "segment_unmap" (``map_block`` / ``unmap_block``,
  expandable segments): reserved bytes go up or down by the entry's size.
- "oom", "snapshot", "user_defined": no change.

The ring buffer keeps the last ``max_entries`` entries, so a trace may start with allocations
already live: a free of an address the trace never allocated is skipped and counted, and the
reserved bytes recorded are relative to the start of the trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.model.allocator import Alloc, Free

_RESERVE = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


@dataclass
class TraceEvents:
    events: list[Alloc | Free]
    reserved_bytes: list[int]  # the real allocator's reserved bytes after each event, relative
    skipped_frees: int  # frees of blocks allocated before the trace starts


def trace_events(entries: list[dict[str, Any]]) -> TraceEvents:
    """Events in trace order; streams numbered in order of first appearance."""
    live: dict[int, int] = {}  # address -> id of the live allocation
    streams: dict[Any, int] = {}
    out = TraceEvents([], [], 0)
    reserved = next_id = 0
    for entry in entries:
        action = entry["action"]
        if action in _RESERVE:
            reserved += _RESERVE[action] * int(entry["size"])
        elif action == "alloc":
            stream = streams.setdefault(entry.get("stream", 0), len(streams))
            live[int(entry["addr"])] = next_id
            out.events.append(Alloc(next_id, int(entry["size"]), stream))
            out.reserved_bytes.append(reserved)
            next_id += 1
        elif action == "free_completed":
            key = live.pop(int(entry["addr"]), None)
            if key is None:
                out.skipped_frees += 1
                continue
            out.events.append(Free(key))
            out.reserved_bytes.append(reserved)
    return out


__all__ = ["TraceEvents", "trace_events"]
