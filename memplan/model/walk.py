"""One micro-batch's forward and backward on one pipeline stage, as sequences of moments.

A stage's forward and its backward are each a list of ``Segment``s in execution order
(``memplan.model.moments``): the layers, in runs of identical ones (``memplan.model.layer.
LayerKind``: dense or MoE, and their recompute policy), the head (``HeadBlock``, with the
logits the training loop holds) and the embedding (``EmbeddingBlock``) emit their own events;
the data-parallel mechanism (``memplan.model.sharding``) says what it holds beside each and
adds its own instants (at the step's end too), with positions in a run that differ (a run's
first and last layer) as segments of their own. This module only lays them side by side in
order; ``memplan.model.moments.fold`` walks them.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import groupby
from typing import NamedTuple

from memplan.model.embedding import EmbeddingBlock
from memplan.model.head import HeadBlock
from memplan.model.layer import LayerKind
from memplan.model.moments import Event, Segment, fold, peak_of
from memplan.model.sharding import (
    DataParallel,
    Held,
    Position,
    end_moments,
    forward_positions,
    head_hook,
    head_moments,
    held_after,
    positions_key,
    run_positions,
    step_end_moments,
)


class Walk(NamedTuple):
    """Inputs of the backward walk of one stage (one micro-batch, bytes)."""

    runs: list[tuple[LayerKind, int, tuple[int, ...], int]]  # (kind, grads, grads at each
    #                                                          of its moments, count)
    other_bytes: int  # activations of the other micro-batches in flight, kept throughout
    rest_saved: int  # rope tables, embedding ids, the batch: alive until the backward ends
    head: HeadBlock
    embedding: EmbeddingBlock
    sharding: DataParallel


def forward_peak(runs: list[tuple[LayerKind, int, tuple[int, ...], int]], before: int,
                 head: HeadBlock, dp: DataParallel, steady: bool = False) -> int:
    """Largest activation bytes alive during one micro-batch's forward on a stage: the fold
    (``memplan.model.moments.fold``) of its layers' ``forward_segments`` and the head's.

    ``before``: bytes alive before its first layer (other micro-batches in flight, rope tables,
    embedding ids). ``steady``: from step 2 on, where a loop still holds the previous step's
    logits (``HeadBlock.previous_logits``) until the loss. ``dp``: the data-parallel
    mechanism (its gathered weights).
    """
    return forward_peaks(runs, dp, 0, before, head)(steady)


def forward_peaks(runs: list[tuple[LayerKind, int, tuple[int, ...], int]], dp: DataParallel,
                  in_flight: int, inputs: int, head: HeadBlock) -> Callable[[bool], int]:
    """``forward_peak`` as a function of ``steady``: the fold of ``forward_segments`` (from
    ``in_flight``, ``inputs`` and the logits the loop holds from the previous step), then the
    head's segment where the stage has one; the layers' segments are built once."""
    # a fold moves with the bytes alive where it starts: the layers are folded once, from
    # nothing alive, and each start (``forward_start``'s bytes, its one instant) added
    layers_peak, layers_alive = fold(_layer_forward_segments(runs, dp, head.embeds_held,
                                                             head.embeds_copy))
    tail = head.forward_saved > 0  # a final norm and a loss on this stage
    # ``steady`` changes the segments only through the logits held from the previous step
    differs = head.previous_logits(True) != head.previous_logits(False)
    folded: dict[bool, int] = {}

    def peak(steady: bool) -> int:
        steady = steady and differs
        if steady not in folded:
            start = in_flight + inputs + head.previous_logits(steady)
            top = start if layers_peak is None else max(start, start + layers_peak)
            if tail:
                end = fold([head.forward_segment(dp.at_loss_forward, steady)],
                           start + layers_alive)[0]
                top = top if end is None else max(top, end)
            folded[steady] = top
        return folded[steady]

    return peak


def forward_start(in_flight: int, inputs: int, held: int = 0) -> Segment:
    """What is alive when a micro-batch's forward starts on a stage: the activations of the
    ``in_flight`` other micro-batches the pipeline schedule keeps, the stage's ``inputs``
    (rope tables, embedding ids, targets), the logits the training loop still holds from the
    previous step (``held``)."""
    return Segment((Event("pipeline.in_flight", in_flight, None),
                    Event("stage.inputs", inputs, None), Event("loop.logits", held, None),
                    Event("stage.start", 0, 0)))


def forward_segments(runs: list[tuple[LayerKind, int, tuple[int, ...], int]],
                     dp: DataParallel, in_flight: int, inputs: int,
                     held: int = 0, embeds: int = 0) -> list[Segment]:
    """One micro-batch's forward on a stage up to its last layer, in execution order: what
    is alive at its start (``forward_start``), then each run of identical layers: the
    mechanism's instant before a layer (a gather), the layer's compute beside what the
    mechanism holds, after which its saved and cached bytes stay. ``embeds``: the
    embedding's output the model's forward keeps from its first layer on
    (``HeadBlock.embeds_held``: the first layer's input, counted in it, stays alive after
    it)."""
    return [forward_start(in_flight, inputs, held), *_layer_forward_segments(runs, dp, embeds)]


def _layer_forward_segments(runs: list[tuple[LayerKind, int, tuple[int, ...], int]],
                            dp: DataParallel, embeds: int = 0,
                            copy: bool = False) -> list[Segment]:
    """``forward_segments`` after its start: each run of identical layers (``embeds``:
    ``forward_segments``'; ``copy``: held beside the first layer too, ``HeadBlock.
    embeds_copy``)."""
    segments: list[Segment] = []
    last = len(runs) - 1
    built: dict[tuple, list[Segment]] = {}  # a hybrid's repeating kinds built once each
    for index, (kind, _, _, n) in enumerate(runs):
        key = (id(kind), n, index == 0, index == last)
        run = built.get(key) if last > 1 else None
        if run is None:
            # autocast's cached casts of the layers before stay until the forward ends
            held_bytes, peak = kind.saved_bytes + kind.cached_bytes, kind.forward_peak_bytes
            run = built[key] = []
            for p in forward_positions(dp, n, index == 0, index == last):
                compute = Event("layer.forward", held_bytes,
                                dp.layer_forward(kind.forward_blocks, peak, p.beside))
                run.append(Segment((p.before, compute) if p.before else (compute,), p.repeat))
            if embeds and index == 0:
                run[:1] = _embeds_kept(run[0], embeds, copy)
        segments += run
    return segments


def _embeds_kept(first: Segment, embeds: int, copy: bool = False) -> list[Segment]:
    """The stage's first position with the embedding's output kept after its first layer
    (with ``copy``, from before it)."""
    events, repeat = first
    held = Event("loop.inputs_embeds", embeds, None)
    kept = Segment((held, *events) if copy else (*events, held))
    return [kept, Segment(events, repeat - 1)] if repeat > 1 else [kept]


def backward_peak(w: Walk, grads_prior: int, grads_total: int) -> int:
    """Largest bytes alive (activations + gradients + transients) during one backward: the fold
    of ``backward_segments``."""
    return peak_of(_backward_moments(w, grads_prior, grads_total),
                   sum(_start_bytes(w, grads_prior)))


def backward_segments(w: Walk, grads_prior: int, grads_total: int) -> list[Segment]:
    """One micro-batch's backward on a stage, in execution order from nothing alive: what is
    alive when it starts, the loss and the head, each run of identical layers (last to
    first), the embedding; the data-parallel mechanism's moments (``memplan.model.sharding``)
    beside and between them, and its own at the step's end after them.

    ``grads_prior`` is what exists when it starts: 0 for a step's only micro-batch, all
    gradients when earlier micro-batches produced them (they then accumulate in place);
    ``grads_total``: all of them when it ends."""
    return [backward_start(w, grads_prior), *_backward_moments(w, grads_prior, grads_total)]


def backward_start(w: Walk, grads_prior: int) -> Segment:
    """What is alive when a micro-batch's backward starts on a stage: the other micro-batches'
    activations the pipeline schedule keeps, the stage's inputs, every byte this micro-batch
    saved, the logits the training loop keeps from the loss (``HeadBlock.loop_logits``) and
    the gradients it kept or earlier micro-batches made."""
    names = ("pipeline.in_flight", "stage.inputs", "stage.saved", "loop.logits",
             "loop.gradients")
    return Segment(tuple(Event(name, size, None)
                         for name, size in zip(names, _start_bytes(w, grads_prior))))


def _start_bytes(w: Walk, grads_prior: int) -> tuple[int, int, int, int, int]:
    """``backward_start``'s bytes, in its order (the fold starts from their sum)."""
    return (w.other_bytes, w.rest_saved,
            w.head.saved_bytes + sum(k.saved_bytes * n for k, _, _, n in w.runs),
            w.head.backward_held(), grads_prior)  # (``HeadBlock.loop_logits``)


