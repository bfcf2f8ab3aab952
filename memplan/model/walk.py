"""The walks through one micro-batch's forward and backward on one pipeline stage.

A stage's layers come in few kinds (``memplan.model.layer.LayerKind``: dense or MoE, and their
recompute policy). The walks visit the layers in execution order, in runs of identical layers,
adding what is alive before each layer to its local peaks: the forward as saved bytes
accumulate, the backward as they are freed and gradients appear.
"""

from __future__ import annotations

from itertools import groupby
from typing import NamedTuple

from memplan.model.layer import LayerKind
from memplan.model.moments import Segment, change, instant, peak_of


class HeadBackward(NamedTuple):
    """The last stage's head in backward, bytes (all 0 on other stages)."""

    saved: int  # the final norm's and the loss's saved terms
    loss: int  # in the loss's backward, beyond what is saved
    linear: int  # at the head projection's backward: logits grad in the compute dtype, input
    #              grad and the head's weight grad
    main_grads: int  # fp32 main gradients: at the head's fp32 copy, beyond what is saved below
    #                  the final norm (its saved tensors but the output, the input gradient,
    #                  the compute-dtype and fp32 weight gradients)
    grads: int  # the final norm's and head's gradients as held
    final_norm_saved: int  # what of the final norm is saved when its backward runs
    final_norm_bwd: int  # gradients in flight inside the final norm's backward
    final_norm_all: int  # all the final norm saves (alive at the head's backward)


class EmbeddingBackward(NamedTuple):
    """The first stage's embedding in backward, bytes (all 0 on other stages)."""

    grads: int  # the embedding's gradients as held
    extra: int  # at its backward, beyond its gradient: a tied head's pending gradient and the
    #             sum; the compute-dtype copy beside an fp32 main grad
    tied_pending: int  # a tied head's weight gradient, held until the embedding's backward
    freed_before: int  # of the walk's ``rest_saved``: freed before the stage's last gradient
    #                    (rope tables, a checkpointed mask, dropout mask)


class GradSharding(NamedTuple):
    """How ZeRO-2/3 and FSDP2 hold gradients and weights during the backward."""

    buffer: int  # ZeRO-2/3 unsharded gradients awaiting reduce-scatter, at most
    unsharded_ratio: float  # unsharded / held gradient bytes (the ZeRO-2 shard degree)
    fsdp2: bool = False  # FSDP2: a unit's gradients unsharded until its own reduce-scatter,
    #                      whose input is held (beside its shard) until the next unit's
    unsharded_dtype: float = 1.0  # FSDP2: bytes of an unsharded gradient (the weights'
    #                               dtype) per byte of its reduce dtype
    gathered_in_block: int = 0  # ZeRO-3 gathered weights while a block's backward runs
    gathered_at_loss: int = 0  # ... at the loss and the head
    gathered_at_end: int = 0  # ... at the embedding
    gathered_last_block: int = 0  # ... while the stage's first block (the last in backward)
    #                               runs its backward
    separate_units: bool = False  # FSDP2: the embedding and the head are units of their own,
    #                               each reduce-scattered after its backward
    reduce_copies: int = 0  # FSDP2 at shard degree 1: unit-sized reduce-dtype tensors alive at
    #                         a unit's reduce (its input, its output, which becomes the
    #                         gradient, and a divided copy); 0 where no such moment is modelled
    boundary_grad: int = 0  # ... and the gradient of the unit's input, alive beside them


class Walk(NamedTuple):
    """Inputs of the backward walk of one stage (one micro-batch, bytes)."""

    runs: list[tuple[LayerKind, int, tuple[int, ...], int]]  # (kind, grads, grads at each
    #                                                          of its moments, count)
    other_bytes: int  # activations of the other micro-batches in flight, kept throughout
    rest_saved: int  # rope tables, embedding ids, the batch: alive until the backward ends
    head: HeadBackward
    embedding: EmbeddingBackward
    sharding: GradSharding


