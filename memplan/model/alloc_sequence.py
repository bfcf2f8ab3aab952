"""A stage's allocations and frees, tensor by tensor, in execution order, from the model's moments.

The caching-allocator model (``memplan.model.allocator``) replays a sequence of allocations and
frees; this module derives one for any configuration from what the analytic model already knows
of a pipeline stage (``memplan.model.stage.walk_stage``), without running anything:

- setup: each parameter tensor (the rank's bytes of it, in registration order), the registered
  buffers, the master copy per tensor and what the optimizer makes at construction, DDP's
  gradient buckets, persistent gradient buffers, a pipeline runtime's receive buffers (made at
  step 1's start, before its first forward, with nothing freed since the set-up:
  ``memplan.model.pipeline_buffers``);
- steps 1, 2 and 3, each micro-batch (two at most: a third repeats the second): the forward
  (the stage's inputs, each layer's saved terms as tensors, its local peak beyond them as one
  tensor made and freed, autocast's cached casts until the forward's end, the head's events),
  the backward (the head's and the embedding's events, each layer's backward moments as tensors
  made and freed, its saved terms freed last-saved first, its gradients made per parameter
  tensor as its moments need them), the optimizer step (step 1 makes the states per tensor,
  lazily, as torch.optim's ``_init_group`` does; the step's temporaries per tensor, as a
  foreach implementation's lists; ``zero_grad(set_to_none=True)`` frees the gradients).

What the sequence approximates (said with the estimate's assumptions): a layer's transient peak
is one tensor, made after its saved terms; a moment's gradients in flight one tensor; the
data-parallel mechanism's instants one tensor each on the compute stream; tensors of a
parameter group take the group's bytes in proportion to their elements; a pipeline runtime's
kept outputs and input gradients (``pipeline_buffers.StageBuffers.in_step``) are not replayed,
only its receive buffers and the last stage's output of the micro-batch replayed (``HeadBlock.
pipe_output``). Its own tensor peak is
returned beside the replay, so the allocator's bytes beyond live tensors (rounding, split
remainders, cached free blocks) are read from the replay and the tensor peak from the walk.

Runs of identical layers fold: the allocator reaches a periodic state after a few layers, so a
stage is replayed with a few layers per run and the reserved bytes extrapolated
(``replay_stage``; the period is checked, and a stage replays whole where it is not found).
"""

from __future__ import annotations

from fractions import Fraction
from itertools import accumulate, repeat
from typing import NamedTuple

from memplan.model.adapters import torchao_copy_pieces
from memplan.model.allocator import Alloc, AllocatorConfig, Blip, Free, replay_reserved
from memplan.model.collector import collector_paused
from memplan.model.nf4_init import qlora_setup
from memplan.model.nf4_init import stored_bytes as nf4_stored_bytes
from memplan.model.sharding import Held, end_moments, forward_positions, head_moments, run_positions
from memplan.units import MiB

NUM_STEPS = 3
# torch/nn/parallel/distributed.py: bucket_cap_mb defaults to 25 (the first bucket is 1 MiB,
# kDefaultFirstBucketBytes in reducer.hpp)
DDP_BUCKET_BYTES = 25 * MiB
DDP_FIRST_BUCKET_BYTES = 1 * MiB


_new = tuple.__new__  # a NamedTuple event made without its keyword-checking __new__