def _backward_moments(w: Walk, grads_prior: int, grads_total: int) -> list[Segment]:
    """``backward_segments`` after its start."""
    h, emb, dp = w.head, w.embedding, w.sharding
    growing = grads_prior == 0
    first, held = _head_segment(w, growing)
    segments = [first]
    made = grads_prior + (h.grads if growing else 0)  # gradients held
    step = 1 if growing else 0
    last = len(w.runs) - 1
    # a run's segments, by what decides them: a hybrid's repeating kinds are built once each
    # (a kind can recur only among three runs or more)
    built: dict[tuple, list[Segment]] | None = {} if len(w.runs) > 2 else None
    for index, (kind, layer_grads, moment_grads, n) in enumerate(reversed(w.runs)):
        key = runs = None
        if built is not None:
            key = (id(kind), layer_grads, moment_grads, n, index == last,
                   positions_key(dp, held, n))
            runs = built.get(key)
        if runs is None:
            positions, after = run_positions(dp, held, layer_grads, max(moment_grads), n,
                                             growing, index == last)
            runs = _run_segments(dp, kind, moment_grads, growing, positions, step * layer_grads)
            if built is not None:
                built[key] = runs
        else:
            after = held_after(dp, held, layer_grads, n)
        segments += runs
        held = after
        made += n * step * layer_grads
    beside, after = end_moments(dp, held, h.grads, emb.grads, growing, h.tied_grad > 0)
    if not growing and dp.fresh_grad:  # its new gradient beside the accumulated one
        beside += emb.fresh
    # the tied head's pending gradient is summed into the embedding's
    segments.append(Segment((*emb.backward_events(made + h.tied_grad, grads_total, beside),
                             *after)))
    end = step_end_moments(dp, w.other_bytes, emb.freed_before)
    return [*segments, Segment(end)] if end else segments


