"""One pipeline stage's bytes for one micro-batch count: its phase peaks and its record.

``walk_stage`` sums what is alive at each phase's peak (what each phase holds is listed in
``memplan.model.estimate``'s docstring) from the stage's parts (``memplan.model.stage_parts``)
and the per-micro-batch terms every stage shares (``StageTerms``); ``stage_record`` turns
the walk into a ``StageMemory`` with the fixed overheads on top. All sizes are int bytes for
one GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

from memplan.model import memo, step_in_backward
from memplan.model.deferred_wgrad import NO_DEFERRAL, Deferred, deferred
from memplan.model.dims import Dims, Term, exact_ratio, whole_bytes
from memplan.model.embedding import EmbeddingBlock, made_vocab_grad
from memplan.model.fsdp1 import last_reduce
from memplan.model.grad_sync import (
    accumulated_gradients,
    accumulates_unsharded,
    accumulator_bytes,
    new_grads,
    unsynced,
    with_new_grads,
)
from memplan.model.head import HeadBlock
from memplan.model.compiled import layer_workload as compiled_layer_workload
from memplan.model.layer import LayerKind, backward_moments, merge_terms, unsaved_stream
from memplan.model.moments import Segment
from memplan.model.pipeline import Schedule
from memplan.model.pipeline_buffers import NO_BUFFERS, StageBuffers, stage_buffers
from memplan.model.stage_parts import (
    LayerKey,
    StageKinds,
    StageStates,
    first_step_states,
    key_variant,
)
from memplan.model.sharding import with_stream
from memplan.model.stage_terms import StageTerms
from memplan.model.walk import Walk, backward_head_peak, backward_peak, forward_peaks
from memplan.overheads import Overheads
from memplan.model.offload import (
    host_activation_bytes,
    kept_cache_bytes,
    saved_on_host,
    unpacked_bytes,
)
from memplan.parallel import Offload, ParallelConfig, ZeroStage
from memplan.spec import ModelSpec, norm_params
from memplan.units import PHASES
from memplan.workload import Recompute, Workload

# A layer kind's entry in a walk: its kind, its parameters' gradient bytes, and the gradient
# bytes of each of its moment groups (``StageTerms.moment_params``).
Entries = dict[LayerKey, tuple[LayerKind, int, tuple[int, ...]]]


class PhasePeaks(NamedTuple):
    """Tensor bytes alive at each phase's peak (fixed overheads excluded). A tuple: three are
    made per stage walked, the cheapest immutable record to build."""

    forward: int
    backward: int
    optimizer: int

    @property
    def peak(self) -> int:
        return max(self)  # (its three phases: the tuple itself)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=lambda name: getattr(self, name))


class StageMemory(NamedTuple):
    """One rank of pipeline stage ``stage``. All sizes are int bytes for that one GPU. A tuple,
    so that it is cheap to build and to derive (``_replace``)."""

    stage: int
    num_layers: int
    num_params: int  # parameters this rank holds before ZeRO sharding
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # saved activations of all micro-batches in flight
    microbatches_in_flight: int
    microbatch_bytes: int  # saved activations of one micro-batch on this stage
    activation_groups: tuple[tuple[int, tuple[Term, ...]], ...]  # (count, terms) of one
    #                                                            micro-batch on this stage
    loss_bytes: int  # logits-sized tensors alive at the loss, beyond what is saved
    sharding_buffers_bytes: int  # ZeRO-3 gathered units / ZeRO-2 bucket, at their peak
    optimizer_temp_bytes: int
    steady: PhasePeaks
    first_step: PhasePeaks
    tensor_peak_bytes: int
    cuda_context_bytes: int
    workspace_bytes: int
    allocator_bytes: int
    peak_bytes: int
    # a calibration profile's correction of the tensor peak (memplan.calibrate.apply), its own
    # line: peak_bytes = tensor_peak + calibration + context + workspace + allocator
    calibration_bytes: int = 0
    host_bytes: int = 0  # offloaded to host memory (not in peak_bytes): ``StateBytes.host_bytes``
    #                      and ``host_activations_bytes``
    host_activations_bytes: int = 0  # ... of it, the saved activations (``Offload.ACTIVATIONS``)
    # with a calibration applied, ``steady`` and ``first_step`` are the calibrated phase peaks
    # (their largest is tensor_peak + calibration) and these the analytic ones: (steady,
    # first step); None for an analytic estimate
    analytic_phases: tuple[PhasePeaks, PhasePeaks] | None = None
    buffers_bytes: int = 0  # registered buffers (RoPE tables), TE fp8's kept weight copies:
    #                         resident in every phase
    paged_bytes: int = 0  # optimizer states in unified memory (not in peak_bytes beyond the
    #                       pages the step uses): ``StateBytes.paged_bytes``
    load_bytes: int = 0  # tensor bytes at the model's load, before step 1, where they exceed
    #                      the weights (``stage_parts.load_bytes``; 0: not modelled); in
    #                      tensor_peak_bytes when above both steps' peaks
    pipeline_buffers_bytes: int = 0  # the pipeline runtime's receive buffers, kept from step
    #                                  1's start (``memplan.model.pipeline_buffers``); in
    #                                  every phase of both steps' peaks

    @property
    def activation_terms(self) -> tuple[Term, ...]:
        """Saved terms of one micro-batch, summed by name over the stage's layers."""
        return merge_terms(self.activation_groups)

    @property
    def peak_phase(self) -> str:
        if self.load_bytes > max(self.steady.peak, self.first_step.peak):
            return "model load (before step 1)"
        which = self.steady if self.steady.peak >= self.first_step.peak else self.first_step
        step = "steady" if which is self.steady else "first step"
        return f"{which.peak_phase} ({step})"