def forward_peak(runs: list[tuple[LayerKind, int, tuple[int, ...], int]], before: int,
                  head_saved: int, final_norm: int, loss_extra: int,
                  gathered: tuple[int, int, int, int] = (0, 0, 0, 0), until_loss: int = 0,
                  upcast: int = 0) -> int:
    """Largest activation bytes alive during one micro-batch's forward on a stage: the fold
    (``memplan.model.moments.fold``) of ``forward_segments``.

    ``before``: bytes alive before its first layer (other micro-batches in flight, rope tables,
    embedding ids). Then the final norm and the loss (last stage). ``until_loss``: bytes
    alive until the loss starts (the previous step's logits a loop still holds); ``upcast``:
    the final norm's saved terms and the new logits made beside the held ones before the loss
    (``memplan.model.head.upcast_bytes``; 0 when no loop holds logits). ``gathered``: ZeRO-3
    weights gathered while a block runs and at the loss, and, where modelled, at a block's
    start (its gather, before its compute) and at the stage's first block's start
    (``ShardingBuffers.forward_start_bytes``).
    """
    head = (head_saved, final_norm, loss_extra, upcast) if head_saved else None
    return peak_of(forward_segments(runs, gathered, until_loss, head), before + until_loss)


def forward_segments(runs: list[tuple[LayerKind, int, tuple[int, ...], int]],
                     gathered: tuple[int, int, int, int], until_loss: int,
                     head: tuple[int, int, int, int] | None) -> list[Segment]:
    """One micro-batch's forward on a stage, in execution order: the stage's start, each
    run of identical layers (a block's gather where modelled, then its compute, after which
    its saved and cached bytes stay), then the final norm, the held logits freed and the
    loss (``head``: its saved bytes, the final norm's, the loss's beyond them, the upcast).
    ``gathered`` and ``until_loss`` as in ``forward_peak``."""
    in_block, at_loss, at_start, at_first_start = gathered
    segments = [Segment((instant("stage.start", 0),))]
    for index, (kind, _, _, n) in enumerate(runs):
        # autocast's cached casts of the layers before stay until the forward ends
        compute = instant("layer.forward", kind.forward_peak_bytes + in_block,
                          kind.saved_bytes + kind.cached_bytes)
        if not (at_start or at_first_start):
            segments.append(Segment((compute,), n))
            continue
        start = instant("layer.gather", at_start)
        if index == 0:  # the stage's first block gathers beside the root's or embedding's
            segments.append(Segment((instant("layer.gather", at_first_start), compute)))
            n -= 1
        segments.append(Segment((start, compute), n))
    if head is not None:
        head_saved, final_norm, loss_extra, upcast = head
        segments.append(Segment((
            instant("final_norm.forward", final_norm + at_loss),
            instant("loss.upcast", upcast + at_loss),
            change("loop.logits_released", -until_loss),
            instant("loss.forward", head_saved + loss_extra + at_loss))))
    return segments


