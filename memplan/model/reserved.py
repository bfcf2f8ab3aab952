"""Reserved memory of a stage: its model-derived allocation sequence replayed through the
caching-allocator model, with the allocator's defaults and with ``expandable_segments:True``.

``stage_inputs`` reads what ``memplan.model.alloc_sequence`` needs of a stage's walk
(``memplan.model.stage``); ``stage_reserved`` replays it (folded) under a given
``PYTORCH_CUDA_ALLOC_CONF`` and under the same with expandable segments. The reserved peak the
estimate reports is the walk's tensor peak plus the allocator's bytes beyond the sequence's own
tensor peak at the replay's reserved peak (``StageReplay.fragmentation_bytes``), so the tensor
answer stays the walk's exact one.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, NamedTuple

from memplan.model.alloc_sequence import (
    Builder,
    LayerTensors,
    StageInputs,
    first_vs_second,
    replay_stage,
    stage_sequence,
)
from memplan.model.collector import collector_paused
from memplan.model.allocator import AllocatorConfig, parse_alloc_conf
from memplan.model.compiled import rerun_dims
from memplan.model.optimizer import optimizer_policy
from memplan.model.dims import Dims
from memplan.model.stage import Walked, walk_of, walk_stage
from memplan.model import memo
from memplan.model.head import logit_bytes
from memplan.model.stage_parts import StageStates, key_variant
from memplan.model.stage_terms import StageTerms
from memplan.parallel import ParallelConfig
from memplan.spec import ModelSpec
from memplan.workload import Recompute, Workload


class Reserved(NamedTuple):
    """A stage's reserved bytes, one rank (``memplan.model.stage.StageMemory`` carries them)."""

    reserved_peak_bytes: int
    fragmentation_bytes: int  # reserved beyond the tensor peak (rounding, splits, cache)
    expandable_reserved_peak_bytes: int  # the same with expandable_segments:True
    reserved_by_step: tuple[int, ...]  # the replay's reserved at setup's end and each step's
    step_note: str  # which step reserves more, and why
    # the step (0: set-up) where the allocator runs out of memory though the tensors fit the
    # capacity it may take (the replay under that capacity); None: it does not
    oom_step: int | None = None


def layer_tensors(states: StageStates) -> tuple[tuple[int, ...], tuple[LayerTensors, ...],
                                                 tuple[int, ...]]:
    """(the embedding's, each layer's, the head's parameter tensors) of the stage, elements
    each, from ``StageParams.tensor_sizes`` cut at each layer's parameter count."""
    p = states.params
    sizes = p.tensor_sizes
    embed = sizes[:p.embedding_tensors]
    head = sizes[len(sizes) - p.head_tensors:] if p.head_tensors else ()
    inner = list(sizes[p.embedding_tensors:len(sizes) - p.head_tensors])
    layers: list[LayerTensors] = []
    i = 0
    for count in p.layers:
        got: list[int] = []
        while i < len(inner) and sum(got) < count:
            got.append(inner[i])
            i += 1
        layers.append(LayerTensors(tuple(got)))
    return tuple(embed), tuple(layers), tuple(head)


def stage_inputs(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int,
                 walked: Walked, shared: StageTerms) -> StageInputs:
    """What the sequence reads of a walked stage."""
    fx = walked.states
    st = fx.states
    walk = walk_of(spec, par, wl, shared, walked)
    embed, layers, head = layer_tensors(fx)
    extra = st.optimizer_bytes - st.master_bytes - st.setup_bytes - st.scaler_bytes
    return StageInputs(
        walk=walk, layers=layers, embed_elements=embed, head_elements=head,
        params_bytes=st.params_bytes, grad_per_param=fx.grad_per_param,
        master_bytes=st.master_bytes, setup_bytes=st.setup_bytes,
        states_bytes=max(0, extra), num_states=optimizer_policy(wl.optimizer).num_states,
        opt_temp=fx.opt_temp, first_step_states_late=fx.first_step is not None,
        buffers=fx.buffers, buckets=fx.buckets,
        persistent_grads=st.grads_bytes if fx.persistent else 0,
        microbatches=m, keep_grads=wl.keep_grads,
        piece=shared.dm.stream(spec.hidden_size),
        logits_piece=shared.dm.tokens * shared.dm.vocab_shard * logit_bytes(wl, shared.dm),
        # FSDP2 allocates its all-gather outputs on its all-gather stream
        # (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, FSDPCommContext:
        # all_gather_stream), a pool of its own (get_free_block matches the stream)
        gather_stream=1 if walk.sharding.per_unit else 0,
        # and its sharded gradients on its reduce-scatter stream (FSDPCommContext:
        # reduce_scatter_stream; alloc_sequence._unit_gradients)
        reduce_stream=2 if walk.sharding.per_unit else 0,
        nf4_weights=fx.nf4_weights, nf4_loads=fx.nf4_loads,
        pipeline_buffers=walked.pipe.tensors,
        rebuild=tuple(_rebuilt(spec, wl, shared, key) for key, _ in walked.kinds.runs))