class Walked(NamedTuple):
    """One stage's phase peaks, and what its record shows beside them."""

    states: StageStates
    kinds: StageKinds
    entries: Entries
    in_flight: tuple[int, ...]
    activations: int
    one_mb: int
    loss_bytes: int
    steady: PhasePeaks
    first_step: PhasePeaks
    pipe: StageBuffers = StageBuffers()  # the pipeline runtime's buffers

    @property
    def tensor_peak(self) -> int:
        return max(*self.steady, *self.first_step, self.states.load)  # (both steps' phases)


def stage_record(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, stage: int,
                 schedule: Schedule, ovh: Overheads, shared: StageTerms,
                 parts: tuple[StageStates, StageKinds] | None = None) -> StageMemory:
    """Pipeline stage ``stage``'s record with ``m`` micro-batches per step; ``parts``: its
    ``stage_parts`` entry (looked up when not given)."""
    parts = parts or memo.stage_parts(spec, par, wl)[stage]
    w = walk_stage(spec, par, wl, m, stage, schedule, shared, parts)
    fx, st = w.states, w.states.states
    groups = [(par.vpp, tuple(shared.rope)), (1, tuple(shared.embed if fx.first else ())),
              (1, tuple(shared.head if fx.last else ())),
              *((n, w.entries[k][0].terms) for k, n in w.kinds.counts.items())]
    tensor_peak = w.tensor_peak
    host_activations = (host_activation_bytes(
        [(shared.kinds[k].saved_bytes, k[1] is Recompute.FULL, n)
         for k, n in w.kinds.counts.items()], max(fx.params.layers) * shared.dm.e,
        shared.rope_bytes * par.vpp, max(w.in_flight))
        if Offload.ACTIVATIONS in par.offload else 0)
    # kept gathered under PP, or accumulated without a sync (``memplan.model.grad_sync``):
    # the unsharded gradient accumulators are buffers too
    sharding_buffers = fx.shard.peak_bytes + fx.buckets + (
        fx.accum_bytes if fx.shard.kept_gathered
        or accumulates_unsharded(wl, parts[0].dp, fx.shard.kept_gathered, m) else 0)
    # (positional, in the fields' order: a call with two dozen keywords costs several times
    # the record it makes)
    return StageMemory(
        stage, len(w.kinds.keys), fx.params.total,  # stage, num_layers, num_params
        st.params_bytes, st.grads_bytes, st.optimizer_bytes,
        w.activations, max(w.in_flight), w.one_mb,  # ..., microbatches_in_flight, ...
        tuple(groups), w.loss_bytes, sharding_buffers,  # activation_groups, loss_bytes, ...
        fx.opt_temp, w.steady, w.first_step,  # optimizer_temp_bytes, steady, first_step
        tensor_peak, ovh.cuda_context_bytes, ovh.workspace_bytes,  # tensor_peak_bytes, ...
        ovh.allocator_bytes(tensor_peak), rank_peak_bytes(tensor_peak, ovh),  # ..., peak_bytes
        0, st.host_bytes + host_activations, host_activations,  # calibration_bytes, host_...
        None, fx.buffers, st.paged_bytes, fx.load,  # analytic_phases, buffers_bytes, ...
        w.pipe.persistent_bytes)  # pipeline_buffers_bytes


# the head and the embedding of a stage without them (tuples: shared by every stage)
NO_HEAD = HeadBlock()
NO_EMBEDDING = EmbeddingBlock()


def rank_peak_bytes(tensor_peak: int, ovh: Overheads) -> int:
    """A rank's peak: its tensors' peak, the fixed overheads and the allocator's share."""
    return tensor_peak + ovh.fixed_bytes + ovh.allocator_bytes(tensor_peak)


