"""A real training step's allocation sequence, recorded by the exact tracker on CPU, replayed
through the caching-allocator model (``memplan.model.allocator``).

The tracker's high-water mark is the truth for live bytes. The model only rounds each size up to
a multiple of 512 B (``round_size``) and hands a block whole when its remainder is too small to
split, so its allocated peak is at least the tracker's and at most the tracker's plus 1 MiB per
live allocation (the largest unsplit remainder, ``should_split``); reserved is at least
allocated. These are bounds from the rules, not numbers taken from the model; the replay's
reserved and allocated figures are printed for the record.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memplan.api import resolve  # noqa: E402
from memplan.model.allocator import Alloc, Free, parse_alloc_conf, replay  # noqa: E402
from memplan.profile.alloc_trace import AllocationRecorder  # noqa: E402
from memplan.profile.reference import ReferenceModel  # noqa: E402
from memplan.profile.trace import ref_options, run_steps  # noqa: E402


def _recorded(steps: int) -> AllocationRecorder:
    spec, _par, wl = resolve("tiny", micro_batch_size=2, seq_len=64)
    torch.manual_seed(0)
    model = ReferenceModel(spec, ref_options(wl))
    rec = AllocationRecorder()
    run_steps(model, spec, wl, rec, steps=steps)
    return rec


def test_recorded_sequence_is_consistent_with_the_tracker():
    """Replaying the events with no rounding (a running sum of sizes) gives back the tracker's
    own high-water mark: every storage the tracker counted is one Alloc and at most one Free."""
    rec = _recorded(steps=2)
    live: dict[int, int] = {}
    total = high = 0
    for ev in rec.events:
        if isinstance(ev, Alloc):
            live[ev.id] = ev.size_bytes
            total += ev.size_bytes
        else:
            total -= live.pop(ev.id)
        high = max(high, total)
    assert high == rec.take_high_water()


def test_reference_step_replayed_reserved_vs_allocated():
    rec = _recorded(steps=3)
    high = rec.take_high_water()
    r = replay(rec.events)
    most_live = _most_live(rec.events)
    assert high <= r.allocated_peak_bytes <= high + most_live * 1048576
    assert r.reserved_peak_bytes >= r.allocated_peak_bytes
    assert not r.out_of_memory
    e = replay(rec.events, parse_alloc_conf("expandable_segments:True"))
    print(f"\ntracker peak {high} B; replay allocated peak {r.allocated_peak_bytes} B, reserved "
          f"peak {r.reserved_peak_bytes} B, fragmentation {r.fragmentation_bytes} B, segments "
          f"{r.segments}; expandable reserved peak {e.reserved_peak_bytes} B")


def _most_live(events: list[Alloc | Free]) -> int:
    live = most = 0
    for ev in events:
        live += 1 if isinstance(ev, Alloc) else -1
        most = max(most, live)
    return most