def _rebuilt(spec: ModelSpec, wl: Workload, shared: StageTerms, key) -> tuple[int, ...]:
    """The tensors a fully recomputed layer's backward rebuilds: what the layer saves without
    recompute (``memplan.model.layer.layer_terms``)."""
    if key[1] is not Recompute.FULL:
        return ()
    kind = memo.layer_kind(spec, memo._per_kind(wl), rerun_dims(shared.dm), key[0],
                           Recompute.NONE, key_variant(key))
    return tuple(t.size_bytes for t in kind.terms if t.size_bytes > 0)


def expandable(cfg: AllocatorConfig) -> AllocatorConfig:
    return cfg.model_copy(update={"expandable_segments": True})


@lru_cache(maxsize=256)
def config_of(alloc_conf: str, capacity_bytes: int | None) -> AllocatorConfig:
    return parse_alloc_conf(alloc_conf, capacity_bytes)


def stage_reserved(inputs: StageInputs, tensor_peak_bytes: int, cfg: AllocatorConfig,
                   capacity_bytes: int | None = None, with_expandable: bool = True) -> Reserved:
    """Replay ``inputs`` under ``cfg`` and with expandable segments (``with_expandable``
    False: not; the expandable figure is then the default one). ``capacity_bytes``: what
    cudaMalloc may take; where the tensors fit it, the replay runs under it (the allocator
    releases its wholly free cached segments and retries before it raises,
    ``DeviceCachingAllocator::malloc``), which is the unlimited replay where that reserves no
    more than the capacity."""
    # Replayed once: under the capacity where the tensors fit it. Up to the first segment
    # the capacity refuses, that replay is the unlimited one, event for event; where none is
    # refused it is the unlimited one throughout (what an unlimited replay, then a limited
    # one where its reserved peak passes the capacity, would give)
    limited = capacity_bytes is not None and tensor_peak_bytes <= capacity_bytes
    # the sequence built once where it is replayed twice
    again = with_expandable and (limited or not cfg.expandable_segments)
    built = _built(inputs) if again else None
    r = replay_stage(inputs, cfg, limit=(tensor_peak_bytes, capacity_bytes) if limited
                     else None, built=built)
    if not with_expandable:  # the expandable figure is the default one
        e = r
    else:  # without a limit, as reported
        e = (replay_stage(inputs, expandable(cfg), built=built) if not cfg.expandable_segments
             else replay_stage(inputs, cfg, built=built) if limited else r)
    # the steps' reserved bytes on the walk's tensor peak, as the peak is (setup as replayed)
    shift = tensor_peak_bytes - r.tensor_peak_bytes
    if limited and r.oom_step is not None:  # all of the capacity reserved, and not enough
        r = r._replace(reserved_peak_bytes=capacity_bytes - shift)
    setup, *steps = r.reserved_by_step
    return Reserved(tensor_peak_bytes + max(0, r.fragmentation_bytes),
                    max(0, r.fragmentation_bytes),
                    tensor_peak_bytes + max(0, e.fragmentation_bytes),
                    (setup, *(max(setup, s + shift) for s in steps)),
                    first_vs_second(r, inputs.states_bytes > 0 and inputs.num_states > 0),
                    r.oom_step)




def _built(inputs: StageInputs) -> Builder:
    """``inputs``' whole allocation sequence (``stage_sequence``), built with the cyclic
    collector paused as a replay builds it (``collector_paused``)."""
    with collector_paused():
        return stage_sequence(inputs)