def _entries(spec: ModelSpec, par: ParallelConfig, wl: Workload, shared: StageTerms,
             fx: StageStates, kinds: StageKinds) -> Entries:
    """Each layer kind of the stage with its gradient bytes (``Entries``)."""
    per_param = fx.grad_per_param
    entries: Entries = {}
    offloaded = Offload.ACTIVATIONS in par.offload
    for key, pos in kinds.positions.items():
        kind = shared.kinds[key]
        if offloaded:
            # a fully recomputed layer's rerun saves on the GPU (the checkpoint's own hooks):
            # only its checkpointed input waits on the host
            unpacked = partial(unpacked_bytes, spec, shared.dm)
            kind = saved_on_host(kind, memo.layer_kind(spec, wl, shared.dm, key[0],
                                                       Recompute.FULL, *key[2:]),
                                 backward_moments(spec, wl, shared.dm, moe_layer=key[0],
                                                  recompute=key[1], variant=key_variant(key),
                                                  host_saved=None if key[1] is Recompute.FULL
                                                  else unpacked),
                                 shared.dm.stream(spec.hidden_size),
                                 kept_cache_bytes(spec, wl, shared.dm, key[1], key_variant(key)))
        moment_grads = memo.whole_bytes_each(shared.moment_params[key], per_param)
        if fx.shard.bucket_bytes:
            # gradients copied into preallocated buckets at their hooks (DeepSpeed): at a
            # moment only the weight gradient just made exists, unsharded, until its hook
            # copies it away (one larger than the bucket until the next hook)
            # (with LoRA the base weights make none; an adapter's, r x d elements, is
            # copied away at its own hook and not counted)
            from memplan.model.deepspeed_zero import weight_grads_at

            moment_grads = weight_grads_at(tuple(0 if wl.lora_rank else m.fresh_params
                                                 for m in kind.moments),
                                           wl.zero_bucket_numel,
                                           wl.precision.policy.grad_bytes)
        if wl.optimizer_in_backward:
            # each gradient stepped and freed by its hook: the fresh one and its step's
            # temporaries (``memplan.model.step_in_backward``), beside the states made so
            # far where they grow (step 1: ``per_param`` is then the states')
            fresh = step_in_backward.moment_grads(wl, tuple(m.fresh_params for m in kind.moments))
            moment_grads = tuple(g + f for g, f in zip(moment_grads, fresh))
        elif fx.main_grads and par.zero < ZeroStage.GRADIENTS:
            # the weight whose gradient was just made holds it in the compute dtype: its fp32
            # main gradient does not exist yet
            less = per_param - shared.dm.e
            moment_grads = tuple(g - whole_bytes(m.fresh_params, less)
                                 for g, m in zip(moment_grads, kind.moments))
        entries[key] = (kind, whole_bytes(fx.params.layers[pos], per_param), moment_grads)
    return entries


def _saved(par: ParallelConfig, kinds: StageKinds, entries: Entries, flight: tuple[int, ...],
           rope_bytes: int, embed_bytes: int, head_bytes: int) -> tuple[int, int]:
    """(saved activations of every micro-batch in flight, of one micro-batch) on the stage."""
    layers_saved = sum(entries[k][0].saved_bytes * n for k, n in kinds.counts.items())
    if par.vpp == 1:
        activations = flight[0] * (layers_saved + rope_bytes)
    else:
        activations = 0
        for chunk, count in zip(kinds.chunks, flight):
            chunk_saved = sum(entries[k][0].saved_bytes * n for k, n in chunk.items())
            activations += count * (chunk_saved + rope_bytes)
    # The embedding belongs to the first chunk, the loss to the last.
    activations += flight[0] * embed_bytes + flight[-1] * head_bytes
    return activations, layers_saved + par.vpp * rope_bytes + embed_bytes + head_bytes


class Prepared(NamedTuple):
    """A stage's walk inputs for one configuration: the stage terms as the walk reads them
    (rope tables on the host taken out), the micro-batches in flight, each layer kind's entry
    and ``_walk``'s result."""

    shared: StageTerms
    host_rope: int
    flight: tuple[int, ...]
    entries: Entries
    walk: tuple[Walk, int, int]
    pipe: StageBuffers  # the pipeline runtime's buffers beside the walk (``stage_buffers``)


def _prepare(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, stage: int,
             schedule: Schedule, shared: StageTerms,
             parts: tuple[StageStates, StageKinds]) -> Prepared:
    """The walk's inputs of stage ``stage`` (``Prepared``), for ``parts`` as they are (not
    for gradients accumulated unsharded, whose states ``walk_stage`` changes first)."""
    fx, kinds = parts
    host_rope = _host_rope(shared, par, kinds)
    shared = shared._replace(rope_bytes=0) if host_rope else shared
    flight = memo.in_flight(par.pp, par.vpp, m, stage, schedule, par.vpp_group)
    entries = _entries(spec, par, wl, shared, fx, kinds)
    dm = shared.dm  # the last stage's output: the logits, in the compute dtype
    pipe = stage_buffers(wl, par, m, stage, flight, dm.stream(spec.hidden_size),
                         dm.tokens * dm.vocab_shard * dm.e)
    return Prepared(shared, host_rope, flight, entries,
                    _walk(spec, par, wl, shared, fx, kinds, entries, flight, pipe), pipe)


