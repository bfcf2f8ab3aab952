"""``estimate()``: per-GPU bytes of every pipeline stage and the most loaded rank.

Phases of one training step, each a sum of what is alive at that moment (never a sum of all):

- forward: weights, optimizer states (from step 2 on), gradients when an earlier micro-batch of
  the same step has produced them (m > 1), the saved activations of every micro-batch in flight,
  the loss's logits, and ZeRO-3's gathered units.
- backward: the same at its two extremes. At its start the loss's logits-sized gradients join
  all saved activations; at its end every gradient exists while only the first layer's inputs
  remain. With m > 1 the gradients exist throughout.
- optimizer: weights, gradients, states (created here in step 1) and the step's temporaries.

Gradients are freed after each step (``zero_grad(set_to_none=True)``, PyTorch's default), so
step 1's forward and backward run without optimizer moments (fp32 master weights exist from
the optimizer's construction) and the steady state has them:
the peak is reported for both. Fixed overheads (CUDA context, workspaces, allocator share) are
separate lines on top of the tensor peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, NamedTuple

from memplan import activations as act
from memplan import moments as mom
from memplan.errors import MemplanError
from memplan.hardware import GpuSpec
from memplan.layers import (
    LayerKind,
    Walk,
    backward_peak,
    forward_peak,
    layer_kind,
    merge_terms,
    moment_params,
)
from memplan.overheads import Overheads, default_overheads
from memplan.parallel import GradBuffers, ParallelConfig, validate_layout
from memplan.pipeline import Schedule, chunks_in_flight
from memplan.spec import ModelSpec, PositionKind
from memplan.stage import StageKinds, StageStates, canonical, optimizer_phase_bytes, stage_parts
from memplan.workload import Recompute, Workload

PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class PhasePeaks:
    """Tensor bytes alive at each phase's peak (fixed overheads excluded)."""

    forward: int
    backward: int
    optimizer: int

    @property
    def peak(self) -> int:
        return max(self.forward, self.backward, self.optimizer)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=lambda name: getattr(self, name))


@dataclass(frozen=True)
class StageMemory:
    """One rank of pipeline stage ``stage``. All sizes are int bytes for that one GPU."""

    stage: int
    num_layers: int
    num_params: int  # parameters this rank holds before ZeRO sharding
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # saved activations of all micro-batches in flight
    microbatches_in_flight: int
    microbatch_bytes: int  # saved activations of one micro-batch on this stage
    activation_groups: tuple[tuple[int, tuple[act.Term, ...]], ...]  # (count, terms) of one
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

    @property
    def activation_terms(self) -> tuple[act.Term, ...]:
        """Saved terms of one micro-batch, summed by name over the stage's layers."""
        return merge_terms(self.activation_groups)

    @property
    def peak_phase(self) -> str:
        which = self.steady if self.steady.peak >= self.first_step.peak else self.first_step
        step = "steady" if which is self.steady else "first step"
        return f"{which.peak_phase} ({step})"


@dataclass(frozen=True)
class Estimate:
    """Per-GPU memory of a training job: every stage, and the most loaded rank."""

    spec: ModelSpec
    gpu: GpuSpec
    parallel: ParallelConfig
    workload: Workload
    num_microbatches: int
    global_batch_size: int
    capacity_bytes: int
    stages: tuple[StageMemory, ...]
    overheads: Overheads
    schedule: Schedule = Schedule.ONE_F_ONE_B
    calibration: Any = None  # memplan.calibrate.apply.Calibration when a profile was applied

    @property
    def assumptions(self) -> tuple[str, ...]:
        """What the numbers assume, each with its source (printed with every result)."""
        base = _assumptions(self.parallel, self.workload, self.schedule, self.overheads)
        return base if self.calibration is None else self.calibration.amend(base)

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: (s.peak_bytes, -s.stage))

    @property
    def peak_bytes(self) -> int:
        return self.worst.peak_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.peak_bytes


