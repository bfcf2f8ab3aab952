"""Allocation sequences replayed through the caching-allocator model, each layout derived by hand
from the rules of ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.13), quoted in the docstrings:

- round_size: sizes below 512 B become 512 B, others round up to a multiple of 512 B.
- get_pool: rounded size <= 1 MiB goes to the small pool, else the large pool.
- get_allocation_size: small -> a 2 MiB segment; large below 10 MiB -> a 20 MiB segment;
  10 MiB and above -> the size rounded up to 2 MiB.
- get_free_block: the smallest free block of the same pool and stream that fits.
- should_split: small pool when the remainder is >= 512 B; large pool when it is > 1 MiB.
- free_block: a freed block merges with free neighbours of its segment.
- malloc: on a failed cudaMalloc, release_cached_blocks (cudaFree every segment that is one free
  block) and retry once; if that fails, OutOfMemoryError.
"""

from __future__ import annotations

from itertools import accumulate

import pytest

from memplan.errors import MemplanError
from memplan.model.allocator import (
    Alloc,
    AllocatorConfig,
    Free,
    parse_alloc_conf,
    replay,
    round_size,
)

MiB = 1048576


def test_round_size() -> None:
    """round_size: 100 < 512 -> 512; 1000 -> ceil(1000/512) = 2 -> 1024; 300000 -> 586 * 512 =
    300032. With roundup_power2_divisions 4, 5 MiB + 1 lies between 4 and 8 MiB whose quarters
    are 1 MiB apart: next division 6 MiB; without, 5 MiB + 512."""
    assert round_size(100) == 512
    assert round_size(1000) == 1024
    assert round_size(300000) == 300032
    assert round_size(5 * MiB + 1, 4) == 6 * MiB
    assert round_size(5 * MiB + 1) == 5 * MiB + 512


def test_small_allocations_share_one_2_mib_segment() -> None:
    """1000 B -> 1024 B, small: no free block, cudaMalloc 2 MiB = 2097152; remainder 2096128 >= 512
    -> split. 300000 B -> 300032: best fit is that 2096128 block -> split again. Reserved 2 MiB,
    allocated 1024 + 300032 = 301056, one segment, inactive split 2097152 - 301056 = 1796096.
    Freeing the first: its neighbour is allocated, no merge: inactive split + 1024 = 1797120."""
    r = replay([Alloc(1, 1000), Alloc(2, 300000)])
    assert r.reserved_peak_bytes == 2097152
    assert r.allocated_peak_bytes == 301056
    assert r.segments == 1
    assert r.inactive_split_bytes == 1796096
    r = replay([Alloc(1, 1000), Alloc(2, 300000), Free(1)])
    assert r.inactive_split_bytes == 1797120
    assert r.reserved_bytes == [2097152] * 3


def test_5_mib_takes_a_20_mib_segment_and_a_second_splits_it() -> None:
    """5 MiB: large, below 10 MiB -> a 20 MiB segment; remainder 15 MiB > 1 MiB -> split. The
    second 5 MiB: best fit the 15 MiB block, remainder 10 MiB -> split. Reserved 20 MiB, one
    segment, allocated 10 MiB, inactive split 10 MiB; the reserved peak comes at the first event,
    when 5 MiB are allocated: fragmentation 15 MiB."""
    r = replay([Alloc(1, 5 * MiB), Alloc(2, 5 * MiB)])
    assert r.reserved_bytes == [20 * MiB, 20 * MiB]
    assert r.segments == 1
    assert r.allocated_peak_bytes == 10 * MiB
    assert r.inactive_split_bytes == 10 * MiB
    assert r.fragmentation_bytes == 15 * MiB