class WalkCore(NamedTuple):
    """What ``walk_stage`` derives from a stage's activations and gradients, apart from its
    optimizer's states (``memo.stage_walk`` keeps it for layouts that differ only in those;
    plain values where it can, so that a kept entry holds few objects): where gradients
    accumulate unsharded, the stage's gradient bytes per parameter and mechanism as walked
    (None elsewhere), the walk's inputs (``Prepared``'s, the walk with a deferred weight
    gradient), the gradients (steady; step 1's where its mechanism differs, else None) and
    the forward peaks (steady, step 1)."""

    accumulating: tuple | None  # (grad_per_param, dp)
    shared: StageTerms
    host_rope: int
    flight: tuple[int, ...]
    entries: Entries
    activations: int
    one_mb: int
    pipe: StageBuffers
    walk: Walk
    dfr: Deferred
    grads: tuple[int, int, int, int]
    first_grads: tuple[int, int, int, int] | None
    forward: tuple[int, int]


def walk_core(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, stage: int,
              schedule: Schedule, shared: StageTerms, parts: tuple[StageStates, StageKinds],
              prepared: Prepared | None = None) -> WalkCore:
    """``walk_stage``'s walk (``WalkCore``). It reads of ``par`` only pp, vpp, vpp_group,
    whether activations are offloaded and whether ZeRO shards gradients, and of the stage's
    states none of its optimizer's (``memo.walk_view``)."""
    fx, kinds = parts
    # gradients accumulated unsharded without a sync (``memplan.model.grad_sync``): the
    # walk's gradients are the stage's accumulators, in the reduce dtype
    accumulating = accumulates_unsharded(wl, fx.dp, fx.shard.kept_gathered, m)
    if accumulating:
        ratio, root_new, fresh = new_grads(fx.params, wl, fx.shard.separate_units, fx.dp.flat)
        reduce = last_reduce(fx.dp, fx.shard.grad_bytes, wl)
        fx = fx._replace(grad_per_param=exact_ratio(fx.accum_bytes, max(fx.params.total, 1)),
                         dp=unsynced(fx.dp, root_new))
    if prepared is None or accumulating:  # (accumulating: fx changed above)
        prepared = _prepare(spec, par, wl, m, stage, schedule, shared, (fx, kinds))
    shared, host_rope, flight, entries, (walk, activations, one_mb), pipe = prepared
    # the output layer's deferred weight gradient (``memplan.model.deferred_wgrad``)
    dfr = deferred(spec, wl, shared.dm, m, flight[-1]) if fx.last else NO_DEFERRAL
    walk = _with_deferred(walk, dfr, fx.main_grads)
    if accumulating:
        walk = with_new_grads(walk, ratio, fresh)
        grads = accumulated_gradients(walk, fx.states, fx.accum_bytes, reduce, wl.keep_grads)
    else:
        grads = _gradients(wl, fx, walk, m)
    forward = _forward(shared, fx, walk, dfr.before_forward - dfr.before_backward + host_rope)
    first_grads, forward1 = (
        _first_step_walk(spec, par, wl, shared, (fx, kinds, entries), flight, m, host_rope,
                         pipe)
        if fx.shard.first_step is not None and not accumulating else (None, forward))
    return WalkCore((fx.grad_per_param, fx.dp) if accumulating else None, shared, host_rope,
                    flight, entries, activations, one_mb, pipe, walk, dfr, grads, first_grads,
                    (forward(True), forward1(False)))