def resolve_batch(par: ParallelConfig, wl: Workload) -> tuple[int, int]:
    """(global batch, micro-batches per step). Default global batch fills the pipeline:
    mbs * dp * pp, i.e. m = p micro-batches."""
    per_step = wl.micro_batch_size * par.dp
    gbs = wl.global_batch_size or per_step * par.pp
    if gbs % per_step:
        raise MemplanError(
            f"gbs ({gbs}) must be divisible by mbs*dp ({wl.micro_batch_size}*{par.dp} = {per_step})")
    m = gbs // per_step
    if par.vpp > 1 and m % par.pp:
        raise MemplanError(
            f"interleaved pipeline needs micro-batches per step ({m}) divisible by pp ({par.pp})")
    return gbs, m


def _embedding_backward_extra(vocab_grad: int, embed_grads: int, *, tied: bool,
                              main_grads: bool, incoming: int, vocab_final: int) -> int:
    """Bytes beyond all gradients at the embedding's backward (first stage). Its dense
    gradient (compute dtype) is made from the gradient of its output (``incoming``, still
    alive); a tied head's gradient waits beside it and the two are summed (3 copies, then the
    sum becomes the gradient); with fp32 main gradients the compute-dtype gradient lives until
    it has been added into the fp32 one. ``vocab_final``: the token embedding's gradient as
    held (fp32 main gradient, shard); learned positions made theirs just before."""
    if tied and main_grads:  # 3 copies before the fp32 main gradient, or the sum beside it
        after = max(3 * vocab_grad - embed_grads, vocab_grad)
    elif tied:
        after = 2 * vocab_grad
    else:
        after = vocab_grad if main_grads else 0
    # while the dense gradient is made, the final gradient (or the sum) does not exist yet
    dense = (vocab_grad if tied else 0) + vocab_grad + incoming - vocab_final
    return max(after, dense)


def _shared(spec: ModelSpec, wl: Workload, dm: act.Dims) -> _Shared:
    return _shared_for(spec, _per_kind(wl), dm)


@lru_cache(maxsize=1024)
def _per_kind(wl: Workload) -> Workload:
    """What the per-kind terms read of ``wl``: not the global batch, nor how many layers get
    full recompute (the stage's layer kinds say which policy each layer has)."""
    return canonical(wl, global_batch_size=None, recompute_layers=None)


@lru_cache(maxsize=1024)
def _shared_for(spec: ModelSpec, wl: Workload, dm: act.Dims) -> _Shared:
    return _Shared(spec, wl, dm)


class _Shared:
    """Per-micro-batch terms that every stage of one estimate shares, built once."""

    def __init__(self, spec: ModelSpec, wl: Workload, dm: act.Dims) -> None:
        self.dm = dm
        self.rope = act.rope_terms(spec, dm) + act.mask_terms(wl, dm)
        self.embed = act.embedding_terms(spec, dm)
        self.head = act.head_terms(spec, wl, dm)
        self.rope_bytes, self.embed_bytes = act.total(self.rope), act.total(self.embed)
        self.head_bytes = act.total(self.head)
        self.batch_bytes = act.total(act.batch_terms(wl, dm))
        self.targets_bytes = act.batch_terms(wl, dm)[0].size_bytes
        self.loss_fwd = act.head_forward_extra_bytes(spec, wl, dm)
        self.loss_bwd = act.head_backward_extra_bytes(spec, wl, dm)
        self.head_linear_bwd = act.head_linear_backward_bytes(spec, wl, dm)
        # the causal mask lives through the forward; with recompute it is saved (a term)
        self.mask = 0 if act.mask_terms(wl, dm) else act.eager_mask_bytes(wl, dm)
        self.final_norm_extra = mom.head_forward_moment(spec, wl, dm)
        self.final_norm_bytes, self.final_norm_bwd_saved = mom.final_norm_bytes(spec, wl, dm)
        self.final_norm_bwd = mom.norm_backward_bytes(spec, wl, dm)
        self.kinds: dict[tuple[bool, Recompute], LayerKind] = {}
        self.moments: dict[tuple[int, int, tuple[bool, Recompute]], tuple[int, ...]] = {}
        self.spec, self.wl = spec, wl

    def moment_params(self, t: int, ep: int, key: tuple[bool, Recompute]) -> tuple[int, ...]:
        found = self.moments.get((t, ep, key))
        if found is None:
            found = self.moments[(t, ep, key)] = moment_params(self.spec, t, ep, key,
                                                               self.kind(key))
        return found

    def kind(self, key: tuple[bool, Recompute]) -> LayerKind:
        found = self.kinds.get(key)
        if found is None:
            found = self.kinds[key] = layer_kind(self.spec, self.wl, self.dm, *key)
        return found