def test_large_sizes_round_to_2_mib_segments() -> None:
    """12 MiB >= 10 MiB -> a segment of 12 MiB (a multiple of 2 MiB), nothing left to split.
    11 MiB + 1 B -> round_size 11 MiB + 512 -> segment 12 MiB; remainder 1 MiB - 512 is not
    > 1 MiB, so no split: allocated counts the whole 12 MiB block (stats.allocated_bytes adds
    block->size). 12.5 MiB -> a 14 MiB segment; remainder 1.5 MiB > 1 MiB -> split."""
    r = replay([Alloc(1, 12 * MiB)])
    assert (r.reserved_peak_bytes, r.allocated_peak_bytes) == (12 * MiB, 12 * MiB)
    r = replay([Alloc(1, 11 * MiB + 1)])
    assert (r.reserved_peak_bytes, r.allocated_peak_bytes) == (12 * MiB, 12 * MiB)
    assert r.inactive_split_bytes == 0
    r = replay([Alloc(1, 12 * MiB + MiB // 2)])
    assert (r.reserved_peak_bytes, r.allocated_peak_bytes) == (14 * MiB, 12 * MiB + MiB // 2)
    assert r.inactive_split_bytes == MiB + MiB // 2


def test_free_merges_then_the_merged_block_is_reused() -> None:
    """a, b 5 MiB -> [a 5][b 5][free 10] in one 20 MiB segment. Free a -> [free 5][b][free 10];
    free b -> merges with both neighbours -> one free 20 MiB block. c 18 MiB: best fit that 20 MiB
    block (remainder 2 MiB > 1 MiB -> split): no new segment, reserved stays 20 MiB."""
    ev = [Alloc(1, 5 * MiB), Alloc(2, 5 * MiB), Free(1), Free(2), Alloc(3, 18 * MiB)]
    r = replay(ev)
    assert r.reserved_bytes == [20 * MiB] * 5
    assert r.segments == 1
    assert r.inactive_split_bytes == 2 * MiB


def test_a_free_block_is_not_reused_by_another_stream() -> None:
    """a 5 MiB on stream 0 -> a 20 MiB segment; freed, it merges back to one free 20 MiB block of
    stream 0. b 5 MiB on stream 1: get_free_block looks only at stream 1's blocks -> a second
    20 MiB segment. Reserved 40 MiB, two segments."""
    r = replay([Alloc(1, 5 * MiB, stream=0), Free(1), Alloc(2, 5 * MiB, stream=1)])
    assert r.reserved_bytes == [20 * MiB, 20 * MiB, 40 * MiB]
    assert r.segments == 2


FRAGMENTED = [
    Alloc(1, 5 * MiB),
    Alloc(2, 5 * MiB),
    Alloc(3, 5 * MiB),
    Alloc(4, 5 * MiB),
    Free(1),
    Free(3),
    Alloc(5, 8 * MiB),
]


def test_free_blocks_sum_to_enough_but_none_fits() -> None:
    """Four 5 MiB: one 20 MiB segment [a][b][c][d] (the last takes the 5 MiB remainder exactly).
    Free a and c: two free 5 MiB blocks, not adjacent, 10 MiB in all. e 8 MiB: no free block
    >= 8 MiB -> a new 20 MiB segment. Reserved 40 MiB, allocated 5 + 5 + 8 = 18 MiB at the peak:
    fragmentation 22 MiB; inactive split 5 + 5 + 12 = 22 MiB."""
    r = replay(FRAGMENTED)
    assert r.reserved_bytes[-1] == 40 * MiB
    assert r.reserved_peak_bytes == 40 * MiB
    assert r.fragmentation_bytes == 22 * MiB
    assert r.inactive_split_bytes == 22 * MiB
    assert r.allocated_peak_bytes == 20 * MiB  # the four 5 MiB blocks before the frees


def test_fragmented_sequence_runs_out_where_the_sum_would_fit() -> None:
    """The same sequence with a 30 MiB device: e's new 20 MiB segment would make 40 > 30;
    release_cached_blocks frees only segments that are one free block, and the 20 MiB segment
    holds b and d: nothing is freed, the retry fails -> out of memory at event 6, though only
    10 MiB are allocated."""
    r = replay(FRAGMENTED, AllocatorConfig(capacity_bytes=30 * MiB))
    assert r.out_of_memory
    assert r.oom_event == 6
    assert r.num_alloc_retries == 1


def test_out_of_memory_releases_cached_blocks_and_retries() -> None:
    """Device 40 MiB. a 12 MiB -> a 12 MiB segment; freed, it stays cached (reserved 12 MiB).
    b 30 MiB: no free block fits, cudaMalloc 30 MiB -> 42 > 40 fails; release_cached_blocks
    cudaFrees the unsplit 12 MiB segment -> reserved 0; the retry reserves 30 MiB. With a still
    alive the retry fails too: out of memory at event 1."""
    cfg = AllocatorConfig(capacity_bytes=40 * MiB)
    r = replay([Alloc(1, 12 * MiB), Free(1), Alloc(2, 30 * MiB)], cfg)
    assert not r.out_of_memory
    assert r.reserved_bytes == [12 * MiB, 12 * MiB, 30 * MiB]
    assert r.num_alloc_retries == 1
    r = replay([Alloc(1, 12 * MiB), Alloc(2, 30 * MiB)], cfg)
    assert r.out_of_memory and r.oom_event == 1


GROWING = [Alloc(1, 12 * MiB), Free(1), Alloc(2, 14 * MiB)]


def test_expandable_segments_reserve_less_when_sizes_grow() -> None:
    """The Note [Expandable Segments] case. Without: a 12 MiB -> a 12 MiB segment; freed, cached;
    b 14 MiB does not fit -> a 14 MiB segment: reserved 26 MiB. With expandable_segments:True
    (large-pool pages are kLargeBuffer = 20 MiB): a maps one 20 MiB page and splits (remainder
    8 MiB >= 512): [a 12][free 8][unmapped]. Free a merges: [free 20][unmapped]. b 14 MiB: best
    fit is that 20 MiB block: reserved stays 20 MiB."""
    assert replay(GROWING).reserved_bytes == [12 * MiB, 12 * MiB, 26 * MiB]
    r = replay(GROWING, parse_alloc_conf("expandable_segments:True"))
    assert r.reserved_bytes == [20 * MiB, 20 * MiB, 20 * MiB]
    assert r.segments == 1
    assert r.inactive_split_bytes == 0  # free_block excludes expandable segments


def test_expandable_segments_in_the_fragmented_case() -> None:
    """Expandable, the four 5 MiB: one 20 MiB page, [a][b][c][d][unmapped]. Free a, c. e 8 MiB:
    no free block fits; find_expandable_block: the unmapped tail (its neighbour d is allocated)
    -> map 8 MiB, rounded to one 20 MiB page: reserved 40 MiB, the same as without (the large
    pool's pages are 20 MiB, so 5 MiB holes are not closed). With a 30 MiB device the page cannot
    be mapped; release_cached_blocks unmaps whole pages inside free blocks, and the 5 MiB holes
    hold none: out of memory as without."""
    cfg = parse_alloc_conf("expandable_segments:True")
    assert replay(FRAGMENTED, cfg).reserved_peak_bytes == 40 * MiB
    cfg = parse_alloc_conf("expandable_segments:True", capacity_bytes=30 * MiB)
    assert replay(FRAGMENTED, cfg).out_of_memory


def test_expandable_release_unmaps_free_pages() -> None:
    """Expandable, device 40 MiB. a 30 MiB maps two 20 MiB pages (40 MiB): [a 30][free 10].
    Free a -> [free 40]. b 50 MiB: the free 40 MiB block does not fit; find_expandable_block
    starts at it (the unmapped tail follows) and needs one more page: 60 > 40 fails.
    release_cached_blocks unmaps both free pages and drops the segment (reserved 0); the retry
    needs three pages, 60 > 40: out of memory. b 36 MiB instead fits the free 40 MiB block."""
    cfg = parse_alloc_conf("expandable_segments:True", capacity_bytes=40 * MiB)
    r = replay([Alloc(1, 30 * MiB), Free(1), Alloc(2, 50 * MiB)], cfg)
    assert r.out_of_memory and r.reserved_bytes == [40 * MiB, 40 * MiB]
    r = replay([Alloc(1, 30 * MiB), Free(1), Alloc(2, 36 * MiB)], cfg)
    assert not r.out_of_memory and r.reserved_bytes[-1] == 40 * MiB


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    """max_split_size_mb:32. a 40 MiB -> a 40 MiB segment; freed. b 5 MiB < 32 MiB: get_free_block
    will not hand a block >= max_split_size to a smaller request -> a new 20 MiB segment (reserved
    60 MiB). c 45 MiB >= max_split_size: the free 40 MiB block is too small -> a 46 MiB segment
    (106 MiB). Without the option b splits the 40 MiB block (remainder 35 MiB > 1 MiB)."""
    ev = [Alloc(1, 40 * MiB), Free(1), Alloc(2, 5 * MiB), Alloc(3, 45 * MiB)]
    r = replay(ev, parse_alloc_conf("max_split_size_mb:32"))
    assert r.reserved_bytes == [40 * MiB, 40 * MiB, 60 * MiB, 106 * MiB]
    r = replay(ev[:3])
    assert r.reserved_bytes == [40 * MiB] * 3


def test_oversize_block_rounding_limit() -> None:
    """max_split_size_mb:32. a 40 MiB, freed. b 35 MiB >= max_split_size: the free 40 MiB block
    fits and 40 < 35 + 20 (max_non_split_rounding, 20 MiB by default) -> b takes it whole
    (should_split is false for size >= max_split_size): reserved stays 40 MiB, allocated 40 MiB.
    With max_non_split_rounding_mb:4, 40 >= 35 + 4 -> refused -> a new segment of 35 MiB rounded
    up to 2 MiB = 36 MiB: reserved 76 MiB."""
    ev = [Alloc(1, 40 * MiB), Free(1), Alloc(2, 35 * MiB)]
    r = replay(ev, parse_alloc_conf("max_split_size_mb:32"))
    assert r.reserved_bytes == [40 * MiB] * 3
    assert r.allocated_peak_bytes == 40 * MiB
    r = replay(ev, parse_alloc_conf("max_split_size_mb:32,max_non_split_rounding_mb:4"))
    assert r.reserved_bytes == [40 * MiB, 40 * MiB, 76 * MiB]


def test_bad_sequences_are_refused() -> None:
    """A free of an id that is not live, a second live allocation with the same id, a size of 0
    (the allocator is not called for 0 bytes) and an option the model does not follow."""
    for events in ([Free(1)], [Alloc(1, 512), Alloc(1, 512)], [Alloc(1, 0)]):
        with pytest.raises(MemplanError):
            replay(events)
    with pytest.raises(MemplanError, match="garbage_collection_threshold"):
        parse_alloc_conf("garbage_collection_threshold:0.6")


def test_a_blip_reuses_split_remainders_and_leaves_only_its_new_segment() -> None:
    """Blip(5, 5, 12 MiB) after W (5 MiB, kept): W opened segment A (20 MiB) [W | 15 free].
    5 MiB: best fit A's 15 -> split [W 5 | 10 free]; 5 MiB: A's 10 -> split [W 5 5 | 5 free];
    12 MiB: nothing of 12 free -> segment B of 12 MiB, exact: reserved 32 MiB, allocated
    5 + 5 + 5 + 12 = 27 MiB at that moment, the peak. The frees coalesce A back to [W | 15 free]
    and leave B one free 12 MiB block: a later 12 MiB request takes B, reserving nothing."""
    from memplan.model.allocator import Blip

    r = replay([Alloc(1, 5 * MiB), Blip((5 * MiB, 5 * MiB, 12 * MiB)), Alloc(2, 12 * MiB)])
    assert r.reserved_bytes == [20 * MiB, 32 * MiB, 32 * MiB]
    assert r.reserved_peak_bytes == 32 * MiB
    assert r.fragmentation_bytes == 32 * MiB - 27 * MiB
    assert r.allocated_peak_bytes == 27 * MiB
    assert r.inactive_split_bytes == 15 * MiB  # A: W's segment, split, 15 MiB free
    assert r.segments == 2


def _expanded(events):
    """Every Blip as its allocations then its frees (ids above the sequence's)."""
    from memplan.model.allocator import Blip

    out, next_id = [], 10_000
    for ev in events:
        if isinstance(ev, Blip):
            ids = list(range(next_id, next_id + len(ev.tensors())))
            next_id += len(ids)
            out += [Alloc(k, n, ev.stream) for k, n in zip(ids, ev.tensors())]
            out += [Free(k) for k in ids]
        else:
            out.append(ev)
    return out


def _replays_as_expanded(events, cfg) -> bool:
    """Asserts ``events`` replay as their blips written out (``_expanded``) do: the same
    reserved bytes after each event, inactive split bytes and segments, or out of memory at
    the same event; the same peaks and fragmentation either way. Returns whether it ran out."""
    from memplan.model.allocator import Blip

    a, b = replay(events, cfg), replay(_expanded(events), cfg)
    # the flat sequence's index after each event
    ends = list(accumulate(2 * len(ev.tensors()) if isinstance(ev, Blip) else 1
                           for ev in events))
    assert a.out_of_memory == b.out_of_memory
    if a.out_of_memory:  # the same event: b's index within a's event
        assert (ends[a.oom_event - 1] if a.oom_event else 0) <= b.oom_event < ends[a.oom_event]
    else:
        assert a.reserved_bytes == [b.reserved_bytes[e - 1] for e in ends]
        assert (a.inactive_split_bytes, a.segments) == (b.inactive_split_bytes, b.segments)
    assert (a.reserved_peak_bytes, a.fragmentation_bytes, a.allocated_peak_bytes) == (
        b.reserved_peak_bytes, b.fragmentation_bytes, b.allocated_peak_bytes)
    return a.out_of_memory


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:40", "roundup_power2_divisions:4",
                                  "expandable_segments:True", "capacity"])
def test_blips_replay_as_their_allocations_and_frees(conf: str) -> None:
    """A property over seeded random sequences: a Blip replays exactly as its allocations and
    frees do (the same reserved bytes after it, peaks, fragmentation at the reserved peak,
    inactive split bytes, segments, out of memory at the same place), under the default
    rules, max_split_size, power-of-two rounding, expandable segments and a capacity small
    enough to release cached blocks and run out."""
    import random

    from memplan.model.allocator import Blip

    cap = 400 * MiB if conf == "capacity" else None
    cfg = parse_alloc_conf("" if conf == "capacity" else conf, cap)
    rng = random.Random(20261203)
    sizes = [300, 70_000, 900 * 1024, 3 * MiB, 5 * MiB + 7, 11 * MiB, 24 * MiB, 64 * MiB]
    checked = ran_out = 0
    for _ in range(60):
        events, live, key = [], [], 0
        for _ in range(rng.randint(20, 80)):
            roll = rng.random()
            if roll < 0.4:
                events.append(Alloc(key, rng.choice(sizes), rng.choice([0, 0, 1])))
                live.append(key)
                key += 1
            elif roll < 0.7 and live:
                events.append(Free(live.pop(rng.randrange(len(live)))))
            else:
                piece = rng.choice(sizes)
                events.append(Blip(tuple([piece] * rng.randint(1, 6) + [rng.choice(sizes)]),
                                   rng.choice([0, 0, 1])))
        if _replays_as_expanded(events, cfg):
            ran_out += 1
        else:
            checked += 1
    assert checked >= 20
    assert ran_out > 0 if conf == "capacity" else ran_out == 0


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:40", "roundup_power2_divisions:4",
                                  "capacity"])