def walk_stage(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, stage: int,
               schedule: Schedule, shared: StageTerms,
               parts: tuple[StageStates, StageKinds], *,
               prepared: Prepared | None = None) -> Walked:
    """Phase peaks of pipeline stage ``stage`` with ``m`` micro-batches per step, in step 1
    and in the steady state, without its record. ``prepared``: this configuration's walk
    inputs as ``backward_floor`` made them (the same ``shared`` and ``parts``)."""
    fx, kinds = parts
    core = memo.stage_walk(walk_core, spec, par, wl, m, stage, schedule, shared, parts,
                           prepared)
    if core.accumulating:
        fx = fx._replace(grad_per_param=core.accumulating[0], dp=core.accumulating[1])
    st = fx.states
    shared, walk, dfr, pipe = core.shared, core.walk, core.dfr, core.pipe
    grads, last_step = _in_backward(spec, par, wl, shared, (fx, kinds), core.flight,
                                    core.grads, walk)
    grads1 = core.first_grads or grads
    base = st.params_bytes + fx.buckets + fx.buffers
    optimizer, optimizer_first = _optimizer_peaks(walk.head, fx)
    held = walk.head.backward_held()  # logits held from the loss on (its drain's too)
    # (the same in both steps' peaks)
    outside, in_step = _outside_walk(shared, walk), pipe.in_step
    persistent = pipe.persistent_bytes

    def peaks(opt_bytes: int, from_loss: int, steady: bool) -> PhasePeaks:
        in_forward, bwd = grads[2:] if steady else grads1[:2]
        # the drain's gathered buffers stay from the first step's drain on
        resident = dfr.resident if steady else 0
        # after the last backward: the pipeline's receive buffers beside it (``pipe.at_step``)
        after = max(_after_backward(fx, dfr, base + opt_bytes + from_loss, held), last_step)
        init = base + opt_bytes + fx.shard.forward_start(steady, st.grads_bytes)
        return PhasePeaks(  # forward, backward, optimizer
            max(base + resident + opt_bytes + in_forward + outside
                + core.forward[0 if steady else 1] + in_step, init + persistent),
            max(base + resident + opt_bytes + from_loss + bwd + in_step,
                after + pipe.at_step if after else 0),
            (optimizer if steady else optimizer_first) + resident + pipe.at_step)

    # Master weights (and bitsandbytes' quantization maps) exist from optimizer setup; a grad
    # scaler's state from step 1's loss; moments appear at step 1's optimizer step.
    return Walked(fx, kinds, core.entries, core.flight, core.activations, core.one_mb,
                  max(walk.head.loss_forward, walk.head.loss),
                  peaks(st.optimizer_bytes, 0, True),
                  peaks(st.master_bytes + st.setup_bytes, st.scaler_bytes, False), pipe)


def _after_backward(fx: StageStates, dfr: Deferred, beside: int, held: int) -> int:
    """What is alive after the last backward, 0 where the walk ends the backward's phase: the
    drain of deferred weight gradients, beside the gradients and the logits the loop
    holds (``held``; its gathered buffers counted in ``dfr.drain``), or a reduce after
    backward (``_reduce_after``)."""
    return max(beside + held + fx.states.grads_bytes + dfr.drain if dfr.pair else 0,
               _reduce_after(fx, beside))


def _outside_walk(shared: StageTerms, walk: Walk) -> int:
    """The masks alive through a stage's whole forward, beside its walk: those the walk frees
    with the model's forward's other locals (``HeadBlock.mask_released``) are in it."""
    return shared.mask - walk.head.mask_released


def _host_rope(shared: StageTerms, par: ParallelConfig, kinds: StageKinds) -> int:
    """Rope tables only the decoder layers save: with their saved tensors on the host they
    are alive through the forward alone (``memplan.model.offload.saved_on_host``), unless a
    checkpointed layer keeps them (its inputs, held by the checkpoint itself); 0 otherwise."""
    return (shared.rope_bytes * par.vpp if Offload.ACTIVATIONS in par.offload
            and all(key[1] is not Recompute.FULL for key in kinds.keys) else 0)


def _first_step_walk(spec: ModelSpec, par: ParallelConfig, wl: Workload, shared: StageTerms,
                     parts: tuple[StageStates, StageKinds, Entries], flight: tuple[int, ...],
                     m: int, host_rope: int, pipe: StageBuffers
                     ) -> tuple[tuple[int, int, int, int], Callable[[bool], int]]:
    """Step 1's gradients and forward where its mechanism differs (``ShardingBuffers.
    first_step``: ZeRO-3's coordinator records its trace then): a walk of its own."""
    fx, kinds, entries = parts
    fx1 = first_step_states(fx, wl)
    walk1 = _walk(spec, par, wl, shared, fx1, kinds, entries, flight, pipe)[0]
    return _gradients(wl, fx1, walk1, m), _forward(shared, fx1, walk1, host_rope)


def walk_of(spec: ModelSpec, par: ParallelConfig, wl: Workload, shared: StageTerms,
            walked: Walked) -> Walk:
    """The walk's inputs of a walked stage (its runs, head, embedding, mechanism), for readers
    that replay it tensor by tensor (``memplan.model.alloc_sequence``)."""
    return _walk(spec, par, wl, shared, walked.states, walked.kinds, walked.entries,
                 walked.in_flight, walked.pipe)[0]


def _in_backward(spec: ModelSpec, par: ParallelConfig, wl: Workload, shared: StageTerms,
                 parts: tuple[StageStates, StageKinds], flight: tuple[int, ...],
                 grads: tuple[int, int, int, int], walk: Walk
                 ) -> tuple[tuple[int, int, int, int], int]:
    """``grads`` and the last step's bytes in backward (0 where none) with the optimizer
    stepped in backward (``memplan.model.step_in_backward``): step 1's backward with its
    states growing, and the last gradient's step, every activation gone but the inputs,
    every state made, beside the weights and buffers."""
    if not wl.optimizer_in_backward:
        return grads, 0
    fx, kinds = parts
    first = _first_step_in_backward(spec, par, wl, shared, fx, kinds, flight, walk.head)
    last = (fx.states.params_bytes + fx.buckets + fx.buffers + fx.states.optimizer_bytes
            + walk.rest_saved + fx.opt_temp)
    return (0, first, *grads[2:]), last