class Builder:
    """Allocation events with the bytes alive (unrounded) after each, and their running peak."""

    def __init__(self) -> None:
        self.events: list[Alloc | Free | Blip] = []
        self.sizes: dict[int, int] = {}
        self.alive = 0
        self.peak = 0
        self.marks: list[int] = []  # event count at each step's end
        self._next = 0

    def alloc(self, size: int, stream: int = 0) -> int | None:
        if size <= 0:
            return None
        key = self._next
        self._next = key + 1
        self.events.append(_new(Alloc, (key, size, stream)))
        self.sizes[key] = size
        alive = self.alive = self.alive + size
        if alive > self.peak:
            self.peak = alive
        return key

    def free(self, key: int | None) -> None:
        size = self.sizes.pop(key, None)
        if size is None:
            return
        self.events.append(_new(Free, (key,)))
        self.alive -= size

    def blip(self, size: int, piece: int = 0, stream: int = 0) -> None:
        """Tensors of ``size`` bytes in all made and freed at one instant: pieces of ``piece``
        bytes (a working set of activation-sized tensors), the rest one tensor (0: all one).
        One ``Blip`` event (the allocator model replays it as those allocations and frees)."""
        if size <= 0:
            return
        whole = (size - 1) // piece if piece > 0 else 0  # pieces before the last, smaller one
        last = size - whole * piece
        self.events.append(_new(Blip, ((last,), stream, ())) if not whole else
                           _new(Blip, ((piece, last), stream, (whole, 1))))
        if self.alive + size > self.peak:
            self.peak = self.alive + size

    def made_and_freed(self, sizes: list[int], stream: int = 0) -> None:
        """Tensors of ``sizes`` made in order, then all freed in the same order (none made
        or freed between): one ``Blip`` event; sizes of 0 make nothing."""
        sizes = [n for n in sizes if n > 0]
        if sizes:
            self.events.append(Blip(tuple(sizes), stream))
            self.peak = max(self.peak, self.alive + sum(sizes))

    def mark(self) -> None:
        self.marks.append(len(self.events))


class Stack:
    """Tensors freed last-made first by byte counts: a free of fewer bytes than the top
    tensor waits until the bytes owed cover it."""

    def __init__(self, b: Builder) -> None:
        self.b, self.items, self.debt = b, [], 0

    def push(self, size: int) -> None:
        if size > 0:  # Builder.alloc
            b = self.b
            key = b._next
            b._next = key + 1
            b.events.append(_new(Alloc, (key, size, 0)))
            b.sizes[key] = size
            alive = b.alive = b.alive + size
            if alive > b.peak:
                b.peak = alive
            self.items.append((key, size))

    def push_all(self, sizes) -> None:
        """``push`` each of ``sizes`` in turn (the events, keys and running peak made a
        list at a time)."""
        b = self.b
        sizes = [size for size in sizes if size > 0]
        if not sizes:
            return
        key = b._next
        made = list(zip(range(key, key + len(sizes)), sizes))
        b.events.extend(map(_new, repeat(Alloc), zip(range(key, key + len(sizes)), sizes,
                                                      repeat(0))))
        b.sizes.update(made)
        self.items += made
        b._next = key + len(sizes)
        top = max(accumulate(sizes, initial=b.alive))
        b.alive += sum(sizes)
        if top > b.peak:
            b.peak = top

    def release(self, nbytes: int) -> None:
        debt = self.debt + nbytes if nbytes > 0 else self.debt
        items = self.items
        if items and items[-1][1] <= debt:
            b = self.b
            events, sizes = b.events, b.sizes
            while items and items[-1][1] <= debt:
                key, size = items.pop()
                debt -= size
                if sizes.pop(key, None) is not None:  # Builder.free
                    events.append(_new(Free, (key,)))
                    b.alive -= size
        self.debt = debt

    def clear(self) -> None:
        while self.items:
            self.b.free(self.items.pop()[0])
        self.debt = 0