class _Walked(NamedTuple):
    """One stage's phase peaks, and what its record shows beside them."""

    states: StageStates
    kinds: StageKinds
    entries: dict[tuple[bool, Recompute], tuple[LayerKind, int, tuple[int, ...]]]
    in_flight: tuple[int, ...]
    activations: int
    one_mb: int
    loss_bytes: int
    steady: PhasePeaks
    first_step: PhasePeaks

    @property
    def tensor_peak(self) -> int:
        return max(self.steady.peak, self.first_step.peak)


def _stage(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, stage: int,
           schedule: Schedule, ovh: Overheads, shared: _Shared,
           parts: tuple[StageStates, StageKinds] | None = None) -> StageMemory:
    w = _walk(spec, par, wl, m, stage, schedule, shared, parts or stage_parts(spec, par, wl)[stage])
    fx, st = w.states, w.states.st
    groups = [(par.vpp, tuple(shared.rope)), (1, tuple(shared.embed if fx.first else ())),
              (1, tuple(shared.head if fx.last else ())),
              *((n, w.entries[k][0].terms) for k, n in w.kinds.counts.items())]
    tensor_peak = w.tensor_peak
    return StageMemory(
        stage=stage, num_layers=len(w.kinds.keys), num_params=fx.sp.total,
        params_bytes=st.params_bytes, grads_bytes=st.grads_bytes,
        optimizer_bytes=st.optimizer_bytes, activations_bytes=w.activations,
        microbatches_in_flight=max(w.in_flight), microbatch_bytes=w.one_mb,
        activation_groups=tuple(groups), loss_bytes=w.loss_bytes,
        sharding_buffers_bytes=fx.shard.peak_bytes + fx.buckets,
        optimizer_temp_bytes=fx.opt_temp, steady=w.steady, first_step=w.first_step,
        tensor_peak_bytes=tensor_peak, cuda_context_bytes=ovh.cuda_context_bytes,
        workspace_bytes=ovh.workspace_bytes, allocator_bytes=ovh.allocator_bytes(tensor_peak),
        peak_bytes=_peak_bytes(tensor_peak, ovh),
    )


def _peak_bytes(tensor_peak: int, ovh: Overheads) -> int:
    """A rank's peak: its tensors' peak, the fixed overheads and the allocator's share."""
    return tensor_peak + ovh.fixed_bytes + ovh.allocator_bytes(tensor_peak)