def estimate_reserved(est, alloc_conf: str = "", limited: bool = True,
                      with_expandable: bool = True,
                      stop: Callable[[int, Reserved], bool] | None = None,
                      done: tuple[Reserved, ...] = ()) -> tuple[Reserved, ...]:
    """Every stage's ``Reserved`` for an ``memplan.model.estimate.Estimate`` under
    ``alloc_conf`` (``PYTORCH_CUDA_ALLOC_CONF``'s form; the device's capacity as cudaMalloc's
    limit is not applied: the replay reports what the job would reserve). A stage that follows
    from an interior template (``estimate._follows``: the same layers, other micro-batches in
    flight) takes the template's allocator bytes beyond its own tensor peak. ``limited``:
    replay under the capacity the allocator may take (False: what a job that completed on a
    larger device would reserve). ``stop``: called with each stage's index and figures once
    replayed; True ends the replay there (that stage and those before are returned).
    ``done``: the first stages' figures, as an earlier call for the same estimate and
    settings returned them (taken, not replayed again, and not passed to ``stop``)."""
    # the estimate's own stage rules
    from memplan.model.estimate import _follows, _template, stage_workload, staged

    spec, par, wl, m = est.spec, est.parallel, est.workload, est.num_microbatches
    parts = memo.stage_parts(spec, par, wl)
    cfg = config_of(alloc_conf, None)
    # a save list per stage (recompute ops): each stage replays with its own
    template = None if staged(wl) else _template(par, parts)
    out: list[Reserved] = []
    for i, stage in enumerate(est.stages):
        if i < len(done):
            out.append(done[i])
            continue
        if _follows(par, parts, template, i) and template is not None and template < len(out):
            t = out[template]
            shift = stage.tensor_peak_bytes - est.stages[template].tensor_peak_bytes
            out.append(t._replace(
                reserved_peak_bytes=t.reserved_peak_bytes + shift,
                expandable_reserved_peak_bytes=t.expandable_reserved_peak_bytes + shift))
            continue
        swl = stage_workload(wl, i) if staged(wl) else wl
        shared = memo.shared_terms(spec, swl, Dims.of(spec, par, swl), par.experts, parts)
        walked = walk_stage(spec, par, swl, m, i, est.schedule, shared, parts[i])
        inputs = stage_inputs(spec, par, swl, m, walked, shared)
        # what the allocator may take: the device's capacity less the CUDA context and the
        # cuBLAS workspace (an allocation of its own the sequence leaves out)
        room = est.capacity_bytes - stage.cuda_context_bytes - stage.workspace_bytes
        out.append(stage_reserved(inputs, stage.tensor_peak_bytes, cfg,
                                  room if limited else None, with_expandable))
        if stop is not None and stop(i, out[-1]):
            break
    return tuple(out)


class RankReserved(NamedTuple):
    """The rank that needs the most device memory once the caching allocator is replayed."""

    peak_bytes: int  # its reserved peak + calibration + CUDA context + workspace
    stage: int
    oom_step: int | None  # the allocator runs out of memory although the tensors fit
    # every stage replayed (False: stopped at the first over ``reserved_rank``'s ``above``,
    # whose ``peak_bytes`` is then a lower bound of the rank's)
    exact: bool = True
    stages: tuple[Reserved, ...] = ()  # each stage replayed, in order


def reserved_rank(est, above: int | None = None, alloc_conf: str = "",
                  done: tuple[Reserved, ...] = ()) -> RankReserved:
    """``estimate_reserved`` of ``est`` under the allocator's defaults and the device's
    capacity, read as the per-GPU peak ``plan`` fits: each stage's reserved peak with its
    calibration correction, fixed overheads and a calibration's measured allocator residual
    (``StageMemory.allocator_bytes``; 0 uncalibrated). The defaults alone (``alloc_conf``:
    other settings): no expandable replay. With ``above`` the replay stops at the first
    stage that peaks above it or runs out of memory (all a search that asks whether it fits
    needs). ``done``: ``estimate_reserved``'s (an earlier call's ``stages`` for the same
    estimate and ``alloc_conf``)."""
    def row(i: int, r: Reserved) -> int:
        s = est.stages[i]
        return (r.reserved_peak_bytes + s.calibration_bytes + s.cuda_context_bytes
                + s.workspace_bytes + s.allocator_bytes)

    def over(i: int, r: Reserved) -> bool:
        return above is not None and (r.oom_step is not None or row(i, r) > above)

    got = estimate_reserved(est, alloc_conf, with_expandable=False, stop=over, done=done)
    rows = [(row(i, r), est.stages[i].stage, r.oom_step) for i, r in enumerate(got)]
    peak, stage, _ = max(rows, key=lambda x: x[0])
    oom = next((o for _, _, o in rows if o is not None), None)
    return RankReserved(peak, stage, oom, len(got) == len(est.stages), got)