def test_long_blips_of_one_size_replay_as_their_allocations_and_frees(conf: str) -> None:
    """The same property for blips as a working set is replayed (a run's count given, as
    ``Builder.blip`` writes it): runs of up to 40 tensors of one size (a residual-stream
    piece, 12 MiB + 5 KiB, whose 14 MiB segment leaves a remainder a 1.5 MiB tensor then
    takes; 6 MiB, two to a 20 MiB segment; 400 KiB in 2 MiB ones), the same blip again and
    again (its second time takes the segments the first made, in a row), beside tensors kept
    and freed; a capacity that a long run passes part way."""
    import random

    from memplan.model.allocator import Blip

    cap = 900 * MiB if conf == "capacity" else None
    cfg = parse_alloc_conf("" if conf == "capacity" else conf, cap)
    rng = random.Random(20261204)
    pieces = [12 * MiB + 5 * 1024, 6 * MiB, 400 * 1024, 30 * MiB, 1536 * 1024]
    checked = ran_out = 0
    for _ in range(40):
        events, live, key = [], [], 0
        blip = Blip((rng.choice(pieces), rng.choice(pieces)), 0, (rng.randint(2, 40), 1))
        for _ in range(rng.randint(10, 40)):
            roll = rng.random()
            if roll < 0.25:
                events.append(Alloc(key, rng.choice(pieces) + rng.choice([0, 512, 3 * MiB])))
                live.append(key)
                key += 1
            elif roll < 0.45 and live:
                events.append(Free(live.pop(rng.randrange(len(live)))))
            elif roll < 0.6:
                blip = Blip((rng.choice(pieces), rng.choice(pieces)), 0, (rng.randint(2, 40), 1))
                events.append(blip)
            else:
                events.append(blip)
        if _replays_as_expanded(events, cfg):
            ran_out += 1
        else:
            checked += 1
    assert checked >= 10
    assert ran_out > 0 if conf == "capacity" else ran_out == 0


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:40", "roundup_power2_divisions:4",
                                  "capacity"])