def _walk(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, stage: int,
          schedule: Schedule, shared: _Shared, parts: tuple[StageStates, StageKinds]) -> _Walked:
    fx, kinds = parts
    first, last, sp, st = fx.first, fx.last, fx.sp, fx.st
    in_flight = _in_flight(par.pp, par.vpp, m, stage, schedule)
    grad_per_param = fx.grad_per_param

    entries: dict[tuple[bool, Recompute], tuple[LayerKind, int, tuple[int, ...]]] = {}
    for key, pos in kinds.positions.items():
        kind = shared.kind(key)
        moment_grads = tuple(int(n * grad_per_param)
                             for n in shared.moment_params(par.tp, par.ep, key))
        entries[key] = (kind, int(sp.layers[pos] * grad_per_param), moment_grads)

    rope_bytes = shared.rope_bytes  # rope tables (and a saved mask): per chunk forward
    embed_bytes = shared.embed_bytes if first else 0
    head_bytes = shared.head_bytes if last else 0
    batch = shared.batch_bytes if last else 0  # held by the training loop, not the graph
    counts = kinds.counts
    layers_saved = sum(entries[k][0].saved_bytes * n for k, n in counts.items())
    if par.vpp == 1:
        activations = in_flight[0] * (layers_saved + rope_bytes)
    else:
        activations = 0
        for chunk, count in zip(kinds.chunks, in_flight):
            chunk_saved = sum(entries[k][0].saved_bytes * n for k, n in chunk.items())
            activations += count * (chunk_saved + rope_bytes)
    # The embedding belongs to the first chunk, the loss to the last.
    activations += in_flight[0] * embed_bytes + in_flight[-1] * head_bytes
    one_mb = layers_saved + par.vpp * rope_bytes + embed_bytes + head_bytes

    shard = fx.shard
    loss_fwd = shared.loss_fwd if last else 0
    mask = shared.mask
    tied = spec.tied_embeddings and first and last
    vocab_grad, main_grads = fx.vocab_grad, fx.main_grads
    walk = Walk(
        runs=[(*entries[k], n) for k, n in kinds.runs],
        other_bytes=max(0, activations - one_mb),
        head_saved=head_bytes - batch, rest_saved=rope_bytes * par.vpp + embed_bytes + batch,
        layer_inputs=rope_bytes,
        loss_bwd=shared.loss_bwd if last else 0,
        # With fp32 main gradients the head's compute-dtype weight gradient is accumulated into
        # a new fp32 one (first micro-batch) while it still exists.
        head_linear_bwd=(shared.head_linear_bwd + vocab_grad
                         + (int(sp.head * grad_per_param) if main_grads else 0)) if last else 0,
        head_grads=int(sp.head * grad_per_param), embed_grads=int(sp.embedding * grad_per_param),
        tied_extra=_embedding_backward_extra(
            vocab_grad, int(sp.embedding * grad_per_param), tied=tied,
            main_grads=main_grads and first,
            incoming=shared.dm.tokens * spec.hidden_size * shared.dm.e,
            vocab_final=int(vocab_grad // shared.dm.e * grad_per_param)) if first else 0,
        tied_pending=vocab_grad if tied else 0,
        grad_buffer=shard.grad_bytes,
        unsharded_ratio=sp.total * wl.precision.recipe.grad_bytes / max(st.grads_bytes, 1),
        final_norm_saved=shared.final_norm_bwd_saved if last else 0,
        final_norm_all=shared.final_norm_bytes if last else 0,
        final_norm_bwd=shared.final_norm_bwd if last else 0,
        # in backward FSDP2 holds the root and the block being computed (traced)
        gathered_in_block=shard.gathered_at_loss_bytes,
        gathered_at_loss=shard.gathered_at_loss_bytes,
    )
    buckets = fx.buckets
    grads_in_forward = st.grads_bytes if m > 1 or fx.persistent else 0
    bwd_tensors = backward_peak(walk, grads_in_forward, st.grads_bytes)
    # The targets exist from the step's start; the loss scalars from the loss on.
    targets = shared.targets_bytes if last else 0
    fwd_acts = forward_peak(
        walk.runs, walk.other_bytes + walk.rest_saved - batch + targets, head_bytes - targets,
        shared.final_norm_bytes + shared.final_norm_extra if last else 0, loss_fwd,
        (shard.gathered_bytes, shard.gathered_at_loss_bytes))

    def peaks(opt_bytes: int) -> PhasePeaks:
        base = st.params_bytes + opt_bytes + buckets
        return PhasePeaks(
            forward=base + grads_in_forward + fwd_acts + mask,
            backward=base + bwd_tensors,
            optimizer=fx.optimizer_phase,
        )

    # Master weights exist from optimizer setup; moments appear at step 1's optimizer step.
    return _Walked(fx, kinds, entries, in_flight, activations, one_mb,
                   max(loss_fwd, walk.loss_bwd), peaks(st.optimizer_bytes), peaks(st.master_bytes))


def estimate(spec: ModelSpec, gpu: GpuSpec, par: ParallelConfig, wl: Workload, *,
             capacity_bytes: int | None = None, overheads: Overheads | None = None,
             schedule: Schedule = Schedule.ONE_F_ONE_B) -> Estimate:
    """Per-GPU memory of every pipeline stage for one training job.

    ``capacity_bytes`` defaults to the GPU's reported memory; ``overheads`` to the uncalibrated
    defaults for the GPU (``memplan.overheads``).
    """
    validate(spec, par, wl)
    gbs, m = resolve_batch(par, wl)
    ovh = overheads if overheads is not None else default_overheads(gpu)
    shared = _shared(spec, wl, act.Dims.of(par, wl))
    stages = _stages(spec, par, wl, m, schedule, ovh, shared)
    return Estimate(
        spec=spec, gpu=gpu, parallel=par, workload=wl, num_microbatches=m,
        global_batch_size=gbs,
        capacity_bytes=gpu.memory_bytes if capacity_bytes is None else capacity_bytes,
        stages=stages, overheads=ovh, schedule=schedule,
    )


def validate(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> None:
    """Raise MemplanError for a layout or workload ``estimate`` cannot evaluate (the batch
    sizes aside: ``resolve_batch`` checks those)."""
    validate_layout(spec, par, seq_len=wl.seq_len)
    if wl.seq_len > spec.max_seq_len and spec.position is PositionKind.LEARNED:
        raise MemplanError(
            f"seq ({wl.seq_len}) exceeds {spec.name}'s learned positions ({spec.max_seq_len})")
    per_stage = spec.num_layers // par.pp
    if wl.recompute_layers is not None and wl.recompute_layers > per_stage:
        raise MemplanError(f"recompute_layers ({wl.recompute_layers}) must be at most the layers "
                           f"per pipeline stage ({per_stage})")


def _stages(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, schedule: Schedule,
            ovh: Overheads, shared: _Shared) -> tuple[StageMemory, ...]:
    """Every stage. Interior stages with the same layer kinds differ only in micro-batches in
    flight, which shift their forward and backward peaks by whole micro-batches (chunks,
    when interleaved): one is computed, the others follow from it."""
    out: list[StageMemory] = []
    parts = stage_parts(spec, par, wl)
    template = _template(par, parts)
    for i in range(par.pp):
        if _follows(par, parts, template, i):
            flight = _in_flight(par.pp, par.vpp, m, i, schedule)
            out.append(_shifted(out[template], i, flight, par.vpp,
                                _in_flight(par.pp, par.vpp, m, template, schedule), ovh))
        else:
            out.append(_stage(spec, par, wl, m, i, schedule, ovh, shared, parts[i]))
    return tuple(out)


def _template(par: ParallelConfig,
              parts: tuple[tuple[StageStates, StageKinds], ...]) -> int | None:
    """The first interior stage others can follow from (with interleaving every chunk must hold
    the same kinds of layer)."""
    for i in range(1, par.pp - 1):
        if par.vpp == 1 or len(set(parts[i][1].keys)) == 1:
            return i
    return None


def _follows(par: ParallelConfig, parts: tuple[tuple[StageStates, StageKinds], ...],
             template: int | None, stage: int) -> bool:
    """Whether interior ``stage`` follows from the template: it holds the same kinds of layer."""
    return (template is not None and template < stage < par.pp - 1
            and parts[stage][1].keys == parts[template][1].keys)


class RankPeak(NamedTuple):
    """The most loaded rank: its stage, peak_bytes and parameters (before ZeRO sharding)."""

    stage: int
    peak_bytes: int
    num_params: int


def most_loaded(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, ovh: Overheads, *,
                schedule: Schedule = Schedule.ONE_F_ONE_B,
                limit_bytes: int | None = None,
                parts: tuple[tuple[StageStates, StageKinds], ...] | None = None) -> RankPeak:
    """``estimate(...).worst`` for a valid layout (``validate``) with ``m`` micro-batches, without
    the stages' records: for searches that evaluate many configurations. An interior stage
    that follows from another (``_stages``) is walked only if it holds more micro-batches in
    flight. With ``limit_bytes`` it returns the first stage whose peak_bytes exceed the limit
    (the configuration does not fit; another stage may peak higher). ``parts``: the layout's
    ``stage_parts``, the same at every micro-batch size (looked up when not given)."""
    shared = _shared(spec, wl, act.Dims.of(par, wl))
    parts = parts or stage_parts(spec, par, wl)
    template = _template(par, parts)
    worst: RankPeak | None = None
    for i in range(par.pp):
        if _follows(par, parts, template, i) and (
                sum(_in_flight(par.pp, par.vpp, m, i, schedule))
                <= sum(_in_flight(par.pp, par.vpp, m, template, schedule))):
            continue
        tensor = _walk(spec, par, wl, m, i, schedule, shared, parts[i]).tensor_peak
        peak = _peak_bytes(tensor, ovh)
        if worst is None or peak > worst.peak_bytes:
            worst = RankPeak(i, peak, parts[i][0].sp.total)
            if limit_bytes is not None and peak > limit_bytes:
                break
    assert worst is not None
    return worst


def optimizer_floor_bytes(spec: ModelSpec, par: ParallelConfig, wl: Workload,
                          ovh: Overheads) -> int:
    """peak_bytes of the most loaded rank at its optimizer step, where no activation is alive:
    the same at every micro-batch size, so no micro-batch of this layout peaks lower."""
    return _peak_bytes(optimizer_phase_bytes(spec, par, wl), ovh)


def batch_regime(par: ParallelConfig, m: int, schedule: Schedule = Schedule.ONE_F_ONE_B) -> tuple:
    """Everything the stages' bytes read from the micro-batch count ``m``: the micro-batches
    each stage holds in flight and whether gradients exist before a backward starts. Between
    micro-batch sizes of one regime every activation term grows with the micro-batch and
    nothing else changes, so the peak never decreases with it."""
    return m > 1, tuple(tuple(chunks_in_flight(par, m, i, schedule)) for i in range(par.pp))


@lru_cache(maxsize=8192)
def _in_flight(pp: int, vpp: int, m: int, stage: int, schedule: Schedule) -> tuple[int, ...]:
    """``chunks_in_flight``, which reads only pp and vpp of the layout."""
    return tuple(chunks_in_flight(ParallelConfig(pp=pp, vpp=vpp), m, stage, schedule))


def _shifted(template: StageMemory, stage: int, in_flight: tuple[int, ...], vpp: int,
             template_flight: tuple[int, ...], ovh: Overheads) -> StageMemory:
    """``template`` with other micro-batch counts in flight (identical chunks: each in-flight
    chunk-forward holds 1/vpp of a micro-batch's activations on the stage)."""
    delta = (sum(in_flight) - sum(template_flight)) * template.microbatch_bytes // vpp

    def shift(p: PhasePeaks) -> PhasePeaks:
        return PhasePeaks(p.forward + delta, p.backward + delta, p.optimizer)

    steady, first_step = shift(template.steady), shift(template.first_step)
    tensor_peak = max(steady.peak, first_step.peak)
    return replace(template, stage=stage, activations_bytes=template.activations_bytes + delta,
                   microbatches_in_flight=max(in_flight), steady=steady, first_step=first_step,
                   tensor_peak_bytes=tensor_peak, allocator_bytes=ovh.allocator_bytes(tensor_peak),
                   peak_bytes=_peak_bytes(tensor_peak, ovh))


def _assumptions(par: ParallelConfig, wl: Workload, schedule: Schedule,
                 ovh: Overheads) -> tuple[str, ...]:
    sched = ("interleaved 1F1B" if par.vpp > 1 else schedule.value) if par.pp > 1 else "none"
    return (
        f"pipeline schedule: {sched}",
        f"attention kernel: {wl.attention.value}; norms: {wl.norm_impl.value}; "
        f"loss on {'fp32' if wl.logits_fp32 else wl.compute_dtype.value} logits",
        ("data-parallel gradients in persistent buffers they are views of (Megatron-LM, "
         "DDP gradient_as_bucket_view=True)" if par.grad_buffers is GradBuffers.VIEW else
         "DDP gradient buckets: a persistent gradient-sized copy (PyTorch DDP default)")
        if par.data_parallel_buffers else
        "gradients freed after each optimizer step (zero_grad(set_to_none=True))",
        "MoE routing balanced across experts (no capacity drop, no imbalance)",
        f"cuda context: {ovh.cuda_context_source}",
        f"workspace: {ovh.workspace_source}",
        f"allocator: {ovh.allocator_source}",
        "NCCL buffers are not included (outside PyTorch's allocator; measured by calibration)",
    )