def _first_step_in_backward(spec: ModelSpec, par: ParallelConfig, wl: Workload,
                            shared: StageTerms, fx: StageStates, kinds: StageKinds,
                            flight: tuple[int, ...], head: HeadBlock) -> int:
    """Step 1's backward peak with the optimizer stepped in it (``memplan.model.
    step_in_backward``): each parameter's states are made at its first step, in its hook, so
    they grow through the backward as held gradients do elsewhere: the walk with the states
    as its growing gradients (the fresh gradient and its step's temporaries beside them)."""
    states = fx.states.optimizer_bytes
    grown = fx._replace(grad_per_param=exact_ratio(states, max(fx.params.total, 1)))
    entries = _entries(spec, par, wl, shared, grown, kinds)
    walk = _walk(spec, par, wl, shared, grown, kinds, entries, flight)[0]
    # (the pipeline's outputs beside it as in the stage's own walk, ``head``)
    walk = walk._replace(head=walk.head._replace(pipe_output=head.pipe_output,
                                                 pipe_previous=head.pipe_previous))
    return backward_peak(walk, 0, states)


def _reduce_after(fx: StageStates, beside: int) -> int:
    """A reduce after backward (DeepSpeed's ZeRO-1, ``ShardingBuffers.reduce_after_bytes``),
    nothing of backward alive but ``beside``; 0 where there is none."""
    return beside + fx.shard.reduce_after_bytes if fx.shard.reduce_after_bytes else 0


def _optimizer_peaks(head: HeadBlock, fx: StageStates) -> tuple[int, int]:
    """The optimizer step's activation-free peak from step 2 on and in step 1 (where its
    order differs, ``StageStates.first_step``), the logits a training loop keeps from the loss
    alive beside it."""
    logits = head.step_logits_bytes()  # alive from before the step, no instant of its own
    steady = _step_peak(fx.step, logits)
    return steady, steady if fx.first_step is None else _step_peak(fx.first_step, logits)


def _step_peak(step: Segment, alive: int) -> int:
    """``peak_of([step], alive)``, the step folded once (``memo.step_fold``)."""
    top = memo.step_fold(step)[0]
    return 0 if top is None else alive + top


def _walk(spec: ModelSpec, par: ParallelConfig, wl: Workload, shared: StageTerms,
          fx: StageStates, kinds: StageKinds, entries: Entries,
          flight: tuple[int, ...], pipe: StageBuffers = NO_BUFFERS) -> tuple[Walk, int, int]:
    """The walk's inputs, the saved activations of every micro-batch in flight and of one;
    ``pipe``: the pipeline runtime's buffers (the last stage's output, its head's)."""
    rope_bytes = shared.rope_bytes  # rope tables (and a saved mask): per chunk forward
    embed_bytes = shared.embed_bytes if fx.first else 0
    head_bytes = shared.head_bytes if fx.last else 0
    batch = shared.batch_bytes if fx.last else 0  # held by the training loop, not the graph
    activations, one_mb = _saved(par, kinds, entries, flight, rope_bytes, embed_bytes,
                                 head_bytes)
    head = _head_block(spec, shared, fx)
    if pipe.output and fx.last:
        head = head._replace(pipe_output=pipe.output, pipe_previous=pipe.previous)
    if held := embeds_held_bytes(spec, wl, shared.dm, fx, kinds):
        head = head._replace(embeds_held=held, embeds_copy=spec.embeds_scaled_copy)
    if shared.mask and wl.embeds_held and fx.first and fx.last:
        # the masks are locals of the model's forward as inputs_embeds is (causal_mask_mapping
        # in transformers' XModel.forward): freed when it returns, before the head's logits
        # and the loss (traced: Llama eager, tests/traced/test_frameworks.py)
        head = head._replace(mask_released=shared.mask)
    walk = Walk(  # (positional: built in every walk)
        _runs(kinds, entries, fx),  # runs
        max(0, activations - one_mb),  # other_bytes
        rope_bytes * par.vpp + embed_bytes + batch,  # rest_saved
        head, _embedding_block(spec, wl, shared, fx),  # head, embedding
        with_stream(fx.dp, shared.dm.stream(spec.hidden_size)))  # sharding
    return walk, activations, one_mb