def test_one_pass_best_fit_equals_the_rules_step_by_step(
        conf: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A property over seeded random allocations and frees on two streams: malloc's one-pass
    best fit and split (``CachingAllocator._fit``) gives every figure the rules give step by
    step (``get_free_block``, then ``alloc_found_block``), under the default rules,
    max_split_size, power-of-two rounding and a capacity small enough to run out."""
    import random

    from memplan.model.allocator import CachingAllocator

    cap = 300 * MiB if conf == "capacity" else None
    cfg = parse_alloc_conf("" if conf == "capacity" else conf, cap)
    rng = random.Random(20261204)
    sizes = [300, 70_000, 900 * 1024, 3 * MiB, 5 * MiB + 7, 11 * MiB, 24 * MiB, 64 * MiB,
             70 * MiB, 84 * MiB]
    fast, found = [], 0
    sequences = []
    for _ in range(40):
        events, live, key = [], [], 0
        for _ in range(rng.randint(30, 90)):
            if rng.random() < 0.55 or not live:
                events.append(Alloc(key, rng.choice(sizes), rng.choice([0, 0, 1])))
                live.append(key)
                key += 1
            else:
                events.append(Free(live.pop(rng.randrange(len(live)))))
        sequences.append(events)
        fast.append(replay(events, cfg))
    fit = CachingAllocator._fit

    def counted(self, *args):
        nonlocal found
        got = fit(self, *args)
        found += got
        return got

    monkeypatch.setattr(CachingAllocator, "_fit", counted)
    for events in sequences:
        replay(events, cfg)
    assert found > 200  # the one-pass path ran
    monkeypatch.setattr(CachingAllocator, "_fit", lambda self, *args: False)
    assert [replay(events, cfg) for events in sequences] == fast
    assert any(r.out_of_memory for r in fast) == (conf == "capacity")


def test_a_blip_that_surely_fits_is_known_to_leave_nothing() -> None:
    """``blip_leaves_nothing``: one 100 MiB segment, free (a 100 MiB tensor made and freed:
    100 MiB is over kMinLargeAlloc, so cudaMalloc takes it rounded to 2 MiB, 100 MiB). Two
    40 MiB tensors need 2 x (40 MiB + kSmallSize + 1) = 82 MiB + 2 B <= 100 MiB: sure. Two of
    49.5 MiB need 2 x (49.5 + 1) MiB + 2 B = 101 MiB + 2 B > 100 MiB: not sure (best fit
    would still take both from the block: 99 MiB; the check is sufficient only). A 512 KiB
    tensor is the small pool's, which has no block: not sure. Under max_split_size or
    expandable segments it never answers. The second rule, blocks that each hold some of
    the tensors, below."""
    from memplan.model.allocator import CachingAllocator

    def seeded(cfg: AllocatorConfig) -> CachingAllocator:
        alloc = CachingAllocator(cfg)
        assert alloc.malloc(0, 100 * MiB)
        alloc.free(0)
        assert alloc.reserved == 100 * MiB
        return alloc

    alloc = seeded(AllocatorConfig())
    assert alloc.blip_leaves_nothing([(40 * MiB, 2)])
    assert not alloc.blip_leaves_nothing([(99 * MiB // 2, 2)])
    assert not alloc.blip_leaves_nothing([(512 * 1024, 1)])
    assert not alloc.blip_leaves_nothing([(40 * MiB, 2)], stream=1)
    # three free 30 MiB segments (three tensors made, then freed): three 25 MiB tensors need
    # 78 MiB + 3 B, over the largest block, but each block holds floor(30 MiB / (25 MiB +
    # kSmallSize + 1)) = 1 of them: 3, sure; a fourth would need a segment (5 MiB is left of
    # each): not sure. It takes a segment of 25 MiB rounded to 2 MiB, 26 MiB, whose 1 MiB
    # left is not over kSmallSize, so not split: allocated 3 x 25 + 26 = 101 MiB
    alloc = CachingAllocator(AllocatorConfig())
    for key in range(3):
        assert alloc.malloc(key, 30 * MiB)
    for key in range(3):
        alloc.free(key)
    assert alloc.reserved == 90 * MiB
    assert alloc.blip_leaves_nothing([(25 * MiB, 3)])
    assert not alloc.blip_leaves_nothing([(25 * MiB, 4)])
    assert alloc.blip([(25 * MiB, 4)]) == ([(116 * MiB, 101 * MiB)], 101 * MiB)
    assert not seeded(parse_alloc_conf("max_split_size_mb:200")).blip_leaves_nothing(
        [(40 * MiB, 1)])
    assert not seeded(parse_alloc_conf("expandable_segments:True")).blip_leaves_nothing(
        [(40 * MiB, 1)])


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:40", "roundup_power2_divisions:4",
                                  "expandable_segments:True", "capacity"])
def test_the_reserved_replay_is_the_replay_read_at_marks(conf: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A property over seeded random sequences (blips repeated beside tensors kept and freed,
    as a stage's sequence has them): ``replay_reserved`` gives ``replay``'s reserved bytes at
    every mark, its reserved peak and the same out-of-memory event, though it passes over
    the blips ``blip_leaves_nothing`` is sure of (it does: the count of blips it replayed
    through ``blip`` is checked), under each configuration and a capacity that runs out."""
    import random

    from memplan.model import allocator
    from memplan.model.allocator import Blip, replay_reserved

    cap = 600 * MiB if conf == "capacity" else None
    cfg = parse_alloc_conf("" if conf == "capacity" else conf, cap)
    rng = random.Random(20261205)
    sizes = [300, 900 * 1024, 5 * MiB + 7, 12 * MiB + 5 * 1024, 24 * MiB, 64 * MiB]
    passed_over = ran_out = replayed = 0
    whole = allocator.CachingAllocator.blip

    def counted(self, runs, stream=0):  # type: ignore[no-untyped-def]
        nonlocal replayed
        replayed += 1
        return whole(self, runs, stream)

    for _ in range(60):
        events, live, key = [], [], 0
        blip = Blip((rng.choice(sizes),), 0)
        for _ in range(rng.randint(20, 80)):
            roll = rng.random()
            if roll < 0.35:
                events.append(Alloc(key, rng.choice(sizes), rng.choice([0, 0, 1])))
                live.append(key)
                key += 1
            elif roll < 0.6 and live:
                events.append(Free(live.pop(rng.randrange(len(live)))))
            elif roll < 0.7:
                blip = Blip((rng.choice(sizes), rng.choice(sizes)), rng.choice([0, 0, 1]),
                            (rng.randint(1, 8), 1))
                events.append(blip)
            else:
                events.append(blip)
        marks = sorted(rng.sample(range(len(events) + 1), 4))
        full = replay(events, cfg)
        got = full.reserved_bytes
        want = tuple(got[min(m, len(got)) - 1] if m and got else 0 for m in marks)
        replayed = 0
        with monkeypatch.context() as patch:
            patch.setattr(allocator.CachingAllocator, "blip", counted)
            quick = replay_reserved(events, cfg, marks)
        assert quick == (want, full.reserved_peak_bytes, full.oom_event)
        reached = events if full.oom_event is None else events[:full.oom_event + 1]
        passed_over += sum(type(e) is Blip for e in reached) - replayed
        ran_out += full.out_of_memory
    assert ran_out > 0 if conf == "capacity" else ran_out == 0
    assert passed_over > 100 if conf in ("", "roundup_power2_divisions:4", "capacity") else (
        passed_over == 0)


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:40", "capacity",
                                  "max_split_size_mb:40,capacity"])
