"""One micro-batch's forward and backward on one pipeline stage, as sequences of moments.

A stage's forward and its backward are each a list of ``Segment``s in execution order
(``memplan.model.moments``): the layers, in runs of identical ones (``memplan.model.layer.
LayerKind``: dense or MoE, and their recompute policy), the head (``HeadBlock``) and the
embedding (``EmbeddingBlock``) emit their own events; the data-parallel mechanism
(``memplan.model.sharding``) says what it holds beside each and adds its own instants, with
positions in a run that differ (a run's first and last layer) as segments of their own. This
module only lays them side by side in order; ``memplan.model.moments.fold`` walks them.
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
    Position,
    end_moments,
    forward_positions,
    head_moments,
    run_positions,
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
                 head: HeadBlock, dp: DataParallel, until_loss: int = 0) -> int:
    """Largest activation bytes alive during one micro-batch's forward on a stage: the fold
    (``memplan.model.moments.fold``) of its layers' ``forward_segments`` and the head's.

    ``before``: bytes alive before its first layer (other micro-batches in flight, rope tables,
    embedding ids). ``until_loss``: bytes alive until the loss starts (the previous step's
    logits a loop still holds). ``dp``: the data-parallel mechanism (its gathered weights).
    """
    return forward_peaks(runs, dp, 0, before, head)(until_loss)


def forward_peaks(runs: list[tuple[LayerKind, int, tuple[int, ...], int]], dp: DataParallel,
                  in_flight: int, inputs: int, head: HeadBlock) -> Callable[[int], int]:
    """``forward_peak`` as a function of ``until_loss``, from ``forward_segments``'
    ``in_flight`` and ``inputs``: the layers, the same in every step, folded once from 0 (a
    fold shifts with its start), the head's segment after them from where they leave the
    alive bytes."""
    layers_peak, layers_alive = fold(forward_segments(runs, dp, in_flight, inputs))

    def peak(until_loss: int) -> int:
        # the logits a loop holds from the step's start: alive under every instant
        layers = until_loss + (layers_peak or 0)
        if not head.forward_saved:  # no final norm and loss on this stage
            return layers
        return max(layers, peak_of([head.forward_segment(dp.at_loss_forward, until_loss)],
                                   until_loss + layers_alive))

    return peak


def forward_segments(runs: list[tuple[LayerKind, int, tuple[int, ...], int]],
                     dp: DataParallel, in_flight: int, inputs: int) -> list[Segment]:
    """One micro-batch's forward on a stage up to its last layer, in execution order: what
    is alive at its start (the activations of the ``in_flight`` other micro-batches the
    pipeline schedule keeps, the stage's ``inputs``: rope tables, embedding ids, targets),
    then each run of identical layers: the mechanism's instant before a layer (a gather), the
    layer's compute beside what the mechanism holds, after which its saved and cached bytes
    stay."""
    segments = [Segment((Event("pipeline.in_flight", in_flight, None),
                         Event("stage.inputs", inputs, None), Event("stage.start", 0, 0)))]
    for index, (kind, _, _, n) in enumerate(runs):
        # autocast's cached casts of the layers before stay until the forward ends
        held, peak = kind.saved_bytes + kind.cached_bytes, kind.forward_peak_bytes
        for p in forward_positions(dp, n, index == 0, index == len(runs) - 1):
            compute = Event("layer.forward", held, peak + p.beside)
            segments.append(Segment((p.before, compute) if p.before else (compute,), p.repeat))
    return segments


def backward_peak(w: Walk, grads_prior: int, grads_total: int) -> int:
    """Largest bytes alive (activations + gradients + transients) during one backward: the fold
    of ``backward_segments``."""
    return peak_of(_backward_moments(w, grads_prior, grads_total),
                   sum(_start_bytes(w, grads_prior)))


def backward_segments(w: Walk, grads_prior: int, grads_total: int) -> list[Segment]:
    """One micro-batch's backward on a stage, in execution order from nothing alive: what is
    alive when it starts, the loss and the head, each run of identical layers (last to
    first), the embedding; the data-parallel mechanism's moments (``memplan.model.sharding``)
    beside and between them.

    ``grads_prior`` is what exists when it starts: 0 for a step's only micro-batch, all
    gradients when earlier micro-batches produced them (they then accumulate in place);
    ``grads_total``: all of them when it ends."""
    return [backward_start(w, grads_prior), *_backward_moments(w, grads_prior, grads_total)]


def backward_start(w: Walk, grads_prior: int) -> Segment:
    """What is alive when a micro-batch's backward starts on a stage: the other micro-batches'
    activations the pipeline schedule keeps, the stage's inputs, every byte this micro-batch
    saved, and the gradients the training loop kept or earlier micro-batches made."""
    names = ("pipeline.in_flight", "stage.inputs", "stage.saved", "loop.gradients")
    return Segment(tuple(Event(name, size, None)
                         for name, size in zip(names, _start_bytes(w, grads_prior))))


def _start_bytes(w: Walk, grads_prior: int) -> tuple[int, int, int, int]:
    """``backward_start``'s bytes, in its order (the fold starts from their sum)."""
    return (w.other_bytes, w.rest_saved,
            w.head.saved_bytes + sum(k.saved_bytes * n for k, _, _, n in w.runs), grads_prior)


def _backward_moments(w: Walk, grads_prior: int, grads_total: int) -> list[Segment]:
    """``backward_segments`` after its start."""
    h, emb, dp = w.head, w.embedding, w.sharding
    growing = grads_prior == 0
    # the gradients the loss call made are reduced there: the head's unit reduces the rest
    beside, after, held = head_moments(dp, h.grads - h.loss_made)
    segments = [Segment((*h.backward_events(dp.at_loss, dp.at_head, beside, growing), *after))]
    made = grads_prior + (h.grads if growing else 0)  # gradients held
    for index, (kind, layer_grads, moment_grads, n) in enumerate(reversed(w.runs)):
        positions, held = run_positions(dp, held, layer_grads, max(moment_grads), n, growing,
                                        index == len(w.runs) - 1)
        local = dp.block_peak(kind.moments, moment_grads, growing)
        step = layer_grads if growing else 0
        segments += [_layer_segment(p, kind.saved_bytes, local, step) for p in positions]
        made += n * step
    beside, after = end_moments(dp, held, h.grads, emb.grads, growing)
    # the tied head's pending gradient is summed into the embedding's
    segments.append(Segment((*emb.backward_events(made + h.tied_grad, grads_total, beside),
                             *after)))
    return segments


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
                    Event(after.name, step, after.transient)), position.repeat)


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