def backward_peak(w: Walk, grads_prior: int, grads_total: int) -> int:
    """Largest bytes alive (activations + gradients + transients) during one backward.

    ``grads_prior`` is what exists when it starts: 0 for a step's only micro-batch, all
    gradients when earlier micro-batches produced them (they then accumulate in place).
    Layers are walked last to first in runs of identical layers; within a run the bytes
    alive change by the same amount per layer, so the run's largest moment is at one end.
    """
    h, emb, sh = w.head, w.embedding, w.sharding
    growing = grads_prior == 0
    acts = (w.other_bytes + w.rest_saved + h.saved
            + sum(k.saved_bytes * n for k, _, _, n in w.runs))
    grads = grads_prior
    peak = sh.gathered_at_loss + max(acts + grads + h.loss,
                                    acts - h.saved + h.final_norm_all + grads
                                    + h.linear,
                                    acts - h.saved + grads + h.main_grads)
    acts -= h.saved
    grads += h.grads if growing else 0
    produced = h.grads  # this backward's gradients so far (the ZeRO buffer holds them)

    def buffer(made: int) -> int:
        # Gradients not yet reduce-scattered are held unsharded instead of as this rank's
        # shard: the extra is the unsharded size minus the shard they will become.
        waiting = min(sh.buffer, int(made * sh.unsharded_ratio))
        return waiting - int(waiting / sh.unsharded_ratio) if sh.unsharded_ratio > 1 else waiting

    fsdp2, done = sh.fsdp2, 0  # blocks whose reduce-scatter input may still be held

    def root(made: int) -> int:
        # FSDP2's root (embedding, final norm, head) reduce-scatters at the end of backward:
        # until then its gradients are unsharded, in the weights' dtype
        return int(made * sh.unsharded_ratio * sh.unsharded_dtype) - made

    if h.final_norm_bwd:  # the head's weight gradient exists; the norm's own comes after
        peak = max(peak, acts + h.final_norm_saved + grads + emb.tied_pending + h.final_norm_bwd
                   + (root(produced) if fsdp2 else buffer(produced)) + sh.gathered_at_loss)
    pending = emb.tied_pending  # a tied head's weight grad waits for the embedding's
    root_held = root(h.grads) if fsdp2 and not sh.separate_units else 0
    # the head's own unit: its reduce-scatter input (unsharded, in the reduce dtype) is held
    # until the first block's reduce-scatter, as a block's is until the next one's
    previous = int(h.grads * sh.unsharded_ratio) if sh.separate_units else 0
    # the reduce-scatter input held while a block runs is the unit's before it in backward:
    # the head's (above) for the first block, then a block's of its own size (not the largest
    # unit's: an embedding or a root outweighs a block where the vocabulary is large)
    prev_input = previous

    def reduced(unit: int) -> int:
        # a unit's reduce at shard degree 1, beyond the gradients held before it
        return sh.reduce_copies * int(unit * sh.unsharded_ratio) + sh.boundary_grad

    if sh.reduce_copies and sh.separate_units:  # the head's unit, after its backward
        peak = max(peak, acts + grads - h.grads + pending + reduced(h.grads))
    last_run = len(w.runs) - 1
    for index, (kind, layer_grads, moment_grads, n) in enumerate(reversed(w.runs)):
        step_grads = layer_grads if growing else 0
        # Before the layer's backward its own saved bytes are part of ``acts``; each moment
        # counts what of them (or of their recomputation) is still alive.
        below = acts - kind.saved_bytes + grads + pending + sh.gathered_in_block
        if fsdp2:
            # FSDP2: at each moment this unit's gradients so far exist unsharded (its shard
            # comes with its reduce-scatter), beside the previous unit's whole reduce input
            local = max(m.alive_bytes + m.transient_bytes
                        + int(min(sh.buffer, g * sh.unsharded_ratio) * sh.unsharded_dtype)
                        for m, g in zip(kind.moments, moment_grads))
            run_input = int(layer_grads * sh.unsharded_ratio)
            first_buffer = root_held + prev_input
            last_buffer = root_held + (run_input if n > 1 else prev_input)
        else:  # one buffer of the gradients made so far
            local = max(m.alive_bytes + m.transient_bytes + (g if growing else 0)
                        for m, g in zip(kind.moments, moment_grads))
            early = max(moment_grads)
            first_buffer = buffer(produced + early)
            last_buffer = buffer(produced + (n - 1) * layer_grads + early)
        first_moment = below + local + first_buffer
        last_moment = below + local + (n - 1) * (step_grads - kind.saved_bytes) + last_buffer
        if index == last_run:  # the stage's first block: what its backward prefetches differs
            last_moment += sh.gathered_last_block - sh.gathered_in_block
            if n == 1:
                first_moment = last_moment
        peak = max(peak, first_moment, last_moment)
        if fsdp2 and n > 2:
            # FSDP2's buffers are not the same for every block of a run: the first block in
            # backward holds no earlier reduce-scatter input, the stage's first block prefetches
            # no block before it, and the blocks between hold both (a reduce-scatter input and
            # the all-gather output of the block their backward prefetches), so the second and
            # the second-to-last blocks are moments of their own (traced: test_ground_truth.py,
            # test_fsdp_backward_between_the_ends_of_a_run)
            for k in {1, n - 2}:
                peak = max(peak, below + local + k * (step_grads - kind.saved_bytes)
                           + root_held + run_input)
        if fsdp2 and not sh.reduce_copies and not sh.separate_units and growing:
            # FSDP2 at a block's reduce-scatter (after its backward, its weights resharded,
            # the previous reduce-scatter input dropped first: FSDPParamGroup.post_backward
            # pops reduce_scatter_states beyond reduce_scatter_max_input_buffers, 1): its
            # unsharded gradients, in the weights' dtype, beside the reduce-dtype input they
            # are copied into (foreach_reduce_scatter_copy_in), the gradient of its input, and
            # the root with the block the backward prefetched (the root alone after the
            # stage's first block)
            unit_grads = int(layer_grads * sh.unsharded_ratio * sh.unsharded_dtype)
            # ... and at its copy-out before its backward (FSDPParamGroup.wait_for_unshard in
            # pre_backward): its all-gather output beside its unsharded weights (the same
            # bytes as its gradients in the weights' dtype), its saved tensors all alive, the
            # previous block's reduce-scatter input still held
            for k in {1, min(2, n), n}:
                peak = max(peak, acts - (k - 1) * kind.saved_bytes + grads
                           + (k - 1) * step_grads + pending + root_held
                           + (prev_input if k == 1 else run_input)
                           + sh.gathered_last_block + unit_grads)
            for k in {1, n}:
                gathered = (sh.gathered_at_end if index == last_run and k == n
                            else sh.gathered_last_block)
                peak = max(peak, acts - k * kind.saved_bytes + grads + (k - 1) * step_grads
                           + pending + root_held + unit_grads + run_input + sh.boundary_grad
                           + gathered)
        if sh.reduce_copies and growing:  # the run's first and last units at their reduce
            #                               (weights resharded, saved tensors freed)
            for k in {1, n}:
                peak = max(peak, acts - k * kind.saved_bytes + grads + (k - 1) * step_grads
                           + pending + root_held + reduced(layer_grads))
        acts -= n * kind.saved_bytes
        grads += n * step_grads
        produced += n * layer_grads
        done += n
        if fsdp2:
            prev_input = int(layer_grads * sh.unsharded_ratio)
    end_grads = grads_total if growing or grads_prior else grads
    end_units = emb.grads if sh.separate_units else h.grads + emb.grads
    end_buffer = (root(end_units) + (prev_input if done else 0) if fsdp2
                  else buffer(produced + emb.grads))
    if fsdp2 and not sh.reduce_copies and not sh.separate_units:
        # FSDP2's root (embedding, final norm, head) at its reduce-scatter after the
        # embedding's backward, its weights resharded (_fsdp_collectives.py foreach_reduce):
        # its unsharded gradients, in the weights' dtype, copied into the reduce-dtype input,
        # then freed (unsharded_grads.clear()) before the output shard is made beside that
        # input. Its shard is new in the first micro-batch; in later ones the output joins it.
        rs_input = int(end_units * sh.unsharded_ratio)
        root_grads = int(end_units * sh.unsharded_ratio * sh.unsharded_dtype)
        after = acts - emb.freed_before
        new_shard = end_units if growing else 0
        peak = max(peak, after + end_grads - new_shard + root_grads + rs_input,
                   after + end_grads + rs_input + (0 if growing else end_units))
    if sh.reduce_copies and sh.separate_units and growing:  # the embedding's unit
        peak = max(peak, acts - emb.freed_before + end_grads - emb.grads + reduced(emb.grads)
                   - sh.boundary_grad)
    return max(peak, acts - emb.freed_before + end_grads + emb.extra + end_buffer
               + sh.gathered_at_end)


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