def test_the_inline_reserved_replay_is_the_replay_event_for_event(
        conf: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A property over seeded random sequences that reach every step ``replay_reserved``
    takes inline (``allocator._replay_fast``: best fit from the cache with and without a
    split, a new segment of each size class, a free merging with either neighbour, a blip
    of one tensor or a run and one more passed over or replayed, in one pool or across
    both, on two streams): with marks after every event, its reserved bytes after each
    event, its reserved peak and its out-of-memory event are ``replay``'s (whose steps are
    ``malloc``, ``free`` and ``blip``), under each configuration and a capacity that runs
    out. The inline steps ran: without a capacity, none of ``replay_reserved``'s
    allocations went to the allocator's own ``_malloc_uncached``."""
    import random

    from memplan.model import allocator
    from memplan.model.allocator import Blip, replay_reserved

    cap = 700 * MiB if "capacity" in conf else None
    cfg = parse_alloc_conf(conf.replace("capacity", "").strip(","), cap)
    rng = random.Random(20261206)
    # around each boundary: kMinBlockSize, kSmallSize, kMinLargeAlloc, kLargeBuffer
    sizes = [1, 511, 512, 513, 4096, MiB - 1, MiB, MiB + 1, 3 * MiB, 10 * MiB - 1, 10 * MiB,
             10 * MiB + 1, 19 * MiB, 20 * MiB + 3, 33 * MiB, 70 * MiB]
    calls = ran_out = 0
    uncached = allocator.CachingAllocator._malloc_uncached
    quick_run = False

    def counted(self, *args):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += quick_run
        return uncached(self, *args)

    monkeypatch.setattr(allocator.CachingAllocator, "_malloc_uncached", counted)
    for _ in range(80):
        events, live, key = [], [], 0
        for _ in range(rng.randint(30, 120)):
            roll, stream = rng.random(), rng.choice([0, 0, 0, 1])
            if roll < 0.4:
                events.append(Alloc(key, rng.choice(sizes), stream))
                live.append(key)
                key += 1
            elif roll < 0.7 and live:
                events.append(Free(live.pop(rng.randrange(len(live)))))
            elif roll < 0.8:
                events.append(Blip((rng.choice(sizes),), stream))
            elif roll < 0.92:
                events.append(Blip((rng.choice(sizes), rng.choice(sizes)), stream,
                                   (rng.randint(1, 12), 1)))
            else:
                events.append(Blip(tuple(rng.choice(sizes) for _ in range(rng.randint(2, 5))),
                                   stream))
        full = replay(events, cfg)
        got = full.reserved_bytes
        marks = list(range(len(events) + 2))
        want = tuple(got[min(m, len(got)) - 1] if m and got else 0 for m in marks)
        quick_run = True
        quick = replay_reserved(events, cfg, marks)
        quick_run = False
        assert quick == (want, full.reserved_peak_bytes, full.oom_event)
        ran_out += full.out_of_memory
    assert ran_out > 0 if "capacity" in conf else ran_out == 0
    assert calls > 0 if "capacity" in conf else calls == 0


