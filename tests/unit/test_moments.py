"""The vocabulary of moments and its fold, on hand-made sequences (values derived by hand)."""

from __future__ import annotations

import itertools
import random

from memplan.model.moments import Event, Segment, change, fold, instant, peak_of, unfold


def _unfolded_peak(segments: list[Segment], alive: int = 0) -> int | None:
    """The largest alive + transient, walking every event of every repetition one by one."""
    peak = None
    for event in unfold(segments):
        if event.transient is not None:
            peak = alive + event.transient if peak is None else max(peak, alive + event.transient)
        alive += event.delta
    return peak


def test_one_event() -> None:
    """100 B alive, an instant with 30 B on top that leaves 20 B alive: peak 130, 120 after."""
    assert fold([Segment((instant("a", 30, 20),))], 100) == (130, 120)


def test_a_change_has_no_instant() -> None:
    """A change of +500 B then an instant with 0 on top: the peak is 100 + 500 = 600, never
    the 100 B before the change on its own; a sequence of changes alone has no peak."""
    segments = [Segment((change("made", 500), instant("at", 0)))]
    assert fold(segments, 100) == (600, 600)
    assert fold([Segment((change("freed", -50),))], 100) == (None, 50)
    assert peak_of([Segment((change("freed", -50),))], 100) == 0


def test_growing_run_peaks_at_its_last_repetition() -> None:
    """Each repetition keeps 100 B and peaks 20 B above what it keeps (120 B over its start):
    4 repetitions from 5 B: the last starts at 5 + 300 and peaks at 305 + 120 = 425; 405
    after."""
    segments = [Segment((instant("layer", 120, 100),), 4)]
    assert fold(segments, 5) == (425, 405)


def test_shrinking_run_peaks_at_its_first_repetition() -> None:
    """Each repetition frees 100 B before an instant with 10 B on top, and makes 50 B after:
    from 1000 B the first repetition peaks at 1000 - 100 + 10 = 910, the last (of 3) at
    1000 - 2 * 50 - 100 + 10 = 810; 1000 - 3 * 50 = 850 after."""
    layer = (change("free", -100), instant("moment", 10, 50))
    assert fold([Segment(layer, 3)], 1000) == (910, 850)


def test_zero_repetitions_hold_nothing() -> None:
    assert fold([Segment((instant("a", 99, 7),), 0)], 3) == (None, 3)


def test_fold_matches_the_unfolded_sequence() -> None:
    """On random sequences of segments (deltas and transients of both signs, some events
    without an instant, repeats 0-6), the fold equals the event-by-event walk."""
    rng = random.Random(27)
    for _ in range(500):
        segments = []
        for _ in range(rng.randint(1, 5)):
            events = tuple(Event(f"e{i}", rng.randint(-50, 80),
                                 None if rng.random() < 0.25 else rng.randint(-30, 90))
                           for i in range(rng.randint(1, 4)))
            segments.append(Segment(events, rng.randint(0, 6)))
        alive = rng.randint(0, 100)
        peak, after = fold(segments, alive)
        assert peak == _unfolded_peak(segments, alive)
        assert after == alive + sum(e.delta for e in unfold(segments))


def test_unfold_writes_every_repetition_out() -> None:
    a, b = instant("a", 1), change("b", 2)
    assert list(unfold([Segment((a, b), 2), Segment((b,), 1)])) == [a, b, a, b, b]
    assert list(itertools.islice(unfold([Segment((a,), 3)]), 5)) == [a, a, a]


def test_optimizer_step_holds_every_state_and_its_temporaries() -> None:
    """100 B of weights, 50 B of gradients, 200 B of master copy and moments, DDP's 50 B
    bucket copy, 10 B of buffers, and 30 B of the step's temporaries on top: 440 B; the
    temporaries are gone after it (410 B alive)."""
    from memplan.model.model_states import StateBytes
    from memplan.model.stage_parts import optimizer_step

    st = StateBytes(params_bytes=100, grads_bytes=50, optimizer_bytes=200, master_bytes=0,
                    num_optimizer_params=0)
    assert fold([optimizer_step(st, 30, 50, 10)]) == (440, 410)
