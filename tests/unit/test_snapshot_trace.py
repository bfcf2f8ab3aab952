"""The allocator trace of a memory snapshot (``device_traces``) read as replay events, with the
reserved bytes the real allocator recorded beside them."""

from __future__ import annotations

from memplan.measure.snapshot_trace import trace_events
from memplan.model.allocator import Alloc, Free, replay

MiB = 1048576
S = 0x7F00  # a stream handle as the trace writes it


def _entry(action: str, addr: int, size: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": S, "time_us": 0}


# What DeviceCachingAllocator writes for: a = 5 MiB, b = 5 MiB, free a, c = 12 MiB (by hand:
# a: cudaMalloc 20 MiB (segment_alloc) then alloc at its start; b: split at +5 MiB, no segment;
# free a: free_requested then free_completed (no record_stream); c: 12 MiB >= 10 MiB, no free
# block fits -> segment_alloc of 12 MiB, then alloc). A free of 0x9000 allocated before the
# ring buffer starts comes first.
BASE, SEG2 = 0x10000000, 0x20000000
TRACE = [
    _entry("free_completed", 0x9000, 512),
    _entry("segment_alloc", BASE, 20 * MiB),
    _entry("alloc", BASE, 5 * MiB),
    _entry("alloc", BASE + 5 * MiB, 5 * MiB),
    _entry("free_requested", BASE, 5 * MiB),
    _entry("free_completed", BASE, 5 * MiB),
    _entry("segment_alloc", SEG2, 12 * MiB),
    _entry("alloc", SEG2, 12 * MiB),
    {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
]


def test_trace_entries_become_events_and_recorded_reserved() -> None:
    """Allocs in order with ids 0, 1, 2; free_completed of a's address frees id 0; the free of
    an address never allocated in the trace is skipped. Reserved after each event: 20, 20, 20,
    32 MiB (the second segment_alloc comes before c's alloc)."""
    t = trace_events(TRACE)
    assert t.events == [Alloc(0, 5 * MiB), Alloc(1, 5 * MiB), Free(0), Alloc(2, 12 * MiB)]
    assert t.reserved_bytes == [20 * MiB, 20 * MiB, 20 * MiB, 32 * MiB]
    assert t.skipped_frees == 1
    assert replay(t.events).reserved_bytes == t.reserved_bytes


def test_an_address_reused_after_its_free_is_a_new_allocation() -> None:
    """alloc at A, free_completed at A, alloc at A again: ids 0 and 1, the free frees 0."""
    trace = [_entry("alloc", BASE, 512), _entry("free_completed", BASE, 512),
             _entry("alloc", BASE, 1024), _entry("free_completed", BASE, 1024)]
    assert trace_events(trace).events == [Alloc(0, 512), Free(0), Alloc(1, 1024), Free(1)]