def test_a_blips_taken_blocks_kept_as_runs_answer_as_the_set_of_them() -> None:
    """``_take`` and ``_taken_after`` (the pool indices a blip took, as runs) against the
    plain set of those indices, over seeded random takes of one index or a stretch (as
    ``_blip_one``/``_blip_carve`` and ``_blip_row`` take them: a stretch of untaken indices
    up to the next taken one): the first untaken index from any i and the next taken after
    it, and the runs never touching."""
    import random

    from memplan.model.allocator import NO_LIMIT, _take, _taken_after

    rng = random.Random(20261206)
    for _ in range(200):
        starts, ends, taken = [], [], set()
        for _ in range(rng.randint(1, 30)):
            i, nxt = _taken_after(starts, ends, rng.randrange(60))
            k = min(nxt, i + rng.choice([1, 1, rng.randint(1, 20)]))
            _take(starts, ends, i, k)
            taken.update(range(i, k))
            assert all(e < s for e, s in zip(ends, starts[1:]))  # apart, in order
            assert {x for s, e in zip(starts, ends) for x in range(s, e)} == taken
            for q in range(90):
                free = next(x for x in range(q, 200) if x not in taken)
                after = min((x for x in taken if x > free), default=NO_LIMIT)
                assert _taken_after(starts, ends, q) == (free, after)