def split_bytes(total_bytes: int, elements: list[int]) -> list[int]:
    """``total_bytes`` over tensors of ``elements`` each, in proportion (the remainder on the
    last), so the parts sum to the total."""
    n = sum(elements)
    if n <= 0 or total_bytes <= 0:
        return [0] * len(elements)
    parts = [e * total_bytes // n for e in elements]
    if parts:
        parts[-1] += total_bytes - sum(parts)
    return parts


def chunks(total_bytes: int, first: int, each: int) -> list[int]:
    """``total_bytes`` as buckets of ``first``, then ``each`` bytes (the last one smaller)."""
    out, left = [], total_bytes
    size = first
    while left > 0:
        out.append(min(size, left))
        left -= size
        size = each
    return out


class LayerTensors(NamedTuple):
    """One layer's parameter tensors on the rank: elements each, in registration order."""

    elements: tuple[int, ...]


class StageInputs(NamedTuple):
    """What the sequence reads of one stage's walk (``memplan.model.stage``), bytes per rank."""

    walk: object  # memplan.model.walk.Walk
    layers: tuple[LayerTensors, ...]  # per layer, in order
    embed_elements: tuple[int, ...]
    head_elements: tuple[int, ...]
    params_bytes: int
    grad_per_param: int | Fraction
    master_bytes: int
    setup_bytes: int
    states_bytes: int  # optimizer states beyond the master copy and the setup's
    num_states: int  # state tensors per parameter tensor
    opt_temp: int
    first_step_states_late: bool  # step 1 makes the states after the temporaries
    buffers: int
    buckets: int
    persistent_grads: int  # bytes of persistent gradient buffers (0: gradients per tensor)
    microbatches: int
    keep_grads: bool
    piece: int = 0  # bytes of a transient tensor: the residual stream of one micro-batch
    logits_piece: int = 0  # ... at the loss: the logits of one micro-batch
    gather_stream: int = 0  # the stream the data-parallel mechanism's gathers allocate on
    reduce_stream: int = 0  # the stream its sharded gradients are allocated on
    rebuild: tuple[tuple[int, ...], ...] = ()  # per run, the tensors its layers' backward
    #                                           rebuilds first (full recompute), else ()
    nf4_weights: tuple[tuple[int, ...], ...] = ()  # per layer, torchao 0.1 NF4 weights'
    pipeline_buffers: tuple[int, ...] = ()  # a pipeline runtime's receive buffers, each a
    #          tensor (``pipeline_buffers.StageBuffers.tensors``)
    #          elements: the set-up is torchtune's QLoRA one (``memplan.model.nf4_init``)
    nf4_loads: tuple[tuple[int, ...], ...] = ()  # per layer, the elements of each weight the
    #          load's ``copy_`` quantizes (torchao since 0.3: ``adapters.torchao_copy_pieces``)


def _grad_bytes(elements: tuple[int, ...] | list[int], per_param: int | Fraction) -> list[int]:
    return [int(e * per_param) for e in elements]


class _Run:
    """One replayed step sequence's state: the builder and what outlives a micro-batch."""

    def __init__(self, s: StageInputs, caps: tuple[int, ...]) -> None:
        self.s, self.b = s, Builder()
        self.caps = caps  # layers replayed per run
        self.grads: list[int | None] = []
        self.logits: list[int | None] = []
        self.embeds: int | None = None  # the model's forward's inputs_embeds (HeadBlock's)
        self.output: int | None = None  # a pipeline's last stage output (``pipe_output``)
        self.states_made = False


def _setup(r: _Run) -> None:
    """Weights, buffers, master copy, the optimizer's set-up, buckets, persistent gradients,
    a pipeline runtime's receive buffers."""
    s, b = r.s, r.b
    every = [*s.embed_elements, *(e for lt in _layers(r) for e in lt.elements),
             *s.head_elements]
    total = sum(s.embed_elements) + sum(sum(lt.elements) for lt in s.layers) + sum(s.head_elements)
    # each tensor's share of the bytes, rounded down (the elements are not negative)
    if s.nf4_weights:
        _nf4_setup(r)
    elif total:
        for e in every:
            b.alloc(e * s.params_bytes // total)
    b.alloc(s.buffers)
    # torchao's NF4Tensor since 0.3: the checkpoint copied into each quantized weight of the
    # built model, its working set made and freed at once (``copy_``: the moved source
    # quantized in chunks)
    for weights in s.nf4_loads[:len(_layers(r))]:
        for n in weights:
            b.made_and_freed(torchao_copy_pieces(n))
    if total:
        for e in every:
            b.alloc(e * s.master_bytes // total)
    b.alloc(s.setup_bytes)
    scale = _scale(r)
    for size in chunks(int(s.buckets * scale), DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES):
        b.alloc(size)
    b.alloc(int(s.persistent_grads * scale))
    for size in s.pipeline_buffers:  # a stage's, not its layers': not scaled
        b.alloc(size)
    b.mark()


def _nf4_setup(r: _Run) -> None:
    """The parameters as torchtune's QLoRA set-up makes them (``nf4_init.qlora_setup``): the
    NF4 weights through ``to_nf4`` (and the clones' ``get_original_weight``), every other
    tensor (embedding, head, each layer's adapters and norms) its share of the rest."""
    s = r.s
    layers = _layers(r)
    quant = s.nf4_weights[:len(layers)]
    plain = [*s.embed_elements, *s.head_elements,
             *(sum(lt.elements) - sum(q) for lt, q in zip(layers, quant))]
    rest = int(s.params_bytes * _scale(r)) - sum(nf4_stored_bytes(n) for q in quant for n in q)
    qlora_setup(r.b, tuple(quant), split_bytes(max(0, rest), plain))


def _layers(r: _Run) -> list[LayerTensors]:
    """The replayed layers: each run cut to its cap (the walk's runs give the counts)."""
    out: list[LayerTensors] = []
    pos = 0
    for (kind, _, _, n), cap in zip(r.s.walk.runs, r.caps):
        out += r.s.layers[pos:pos + min(n, cap)]
        pos += n
    return out


def _forward(r: _Run, steady: bool, acts: Stack, cached: list[int | None]) -> None:
    """One micro-batch's forward (``memplan.model.walk.forward_segments`` and the head's
    ``forward_segment``), tensor by tensor."""
    w, b = r.s.walk, r.b
    dp = w.sharding
    acts.push(w.other_bytes)
    acts.push(w.rest_saved)
    embeds = w.head.embeds_held  # kept from the first layer on (walk._embeds_kept)
    if embeds and w.head.embeds_copy:  # from before it
        r.embeds = b.alloc(embeds)
        embeds = 0
    for index, ((kind, _, _, n), cap) in enumerate(zip(w.runs, r.caps)):
        count = min(n, cap)
        for p in forward_positions(dp, count, index == 0, index == len(w.runs) - 1):
            for _ in range(p.repeat):
                if p.before is not None and p.before.transient:
                    b.blip(p.before.transient, stream=r.s.gather_stream)
                # one gathered buffer beside the layer
                gathered = b.alloc(p.beside, r.s.gather_stream)
                acts.push_all([term.size_bytes for term in kind.terms])
                cached.append(b.alloc(kind.cached_bytes))
                b.blip(kind.forward_peak_bytes - kind.saved_bytes - kind.cached_bytes,
                       r.s.piece)
                b.free(gathered)
                if embeds:
                    r.embeds = b.alloc(embeds)
                    embeds = 0
    if w.head.forward_saved > 0:
        gathered = b.alloc(dp.at_loss_forward, r.s.gather_stream)
        _head_forward(r, steady, acts)
        b.free(gathered)
    b.free(r.embeds)  # a stage without a final norm: freed when the forward ends
    r.embeds = None


def _head_forward(r: _Run, steady: bool, acts: Stack) -> None:
    b, h, dp = r.b, r.s.walk.head, r.s.walk.sharding
    acts.push(h.saved_bytes)
    for ev in h.forward_segment(0, steady).events:
        if ev.name == "loop.inputs_embeds_released":
            b.free(r.embeds)
            r.embeds = None
        elif ev.name == "loop.logits_released":
            while r.logits:
                b.free(r.logits.pop())
        elif ev.name == "loop.logits_kept":
            r.logits.append(b.alloc(ev.delta))
        elif ev.name == "pipeline.output_released":
            b.free(r.output)
            r.output = None
        elif ev.transient:
            b.blip(ev.transient - h.saved_bytes, r.s.logits_piece)
    # kept from its loss through its backward, until the next forward's (or the step's end)
    b.free(r.output)
    r.output = b.alloc(h.pipe_output)


def _layer_grads(r: _Run, elements: tuple[int, ...], total: int) -> list[int]:
    return split_bytes(total, list(elements))


def _backward(r: _Run, acts: Stack, growing: bool) -> None:
    """One micro-batch's backward (``memplan.model.walk.backward_segments``)."""
    w, b, s = r.s.walk, r.b, r.s
    h, emb, dp = w.head, w.embedding, w.sharding
    _head_backward(r, acts, growing)
    _, _, held = head_moments(dp, h.grads - h.loss_made)
    layers = _layers(r)
    pos = len(layers)
    for index, ((kind, layer_grads, moment_grads, n), cap) in enumerate(
            zip(reversed(w.runs), reversed(r.caps))):
        count = min(n, cap)
        positions, held = run_positions(dp, held, layer_grads, max(moment_grads), count,
                                        growing, index == len(w.runs) - 1)
        rebuild = s.rebuild[len(w.runs) - 1 - index] if s.rebuild else ()
        table = moment_table(kind.moments, 0 if growing else dp.fresh_grad)
        for p in positions:
            for _ in range(p.repeat):
                pos -= 1
                _layer_backward(r, acts, (kind.saved_bytes, table), layers[pos],
                                (layer_grads, moment_grads), (p, rebuild), growing)
    beside, _ = end_moments(dp, held, h.grads, emb.grads, growing, h.tied_grad > 0)
    acts.release(emb.freed_before)
    if growing:
        for size in _layer_grads(r, s.embed_elements, emb.grads):
            r.grads.append(b.alloc(size, s.reduce_stream))
    if not dp.per_unit:
        b.blip(emb.extra + beside + (emb.fresh if not growing and dp.fresh_grad else 0))
        return
    # FSDP2: the gathered weights on the all-gather stream as elsewhere, the held gradients
    # and the previous unit's reduce-scatter input their own tensors beside the embedding's
    gathered = b.alloc(dp.at_embedding, s.gather_stream)
    kept = b.alloc(beside - dp.at_embedding)
    b.blip(emb.extra)
    b.free(kept)
    b.free(gathered)
    if dp.reduce_at_block:  # the root's reduce-scatter (sharding.end_moments's instants)
        units = h.grads + emb.grads
        last = dp.unit_grads(dp.root_last)  # freed when foreach_reduce returns
        unsharded = b.alloc(dp.unit_grads(units) - (units if growing else 0) - last)
        kept = b.alloc(last)
        rs_input = b.alloc(dp.unsharded(units))
        b.free(unsharded)  # unsharded_grads.clear() once copied in
        if not growing:  # the output shard, added into the gradient it joins
            b.blip(units, stream=s.reduce_stream)
        b.free(rs_input)
        b.free(kept)


def _head_backward(r: _Run, acts: Stack, growing: bool) -> None:
    b, h, s = r.b, r.s.walk.head, r.s
    dp = s.walk.sharding
    piece = s.logits_piece
    if not any(h):
        b.blip(dp.at_loss, stream=s.gather_stream)
        return
    # the head's unit gathers its share (``DataParallel.head_prefetch``) in its pre-backward,
    # once the loss's backward has made the logits' gradient
    # a unit the loss call resharded is gathered again: its all-gather output, then the
    # unsharded weights copied out of it, the output freed (``HeadBlock.regather``)
    output = b.alloc(h.regather, s.gather_stream)
    gathered = b.alloc(dp.at_loss, s.gather_stream)
    b.free(output)
    b.blip(h.loss, piece)
    if dp.at_head > dp.at_loss:
        b.free(gathered)
        gathered = b.alloc(dp.at_head, s.gather_stream)
    acts.release(h.saved_bytes)
    b.blip(h.final_norm_all + h.linear, piece)
    if growing:
        for size in _layer_grads(r, s.head_elements, h.grads + h.tied_grad):
            r.grads.append(b.alloc(size, s.reduce_stream))
    b.blip(h.main_grads, piece)
    if h.final_norm_bwd:
        b.blip(h.final_norm_saved + h.final_norm_bwd, s.piece)
    b.free(gathered)


def moment_table(moments, fresh_grad: int) -> tuple[tuple[int, int, int], ...]:
    """A layer kind's backward moments as ``_layer_backward`` reads them, one row each: (its
    alive bytes, the bytes on top of them at its instant with the weight gradient in flight
    where gradients are accumulated, ``fresh_grad`` bytes per parameter (0 where they are
    new), the next moment's alive bytes, 0 after the last)."""
    alive = [m.alive_bytes for m in moments]
    return tuple((a, m.transient_bytes + m.fresh_params * fresh_grad, nxt)
                 for a, m, nxt in zip(alive, moments, [*alive[1:], 0]))


def _layer_backward(r: _Run, acts: Stack, kind: tuple[int, tuple[tuple[int, int, int], ...]],
                    layer: LayerTensors, grad_bytes: tuple[int, tuple[int, ...]], where: tuple,
                    growing: bool) -> None:
    """A layer's backward moments: a fully recomputed layer's rebuilt tensors first; at each
    moment the bytes beyond the saved (or rebuilt) tensors still alive (gradients in flight)
    as stream-sized tensors; the saved tensors freed, last saved first, as the moments' alive
    bytes fall; its gradients made (last tensor first) as the moments need them. ``kind``:
    the layer kind's saved bytes and its ``moment_table``."""
    b = r.b
    layer_grads, moment_grads = grad_bytes
    p, rebuild = where
    if p.before is not None and p.before.transient:
        b.blip(p.before.transient, stream=r.s.gather_stream)
    # FSDP2: the unit's sharded gradients are views of its reduce-scatter output, one tensor
    # made after the unit's backward on the reduce-scatter stream (_unit_gradients)
    unit = r.s.reduce_stream > 0
    grads = _layer_grads(r, layer.elements, layer_grads) if growing and not unit else []
    gathered = b.alloc(p.beside, r.s.gather_stream)
    made = 0
    alive, table = kind
    if rebuild:
        acts.push_all(rebuild)
        alive += sum(rebuild)
    blip, release, piece, held = b.blip, acts.release, r.s.piece, r.grads
    for j, (at, top, nxt) in enumerate(table):
        while grads and made < moment_grads[j]:
            size = grads.pop()
            held.append(b.alloc(size))
            made += size
        blip((at - alive if at > alive else 0) + top, piece)
        if nxt < alive:
            nxt = nxt if nxt > 0 else 0
            release(alive - nxt)
            alive = nxt
    release(alive)
    while grads:
        held.append(b.alloc(grads.pop()))
    b.free(gathered)
    if unit:
        _unit_gradients(r, layer_grads, growing)
    if p.after is not None and p.after.transient:
        b.blip(p.after.transient, stream=r.s.gather_stream)


def _unit_gradients(r: _Run, shard_bytes: int, growing: bool) -> None:
    """FSDP2's reduce-scatter output, on the reduce-scatter stream (a pool of its own: blocks
    freed by ``zero_grad`` go back to it, not to the compute stream's):
    ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`` ``foreach_reduce`` (torch
    2.6) makes ``reduce_output`` inside ``device_handle.stream(reduce_scatter_stream)`` and
    sets each parameter's gradient to a view of it (``torch.as_strided``), so the unit's
    shard is one tensor (traced: tests/traced/test_fsdp2_grad_storage.py); a later
    micro-batch's output is added into the gradient (``grad._local_tensor +=
    new_sharded_grad``) and freed. A root unit's shard (head, final norm, embedding) is one
    such tensor made at its reduce-scatter after the embedding's backward; the replay makes
    the head's and the embedding's parts on that stream where the walk counts them, at their
    own backward (the same bytes in that pool)."""
    if growing:
        r.grads.append(r.b.alloc(shard_bytes, r.s.reduce_stream))
    else:
        r.b.blip(shard_bytes, stream=r.s.reduce_stream)


def _optimizer(r: _Run, first: bool) -> None:
    """The optimizer step: step 1 makes the states (before or after the temporaries), the
    temporaries per tensor, then ``zero_grad(set_to_none=True)``."""
    s, b = r.s, r.b
    every = [*s.embed_elements, *(e for lt in _layers(r) for e in lt.elements),
             *s.head_elements]
    scale = _scale(r)
    states = (split_bytes(int(s.states_bytes * scale), every) if s.num_states else [])
    make = first and not r.states_made

    def states_once() -> None:
        for size in states:
            for part in split_bytes(size, [1] * s.num_states):
                b.alloc(part)

    if make and not s.first_step_states_late:
        states_once()
    b.made_and_freed(split_bytes(int(s.opt_temp * scale), every))
    if make and s.first_step_states_late:
        states_once()
    r.states_made = r.states_made or make
    if not s.keep_grads:
        while r.grads:
            b.free(r.grads.pop())


def _scale(r: _Run) -> Fraction:
    """The share of the stage's parameters replayed (runs cut to their caps)."""
    full = sum(sum(lt.elements) for lt in r.s.layers)
    cut = sum(sum(lt.elements) for lt in _layers(r))
    other = sum(r.s.embed_elements) + sum(r.s.head_elements)
    return Fraction(cut + other, full + other) if full + other else Fraction(1)


def stage_sequence(s: StageInputs, caps: tuple[int, ...] | None = None) -> Builder:
    """The stage's allocation events over setup and ``NUM_STEPS`` steps (``caps``: layers
    replayed per run; None: all). ``Builder.marks``: the event count at setup's end and at
    each step's end."""
    caps = caps or tuple(n for _, _, _, n in s.walk.runs)
    r = _Run(s, caps)
    _setup(r)
    for step in range(1, NUM_STEPS + 1):
        for mb in range(min(s.microbatches, 2)):
            acts = Stack(r.b)
            cached: list[int | None] = []
            _forward(r, step > 1, acts, cached)
            for key in cached:
                r.b.free(key)
            growing = mb == 0 and not s.persistent_grads and not (s.keep_grads and step > 1)
            _backward(r, acts, growing)
            acts.clear()
        r.b.free(r.output)  # the schedule's step() returned
        r.output = None
        _optimizer(r, step == 1)
        r.b.mark()
    return r.b


class StageReplay(NamedTuple):
    """A stage's sequence replayed: reserved bytes at setup's end and each step's end, the
    reserved peak, the sequence's own tensor peak (unrounded), and the allocator's bytes beyond
    it at the reserved peak."""

    reserved_by_step: tuple[int, ...]  # setup, step 1, step 2, step 3
    reserved_peak_bytes: int
    tensor_peak_bytes: int
    num_events: int  # replayed (folded runs: fewer than the whole sequence)
    folded: bool
    # with a capacity (``AllocatorConfig.capacity_bytes``): the step (0: setup) whose
    # allocation failed even after the cache was released; None: none failed
    oom_step: int | None = None

    @property
    def fragmentation_bytes(self) -> int:
        return self.reserved_peak_bytes - self.tensor_peak_bytes


def _replay_caps(s: StageInputs, cfg: AllocatorConfig, caps: tuple[int, ...] | None,
                 limit: tuple[int, int] | None = None, built: Builder | None = None
                 ) -> tuple[tuple[int, ...], int, int, int | None, int]:
    """(reserved at setup's and each step's end, the sequence's tensor peak, its events, the
    step whose allocation failed, the reserved peak); ``limit``: ``replay_stage``'s;
    ``built``: the sequence, built before (``stage_sequence(s, caps)``). Built and replayed
    with the cyclic garbage collector paused (``collector_paused``: a sequence and its replay
    make tens of thousands of events and blocks that all live until the replay ends; the
    allocator's linked blocks are collected at the first collection after)."""
    with collector_paused():
        b = stage_sequence(s, caps) if built is None else built
        if limit is not None:
            cfg = cfg.model_copy(update={"capacity_bytes": limit[1] - (limit[0] - b.peak)})
        res = replay_reserved(b.events, cfg, b.marks)
    oom = (None if res.oom_event is None else
           next(k for k, m in enumerate(b.marks) if res.oom_event < m))
    return res.at_marks, b.peak, len(b.events), oom, res.reserved_peak_bytes


# Folding: a stage whose longest run has more than FOLD_ABOVE layers is replayed with its long
# runs cut to c, c + P, c + 2P and c + 3P layers (c >= FOLD_START, of the run's residue modulo
# the period P <= MAX_PERIOD); where the reserved bytes at every step's end and the tensor peak
# grow by the same amount three times over, the whole run follows by that amount per period.
# The check is over those samples only: the allocator's cross-step reuse (step 1's lazily made
# optimizer states in blocks its activations left) can change regime past them (replays of
# GPT-2 and Llama 3.1 8B layouts cut at 3 to 8 layers were periodic there and missed the full
# replay by one 20 MiB segment to 12.6 GB): below FOLD_ABOVE layers a stage replays whole.
FOLD_ABOVE = 32
FOLD_START = 8
MAX_PERIOD = 10  # 20 MiB segments or pages hold up to ten 2 MiB blocks


def replay_stage(s: StageInputs, cfg: AllocatorConfig, fold_above: int | None = None,
                 fold_start: int = FOLD_START, limit: tuple[int, int] | None = None,
                 built: Builder | None = None) -> StageReplay:
    """The stage's sequence through the allocator model, whole; with ``fold_above`` (e.g.
    ``FOLD_ABOVE``) runs longer than that many layers are folded (see ``FOLD_ABOVE``). The
    estimate replays whole: a catalog model's deepest stage (126 layers) replays in about
    0.3 s of CPU, and the fold's check cannot see a regime change past its samples.

    ``limit`` (a tensor peak, a capacity at least that): replayed with cudaMalloc limited to
    the capacity less what the tensor peak holds beyond the sequence's own (``cfg``'s
    capacity replaced; known once the sequence is built, so it is built once). Not with
    ``fold_above``. ``built``: the whole sequence, built before (``stage_sequence(s)``; a
    stage replayed under two allocator settings builds it once)."""
    runs = [n for _, _, _, n in s.walk.runs]
    if limit is not None:
        by, peak, num, oom, top = _replay_caps(s, cfg, None, limit, built)
        return StageReplay(by, top, peak, num, False, oom)
    if fold_above is not None and max(runs, default=0) > fold_above:
        for period in range(1, MAX_PERIOD + 1):
            found = _fold(s, cfg, runs, period, fold_start)
            if found is not None:
                return found
    by, peak, num, oom, top = _replay_caps(s, cfg, None, built=built)
    return StageReplay(by, top, peak, num, False, oom)


def _fold(s: StageInputs, cfg: AllocatorConfig, runs: list[int], period: int,
          start: int) -> StageReplay | None:
    long = [n >= start + 4 * period for n in runs]
    if not any(long):
        return None

    def caps(k: int) -> tuple[int, ...]:
        return tuple(start + (n - start) % period + k * period if is_long else n
                     for n, is_long in zip(runs, long))

    steps = {(n - c) // period for n, c, is_long in zip(runs, caps(0), long) if is_long}
    if len(steps) != 1:  # long runs of different lengths: no common extrapolation
        return None
    samples = [_replay_caps(s, cfg, caps(k))[:3] for k in range(4)]
    d_by = [y - x for x, y in zip(samples[0][0], samples[1][0])]
    d_peak = samples[1][1] - samples[0][1]
    for a, b in zip(samples[1:], samples[2:]):
        if [y - x for x, y in zip(a[0], b[0])] != d_by or b[1] - a[1] != d_peak:
            return None
    k = steps.pop()
    by = tuple(x + k * d for x, d in zip(samples[0][0], d_by))
    return StageReplay(by, max(by), samples[0][1] + k * d_peak,
                       sum(n for _, _, n in samples), True)


def first_vs_second(r: StageReplay, lazy_states: bool = True) -> str:
    """Which step reserves more, and why (the allocator never gives segments back
    unprompted, so a step reserves more when it needs a segment the steps before left
    none of). ``lazy_states``: step 1's optimizer makes states (``StageInputs.states_bytes``)."""
    if r.oom_step is not None:
        step = "set-up" if r.oom_step == 0 else f"step {r.oom_step}"
        return (f"the allocator runs out of memory in {step} although the tensor peak fits: "
                "no cached block holds the request and releasing the cached segments that "
                "are wholly free does not make room (fragmentation)")
    _, first, second, third = r.reserved_by_step
    if second > first and lazy_states:
        return (f"step 2 reserves {second - first:,} B more than step 1: the optimizer "
                "states step 1 made lazily took cached blocks its activations had used, so "
                "step 2's activations need new segments")
    if second > first:
        return (f"step 2 reserves {second - first:,} B more than step 1: step 1 left its "
                "cached blocks split where step 2's requests come in another order")
    if third > second:
        return f"step 3 reserves {third - second:,} B more than step 2"
    return "step 1 reserves as much as the steps after it"