def embeds_held_bytes(spec: ModelSpec, wl: Workload, dm: Dims, fx: StageStates,
                      kinds: StageKinds) -> int:
    """The embedding's output the model's forward keeps in a local through its layers and
    final norm (``Workload.embeds_held``: transformers' ``XModel.forward`` holds
    ``inputs_embeds``), where the first layer does not save it: run without recompute (a
    checkpointed layer keeps its input) and a norm that saves an fp32 copy of it, not the
    tensor (``layer.unsaved_stream``; fp32 runs and autocast's fp32 stream save the tensor
    itself). On a stage with the embedding and the head (a model's forward is not split).
    Traced: tests/traced/test_frameworks.py, Mistral bf16 (b x s x h x 2 = 1,048,576 B at
    2 x 1,024 tokens, hidden 256), and the MoE families of tests/traced/test_hf_moe_families.py.
    Where the model's forward scales it into the first layer's input (``ModelSpec.
    embeds_scaled_copy``: Gemma 2, Gemma) no layer saves or holds the unscaled tensor: it is
    held whatever the recompute and dtype, from the start (``HeadBlock.embeds_copy``; traced:
    tests/traced/test_sac_policy.py, Gemma 2 narrowed at 2 x 1,024 tokens: before, full
    recompute's forward 1,040,770 B under in bf16, 2,089,348 B in fp32)."""
    if not (wl.embeds_held and fx.first and fx.last and kinds.keys):
        return 0
    if spec.embeds_scaled_copy:
        return dm.stream(spec.hidden_size)
    if kinds.keys[0][1] is not Recompute.NONE:
        return 0
    return unsaved_stream(spec, compiled_layer_workload(wl), dm)


def _runs(kinds: StageKinds, entries: Entries, fx: StageStates
          ) -> list[tuple[LayerKind, int, tuple[int, ...], int]]:
    """The walk's runs: each kind's saved bytes, moments and gradients; where the layers'
    own tensors differ within a kind (``StageKinds.run_starts``), each run's gradients are its
    own layers' and none of its moments holds more."""
    if not kinds.run_starts:
        return [(*entries[k], n) for k, n in kinds.runs]
    out = []
    for (key, n), pos in zip(kinds.runs, kinds.run_starts):
        kind, _, moment_grads = entries[key]
        grads = whole_bytes(fx.params.layers[pos], fx.grad_per_param)
        out.append((kind, grads, tuple(min(g, grads) for g in moment_grads), n))
    return out


def _with_deferred(walk: Walk, dfr: Deferred, main_grads: bool) -> Walk:
    """``walk`` with the output layer's deferred weight gradient (``memplan.model.
    deferred_wgrad``): the earlier micro-batches' pairs alive from its start, its own pair
    kept from the head's backward on, and no compute-dtype weight gradient made there when
    its own is deferred."""
    if not dfr.pair:
        return walk
    h = walk.head
    head = h._replace(deferred=dfr.own, linear=h.linear - dfr.weight_grad,
                      main_grads=h.main_grads - (dfr.weight_grad if main_grads else 0))
    return walk._replace(head=head, rest_saved=walk.rest_saved + dfr.before_backward)


def _gradients(wl: Workload, fx: StageStates, walk: Walk, m: int) -> tuple[int, int, int, int]:
    """Gradient bytes alive through the forward and the backward's tensor peak, in step 1
    and in the steady state (the training loop's gradients: zeroed or freed, accumulated
    over micro-batches, kept)."""
    shard, st = fx.shard, fx.states
    if shard.kept_gathered:
        # FSDP2 under PP (``ShardingBuffers.kept_gathered``): the walk's gradients are the
        # stage's unsharded accumulators, from the first micro-batch's backward to the reduce
        # after the last (``sharding.step_end_moments``, in the walk)
        accum = fx.accum_bytes
        in_forward = accum if m > 1 else 0
        bwd = backward_peak(walk, in_forward, accum)
        # the sharded gradients the reduce makes, kept zeroed from step 2 (keep_grads)
        kept = st.grads_bytes if wl.keep_grads else 0
        return in_forward, bwd, in_forward + kept, bwd + kept
    in_forward = st.grads_bytes if m > 1 or fx.persistent else 0
    bwd = backward_peak(walk, in_forward, st.grads_bytes)
    # gradients zeroed, not freed (zero_grad(set_to_none=False)): from step 2 they exist
    # through forward and backward accumulates into them
    if wl.keep_grads and not in_forward:
        return in_forward, bwd, st.grads_bytes, backward_peak(walk, st.grads_bytes,
                                                              st.grads_bytes)
    return in_forward, bwd, in_forward, bwd


def _forward(shared: StageTerms, fx: StageStates, walk: Walk,
             forward_extra: int = 0) -> Callable[[bool], int]:
    """The forward's activation peak in step 1 or from step 2 on (``steady``: where the loop
    holds the previous step's logits until the loss; ``memplan.model.walk.forward_peaks``);
    ``forward_extra``: inputs alive through the forward beyond those at the backward
    (``walk.rest_saved``): the deferred pairs alive at the forward less those at the
    backward, and rope tables saved on the host."""
    # The targets exist from the step's start (the ids the loop holds are no input of the
    # graph); the loss scalars from the loss on.
    inputs = (walk.rest_saved + forward_extra + walk.head.mask_released
              - (shared.batch_bytes - shared.targets_bytes if fx.last else 0))
    return forward_peaks(walk.runs, walk.sharding, walk.other_bytes, inputs, walk.head)