def _run_segments(dp: DataParallel, kind: LayerKind, moment_grads: tuple[int, ...],
                  growing: bool, positions: list[Position], step: int) -> list[Segment]:
    """A run's segments, one per position (``_layer_segment``), the layer's own peak
    (``DataParallel.block_peak``) computed once per distinct (reduce, gathers, beside)."""
    local: dict[tuple, int] = {}
    out = []
    for p in positions:
        key = (p.reduce, p.gathers, p.beside)
        peak = local.get(key)
        if peak is None:
            peak = local[key] = dp.block_peak(kind.moments, moment_grads, growing, *key)
        out.append(_layer_segment(p, kind.saved_bytes, peak, step))
    return out


def _head_segment(w: Walk, growing: bool) -> tuple[Segment, Held]:
    """The backward's first segment (the loss, the head, the mechanism's instants there) and
    what the mechanism carries on to the blocks."""
    h, dp = w.head, w.sharding
    # the gradients the loss call made are reduced there: the head's unit reduces the rest
    beside, after, held = head_moments(dp, h.grads - h.loss_made)
    return Segment((*h.backward_events(dp.at_loss, dp.at_head, beside, growing, head_hook(dp),
                                       dp.at_final_norm),
                    *after)), held


def backward_head_peak(w: Walk, grads_prior: int) -> int:
    """``backward_peak``'s fold over its first segment alone (the loss and the head, every
    byte the micro-batch saved still alive): a prefix of the same fold, so never above it."""
    return peak_of([_head_segment(w, grads_prior == 0)[0]], sum(_start_bytes(w, grads_prior)))


def _layer_segment(position: Position, saved: int, local: int, step: int) -> Segment:
    """``position.repeat`` layers in backward: the mechanism's instant before (their saved
    bytes alive), their own peak (``local``, which counts what of their saved bytes is still
    alive) beside what the mechanism holds, its instant after; each frees its ``saved`` bytes
    and keeps ``step`` bytes of gradients."""
    before, after, beside = position.before, position.after, position.beside
    if before is None and after is None:  # the layer's saved bytes counted in its peak
        return Segment((Event("layer.backward", step - saved, local - saved + beside),),
                       position.repeat)
    start = (Event(before.name, -saved, before.transient) if before
             else Event("layer.release", -saved, None))
    if after is None:
        return Segment((start, Event("layer.backward", step, local + beside)), position.repeat)
    return Segment((start, Event("layer.backward", 0, local + beside),
                    Event(after.name, step + after.delta, after.transient)), position.repeat)


def runs_of(keys: list) -> list[tuple[object, int]]:
    """Run-length encoding of a list."""
    return [(key, len(list(group))) for key, group in groupby(keys)]


def first_positions(keys: list) -> dict:
    """Each distinct key with the position of its first occurrence."""
    if len(keys) and keys[0] == keys[-1] and keys.count(keys[0]) == len(keys):
        return {keys[0]: 0}
    out: dict = {}
    for pos, key in enumerate(keys):
        out.setdefault(key, pos)
    return out
