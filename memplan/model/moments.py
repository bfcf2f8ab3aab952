"""The one vocabulary of what a step holds, and the one walk that folds it.

Every part of a training step that holds memory (a layer's blocks, the head, the embedding,
the data-parallel mechanism, the training loop) says so in the same terms: a sequence of
``Event``s in execution order, each with the bytes it leaves alive (``delta``) and the bytes on
top of the alive ones at its instant (``transient``). A ``Segment`` is a run of events repeated
``repeat`` times (a run of identical layers). A stage's forward and its backward are each a list
of segments; ``fold`` walks them once (a running sum of what stays alive, a running max of
alive + transient) and knows nothing of what emitted them; ``unfold`` gives the same sequence
event by event, for readers that replay it tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple


class Event(NamedTuple):
    """One instant of a step, for one rank, in bytes.

    At the instant the bytes alive before the event are held, with ``transient`` on top (a
    kernel's outputs before they are freed, gradients in flight; negative where the instant
    counts something alive in another form); after it ``delta`` more stay alive (negative:
    freed). ``transient`` None: the event only makes or frees bytes, with no instant of its
    own measured (its bytes show at the next instant)."""

    name: str
    delta: int
    transient: int | None


class Segment(NamedTuple):
    """``events`` happening ``repeat`` times in a row (a run of identical layers)."""

    events: tuple[Event, ...]
    repeat: int = 1


def instant(name: str, transient: int, delta: int = 0) -> Event:
    """An event measured at its instant (``Event``)."""
    return Event(name, delta, transient)


def change(name: str, delta: int) -> Event:
    """An event that only makes (``delta`` > 0) or frees bytes, with no instant of its own."""
    return Event(name, delta, None)


def fold(segments: Iterable[Segment], alive: int = 0) -> tuple[int | None, int]:
    """(the largest alive + transient over every instant, the bytes alive after the last
    event), starting from ``alive`` bytes; the peak is None when no event has an instant.

    A segment repeated n times is folded in one pass over its events: one repetition changes
    the alive bytes by D and peaks M above the alive bytes at its start, so repetition k
    (from 0) peaks at alive + k * D + M, largest at k = 0 or k = n - 1."""
    peak: int | None = None
    for events, repeat in segments:
        if repeat <= 0:
            continue
        if len(events) == 1:
            _, run, top = events[0]
        else:
            run, top = 0, None
            for _, delta, transient in events:
                if transient is not None:
                    at = run + transient
                    if top is None or at > top:
                        top = at
                run += delta
        if top is not None:
            top += alive + (repeat - 1) * run if run > 0 else alive
            if peak is None or top > peak:
                peak = top
        alive += repeat * run
    return peak, alive


def peak_of(segments: Iterable[Segment], alive: int = 0) -> int:
    """``fold``'s peak (0 when nothing is measured)."""
    peak = fold(segments, alive)[0]
    return 0 if peak is None else peak


def unfold(segments: Iterable[Segment]) -> Iterator[Event]:
    """The same sequence event by event, every repetition written out."""
    for events, repeat in segments:
        for _ in range(repeat):
            yield from events


def timeline(segments: Iterable[Segment], alive: int = 0) -> Iterator[tuple[str, int, int]]:
    """(name, bytes alive at the instant, alive + transient) of every instant, unfolded (events
    without one only change the alive bytes)."""
    for name, delta, transient in unfold(segments):
        if transient is not None:
            yield name, alive, alive + transient
        alive += delta