def _head_block(spec: ModelSpec, shared: StageTerms, fx: StageStates) -> HeadBlock:
    """The head on the last stage (``HeadBlock.of``, shared by the estimate's stages) with
    this stage's gradients (zeros elsewhere)."""
    if not fx.last:
        return NO_HEAD
    tied = spec.tied_embeddings and fx.first  # the embedding's gradient on the same stage
    tied_grad = made_vocab_grad(shared.dm, fx.vocab_grad, fx.main_grads)[0] if tied else 0
    grads = whole_bytes(fx.params.head, fx.grad_per_param)
    block = shared.head_block.on_stage(grads, fx.vocab_grad, fx.main_grads, tied_grad)
    if not shared.loss_reduce:
        return block
    made, held, loss_fwd = _in_loss_grads(spec, shared, fx, grads, block.loss_forward)
    # the loss call reshards the head's unit: the backward gathers it again
    return block._replace(loss_forward=loss_fwd, loss_made=made, loss_held=held,
                          regather=fx.dp.head_regather)


def _in_loss_grads(spec: ModelSpec, shared: StageTerms, fx: StageStates, grads: int,
                   loss_fwd: int) -> tuple[int, int, int]:
    """A loss that runs the head's backward itself (``head.in_loss``): (the head projection's
    gradients it makes, held bytes; what its reduce leaves held; the loss's forward beyond
    what is saved, ``loss_fwd`` without the reduce). With FSDP2 and the head a unit of its
    own the last chunk reduce-scatters the summed gradient (``ChunkedLossWrapper``: the
    unit's sync on for it alone): its input (unsharded, reduce dtype) and its output shard
    beside the chunk, the input held until the unit's next reduce-scatter, after the final
    norm's backward (traced: tests/traced/test_frameworks.py, torchtitan ``loss_chunks``).
    Elsewhere the summed gradient is the gradient, made in the loss."""
    dp = fx.dp
    # the final norm's gradient is made in backward
    made = grads - whole_bytes(norm_params(spec), fx.grad_per_param)
    if dp.per_unit and not dp.separate_units:  # the root's: unsharded until backward's end
        return 0, 0, loss_fwd
    if not dp.per_unit:
        return made, 0, loss_fwd
    held = dp.unsharded(made)
    return made, held, max(loss_fwd, shared.loss_reduce + held + made)


def _embedding_block(spec: ModelSpec, wl: Workload, shared: StageTerms,
                     fx: StageStates) -> EmbeddingBlock:
    """The embedding's backward on the first stage (``EmbeddingBlock.on_stage``); elsewhere
    only the rope tables (and a checkpointed mask) are freed before the stage's last
    gradient."""
    if not fx.first:
        return EmbeddingBlock(freed_before=shared.rope_bytes)
    return NO_EMBEDDING.on_stage(
        spec, wl, shared.dm, num_params=fx.params.embedding, per_param=fx.grad_per_param,
        vocab_grad=fx.vocab_grad, main_grads=fx.main_grads,
        tied=spec.tied_embeddings and fx.last, rope_bytes=shared.rope_bytes,
        fixed=shared.embedding)


def backward_floor(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, stage: int,
                   schedule: Schedule, shared: StageTerms,
                   parts: tuple[StageStates, StageKinds],
                   made: list[Prepared] | None = None) -> int:
    """A lower bound of ``walk_stage(...).tensor_peak`` without walking the layers: the steady
    backward's peak over its first segment alone (the loss and the head, every activation of
    the micro-batches in flight alive), a prefix of the fold ``backward_peak`` makes, so never
    above it. 0 where the stage's mechanisms change the walk's gradients or its head
    (gradients accumulated unsharded, FSDP2's kept accumulators, a deferred weight gradient,
    the optimizer stepped in backward). ``made``: where given, the walk's inputs it made are
    appended (``Prepared``: ``walk_stage`` of the same stage takes them instead of making
    them again)."""
    fx, kinds = parts
    if (wl.optimizer_in_backward or fx.shard.kept_gathered
            or accumulates_unsharded(wl, fx.dp, fx.shard.kept_gathered, m)):
        return 0
    if fx.last and wl.head_wgrad_deferral is not None:
        return 0
    st = fx.states
    prepared = _prepare(spec, par, wl, m, stage, schedule, shared, parts)
    if made is not None:
        made.append(prepared)
    walk = prepared.walk[0]
    in_forward = st.grads_bytes if m > 1 or fx.persistent else 0
    # the steady state's gradients before a backward, as ``_gradients`` has them
    prior = st.grads_bytes if wl.keep_grads and not in_forward else in_forward
    base = st.params_bytes + fx.buckets + fx.buffers
    # (the pipeline runtime's buffers beside the walk: in the backward's peak too)
    return base + st.optimizer_bytes + backward_head_peak(walk, prior) + prepared.pipe.in_step
