"""One pipeline stage's layer kinds and states: what it holds at every micro-batch size.

Both are built once per layout and stage and shared by every micro-batch size (the states also
by every recompute policy; ``memplan.model.memo`` keeps them): ``estimate`` reads them for each
configuration, and a search evaluates many micro-batch sizes and policies of each layout.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction
from functools import lru_cache
from itertools import accumulate
from typing import NamedTuple

from memplan.model import step_in_backward
from memplan.model.adapters import adapter_bytes, adapter_policy
from memplan.model import linear, moe_titan, te_fp8
from memplan.model.attention import (attention_linears, global_buffer_bytes, rope_buffer_bytes,
                                     windowed)
from memplan.model.dims import Dims, exact_ratio
from memplan.model.falcon_h1 import mup_buffer_bytes
from memplan.model.fsdp1 import flat_units, fsdp1_buffers
from memplan.model.grad_sync import accumulator_bytes
from memplan.model.layer import float8_gather_saving, rope_normed
from memplan.model.model_states import (
    ShardingBuffers,
    StageParams,
    StateBytes,
    optimizer_step_temp_bytes,
    sharding_buffers,
    state_bytes,
)
from memplan.model.mlp import mlp_linears
from memplan.model.moments import Event, Segment, peak_of
from memplan.model.mtp import mtp_layer_index, mtp_recompute
from memplan.model.one_rank_unshard import one_rank_gather_bytes
from memplan.model.pipeline import stage_layers
from memplan.model.sharding import (
    DataParallel,
    accumulated_fresh,
    data_parallel,
    root_last_grad,
)
from memplan.model.trainable import TrainablePolicy, lora_policy
from memplan.model.walk import first_positions, runs_of
from memplan.parallel import (GradBuffers, ParallelConfig, ZeroStage, optimizer_on_host,
                              pipeline_only)
from memplan.spec import ModelSpec
from memplan.units import FP32_BYTES
from memplan.workload import Recompute, TeFp8Recipe, Workload

# (MoE layer?, recompute policy), and a third for a layer whose mixer differs from the model's
# attention: "window", a sliding-window layer whose attention differs from the full layers'
# (memplan.model.attention.windowed), or a RoPE layer whose q/k norm the NoPE layers lack
# (memplan.model.layer.rope_normed); "linear", a layer without attention: gated DeltaNet
# (memplan.model.deltanet) or LFM2's short convolution (memplan.model.short_conv)
LayerKey = tuple[bool, Recompute] | tuple[bool, Recompute, str]


def key_variant(key: LayerKey) -> str:
    """The layer variant of ``key`` (``memplan.model.layer.layer_blocks``): "" for the
    model's attention."""
    return key[2] if len(key) > 2 else ""  # type: ignore[misc]


def layer_recompute(wl: Workload, position: int) -> Recompute:
    """Full recompute of k of a stage's layers applies to its first k (Megatron-LM's 'block'
    method, ``recompute_num_layers`` per pipeline stage); ``position`` counts the stage's
    layers over all its model chunks. Full recompute of every n-th layer applies to the
    stage's n-th, 2n-th, ... layer (torchtitan v0.2.2 distributed/activation_checkpoint.py
    ``_apply_layer_sac``: a process-wide count of the blocks wrapped, each model part of the
    rank in turn, checkpoints a block when the count is a multiple of n)."""
    if wl.recompute is Recompute.FULL and wl.recompute_layers is not None:
        return Recompute.FULL if position < wl.recompute_layers else Recompute.NONE
    if wl.recompute is Recompute.FULL and wl.recompute_every is not None:
        return Recompute.FULL if (position + 1) % wl.recompute_every == 0 else Recompute.NONE
    return wl.recompute


def layer_keys(spec: ModelSpec, wl: Workload, layers: list[int]) -> list[LayerKey]:
    """(MoE layer?, recompute policy) of each layer of a stage, in order (``LayerKey``)."""
    window, normed = windowed(spec, wl), rope_normed(spec)
    if (spec.moe is None and wl.recompute_layers is None and wl.recompute_every is None
            and not window and not normed and not spec.has_linear_layers):
        return [(False, wl.recompute)] * len(layers)
    keys: list[LayerKey] = [(spec.is_moe_layer(i), layer_recompute(wl, pos))
                            for pos, i in enumerate(layers)]
    if window or normed:
        # a windowed layer, or a RoPE layer with its q/k norm (the windowed ones where both:
        # ModelSpec._check)
        keys = [(*key, "window") if (spec.is_sliding_layer(i) if window
                                     else not spec.is_nope_layer(i)) else key
                for key, i in zip(keys, layers)]
    if spec.has_linear_layers:
        keys = [(*key[:2], "linear") if spec.is_linear_layer(i) else key
                for key, i in zip(keys, layers)]
    return keys


class StageKinds(NamedTuple):
    """The kinds of one stage's layers (MoE or dense, recompute policy), in order."""

    keys: list[LayerKey]
    positions: dict[LayerKey, int]  # each kind's first layer
    counts: dict[LayerKey, int]  # layers of each kind
    runs: list[tuple[LayerKey, int]]  # runs of identical layers, in order
    chunks: list[dict[LayerKey, int]]  # layers of each kind per model chunk
    run_starts: tuple[int, ...] = ()  # where the layers' own tensors differ within a kind
    #                       (``ModelSpec.param_table``): each run's first layer on the stage,
    #                       whose parameters its gradients follow; () where a kind's first does


class StageStates(NamedTuple):
    """What one stage holds whatever the micro-batch and the recompute policy: parameters,
    states, gradient sizes and buffers."""

    first: bool
    last: bool
    params: StageParams
    states: StateBytes
    grad_per_param: int | Fraction  # held gradient bytes per parameter, exact (a shard's bytes
    #                           over its parameters need not be whole)
    opt_temp: int
    shard: ShardingBuffers
    vocab_grad: int  # the embedding's (and a tied head's) gradient in the compute dtype
    main_grads: bool  # fp32 main gradients beside the compute-dtype ones
    buckets: int  # DDP's persistent copy of the gradients
    persistent: bool  # gradients live in persistent data-parallel buffers
    buffers: int = 0  # registered buffers (RoPE tables) and TE fp8's kept weight copies,
    #                   resident like the weights
    dp: DataParallel = DataParallel()  # the data-parallel mechanism
    step: Segment = Segment(())  # the optimizer step (``optimizer_step``)
    accum_bytes: int = 0  # FSDP2's unsharded gradient accumulators without a sync
    #                       (``grad_sync.accumulator_bytes``): with LoRA the adapters' alone
    load: int = 0  # tensor bytes at the model's load, before the first step, where quantizing
    #                a base weight on the device holds more than the weights (0: not modelled)
    first_step: Segment | None = None  # step 1's optimizer step where its order differs
    #                                    (states made after the temporaries); None: ``step``
    nf4_weights: tuple[tuple[int, ...], ...] = ()  # ``TrainablePolicy.nf4_weights``: the
    #                                                 set-up ``memplan.model.nf4_init`` replays
    nf4_loads: tuple[tuple[int, ...], ...] = ()  # ``TrainablePolicy.nf4_loads``: the weights
    #                                              the load quantizes (``alloc_sequence``)

    @property
    def optimizer_phase(self) -> int:
        """Tensor bytes at the optimizer step's peak, nothing else alive."""
        return peak_of([self.step])


def optimizer_step(st: StateBytes, temp: int, buckets: int, buffers: int,
                   after: int = 0) -> Segment:
    """The optimizer step on one rank, where no activation is alive: the weights, gradients,
    master copy and optimizer states, DDP's bucket copy of the gradients and the registered
    buffers, with the step's temporaries (``optimizer_step_temp_bytes``) on top, or what is
    made at its end once they are freed (``after``: DeepSpeed's ZeRO-3 persistent parameters'
    gather, ``ShardingBuffers.post_step_bytes``)."""
    return Segment((Event("weights", st.params_bytes, None),
                    Event("gradients", st.grads_bytes, None),
                    Event("optimizer.states", st.optimizer_bytes, None),
                    Event("data_parallel.buckets", buckets, None),
                    Event("buffers", buffers, None),
                    Event("optimizer.step", 0, max(temp, after))))


def flat_partition_step(st: StateBytes, temp: int, upcast: int, buffers: int,
                        first: bool, kept: bool = False, buckets: int = 0,
                        after: int = 0) -> Segment:
    """DeepSpeed's ZeRO-2 step (``memplan.model.deepspeed_zero``) in its order: the gradient
    partition flattened and upcast beside it (``temp``: the flat copy and the fp32 gradient),
    then the partition freed, the optimizer's states made in step 1 (lazily, by the
    optimizer's first step), and the optimizer's update beside the fp32 gradient
    (``upcast``). ZeRO-3 (``kept``: the gradient partition kept through the step, stage3.py
    ``grad_partitions_flat_buffer``; ``buckets`` its reduce bucket): nothing freed; the
    persistent parameters gathered after the step (``after``: stage3.py ``_post_step``, as in
    ``optimizer_step``), the step's temporaries freed."""
    states = st.optimizer_bytes - st.master_bytes if first else 0
    return Segment((Event("weights", st.params_bytes, None),
                    Event("gradients", st.grads_bytes, None),
                    Event("optimizer.states", st.optimizer_bytes - states, None),
                    Event("buffers", buffers, None),
                    Event("data_parallel.buckets", buckets, None),
                    Event("optimizer.flatten", 0, temp),
                    Event("gradients.freed", 0 if kept else -st.grads_bytes, None),
                    Event("optimizer.first_states", states, None),
                    Event("optimizer.step", 0, upcast),
                    Event("optimizer.post_step", 0, after)))


@lru_cache(maxsize=16384)
def chunk_layer_indices(spec: ModelSpec, pp: int, vpp: int, stage: int,
                        split: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], ...]:
    """The decoder layers of each model chunk of pipeline rank ``stage`` (``split``: the
    layout's ``stage_layers``)."""
    return tuple(tuple(chunk) for chunk in stage_layers(
        spec.num_layers, pipeline_only(pp, vpp, split), stage))


@lru_cache(maxsize=16384)
def stage_layer_indices(spec: ModelSpec, pp: int, vpp: int, stage: int,
                        split: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The decoder layers of pipeline rank ``stage``, its model chunks in order."""
    return tuple(i for chunk in chunk_layer_indices(spec, pp, vpp, stage, split) for i in chunk)


def build_kinds(spec: ModelSpec, wl: Workload, pp: int, vpp: int, stage: int,
                split: tuple[int, ...] | None = None) -> StageKinds:
    chunk_layers = chunk_layer_indices(spec, pp, vpp, stage, split)
    keys = layer_keys(spec, wl, [i for chunk in chunk_layers for i in chunk])
    if wl.mtp_layers and stage == pp - 1:
        # multi-token prediction's layers follow the last chunk's (``memplan.model.mtp``)
        key = layer_keys(spec, wl.model_copy(update={"recompute": mtp_recompute(wl),
                                                     "recompute_layers": None,
                                                     "recompute_every": None}),
                         [mtp_layer_index(spec)])[0]
        keys += [key] * wl.mtp_layers
        chunk_layers = (*chunk_layers[:-1], (*chunk_layers[-1], *[-1] * wl.mtp_layers))
    positions = first_positions(keys)
    # plain dicts: a stage's kinds are compared per evaluation (``estimate._follows``), and a
    # Counter compares in Python where a dict compares in C
    counts = dict(Counter(keys)) if len(positions) > 1 else {keys[0]: len(keys)}
    ends = [0, *accumulate(len(chunk) for chunk in chunk_layers)]
    chunks = [dict(Counter(keys[ends[c]:ends[c + 1]])) for c in range(vpp)]
    if spec.param_table is None:
        return StageKinds(keys=keys, positions=positions, counts=counts, runs=runs_of(keys),
                          chunks=chunks)
    # runs of layers of one kind and the same tensors (memplan.hf.param_table): a hybrid's
    # layers read as one kind hold different parameters
    rows = spec.param_table.layer_rows
    layers = [i for chunk in chunk_layers for i in chunk]
    runs = [(key, n) for (key, _), n in runs_of([(k, rows[i]) for k, i in zip(keys, layers)])]
    starts = tuple(accumulate((n for _, n in runs[:-1]), initial=0))
    return StageKinds(keys=keys, positions=positions, counts=counts, runs=runs, chunks=chunks,
                      run_starts=starts)


def _float8_saving(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> int:
    """A block's bytes FSDP2 does not gather with its float8 all-gather (0 without)."""
    if not wl.float8_all_gather:
        return 0
    return float8_gather_saving(spec, par.tp, wl.precision.policy.unsharded.itemsize)


def _data_parallel(shard: ShardingBuffers, params: StageParams, st: StateBytes, wl: Workload,
                   trainable: TrainablePolicy, fresh_bytes: int = 0) -> DataParallel:
    """The stage's data-parallel mechanism as its backward walk sees it: with LoRA only the
    adapters have gradients, in their dtype (``memplan.model.adapters.adapter_policy``);
    ``fresh_bytes``: a new weight gradient's bytes per element beside accumulated ones
    (``sharding.accumulated_fresh``; 0: not modelled)."""
    if trainable.adapters:
        return data_parallel(shard, sum(trainable.adapters), st.grads_bytes,
                             adapter_policy(wl))
    dp = data_parallel(shard, params.total, st.grads_bytes, wl.precision.policy)._replace(
        fresh_only=bool(shard.bucket_bytes) or wl.optimizer_in_backward)
    if trainable.frozen or shard.bucket_bytes or wl.optimizer_in_backward:
        return dp  # (frozen groups: the root's last trained tensor is not modelled)
    dp = accumulated_fresh(dp, fresh_bytes)
    return root_last_grad(dp, params.tensor_sizes, params.embedding_tensors,
                          params.head_tensors, exact_ratio(st.grads_bytes,
                                                           max(params.total, 1)))


def _made_grads(par: ParallelConfig, wl: Workload, shard: ShardingBuffers,
                persistent: bool) -> tuple[bool, int]:
    """(fp32 main gradients made from compute-dtype ones; the bytes per element of a new
    weight gradient beside accumulated ones, in the dtype it is made in,
    ``sharding.accumulated_fresh``). Not modelled so (0): persistent buffers (Megatron-LM's
    fused weight-gradient GEMM accumulates into main_grad directly), FSDP2 kept gathered
    under PP (a unit's new gradients wait for its post_backward)."""
    e = wl.compute_dtype.itemsize
    main_grads = (wl.precision.policy.grad_bytes > e and par.zero < ZeroStage.PARAMETERS
                  and not shard.queued_whole)
    fresh = (0 if persistent or shard.kept_gathered
             else e if main_grads else wl.precision.policy.grad_bytes)
    return main_grads, fresh


def _sharding(spec: ModelSpec, par: ParallelConfig, wl: Workload, params: StageParams,
              trainable: TrainablePolicy, layers: list[int]) -> ShardingBuffers:
    """The stage's data-parallel buffers: FSDP1's flat units, else ``sharding_buffers`` with
    a block's float8 gather saving and its gather at shard degree 1 (not modelled with
    LoRA's adapters)."""
    if flat_units(spec, par, wl):
        return fsdp1_buffers(params, par, wl, trainable)
    one_rank = 0 if trainable.adapters else one_rank_gather_bytes(spec, par, wl, layers)
    return sharding_buffers(params, par, wl, trainable, _float8_saving(spec, par, wl),
                            one_rank)


def build_states(spec: ModelSpec, par: ParallelConfig, wl: Workload,
                 params: StageParams, stage: int) -> StageStates:
    """``params``: the stage's ``stage_params`` (cached apart, per layout)."""
    first, last = stage == 0, stage == par.pp - 1
    layers = stage_layer_indices(spec, par.pp, par.vpp, stage, par.stage_layers)
    trainable = lora_policy(spec, wl, layers, par.tp, wl.precision.policy.param_bytes, last)
    st, opt_temp = _states(params, par, wl, trainable)
    st, te_kept = te_fp8_states(st, spec, par, wl, len(layers))
    shard = _sharding(spec, par, wl, params, trainable, layers)
    e = wl.compute_dtype.itemsize
    # Gradients exist during forward when an earlier micro-batch made them, or when they live
    # in persistent data-parallel buffers; DDP's default copies them into separate buckets.
    # a DDP wrap at any data-parallel size (Workload.ddp_any_size: Megatron-LM) keeps its
    # gradient buffer from the wrap on, one rank included (DeepSpeed's ZeRO-1: its own bucket)
    ddp = ((par.data_parallel_buffers and not shard.reduce_after_bytes)
           or (wl.ddp_any_size and par.zero < ZeroStage.GRADIENTS))
    # the gradients the step sees (ZeRO-1 under DeepSpeed: the partition alone)
    at_step = shard.at_step(st)
    buckets = ((st.grads_bytes if ddp and par.grad_buffers is GradBuffers.COPY else 0)
               + (shard.bucket_bytes if shard.bucket_resident else 0) + shard.resident_bytes)
    buffers = (rope_buffer_bytes(spec, wl, len(layers)) + te_kept
               + global_buffer_bytes(spec, par, wl, len(layers))
               + mup_buffer_bytes(spec, wl, len(layers))
               + moe_titan.buffer_bytes(spec, wl, layers))
    persistent = (ddp and par.grad_buffers is GradBuffers.VIEW
                  or shard.queued_whole or shard.bucket_resident)
    main_grads, fresh = _made_grads(par, wl, shard, persistent)
    return StageStates(  # (positional, in the fields' order: a score of keywords costs more)
        first, last, params, st,  # first, last, params, states
        # grad_per_param: kept unsharded under PP (``ShardingBuffers.kept_gathered``): the
        # walk's gradients are the stage's unsharded accumulators, in the reduce dtype
        # (gradients copied into preallocated buckets at their hooks, and a partition made
        # whole at once, ``ShardingBuffers.bucket_bytes``/``partition_bytes``: none grow)
        (exact_ratio(wl.precision.policy.grad_bytes) if shard.kept_gathered
         else 0 if shard.bucket_bytes or wl.optimizer_in_backward
         else exact_ratio(st.grads_bytes, max(params.total, 1))),
        opt_temp, shard,
        # vocab_grad: a frozen head and embedding (LoRA) make no gradient
        0 if wl.lora_rank else par.vocab_shard(spec.vocab_size) * spec.hidden_size * e,
        main_grads,
        # buckets, persistent (whole-bucket units: the gradient shard is a buffer made with
        # the wrap), buffers, dp
        buckets, persistent, buffers, _data_parallel(shard, params, st, wl, trainable, fresh),
        # step: units as buckets: the weights outside the units stay gathered across steps
        # (Megatron-FSDP AllGatherPipeline.reset(preserve_non_fsdp_units=True) in
        # synchronize_param_gather), so they are alive at the step
        optimizer_step(at_step, 0 if wl.optimizer_in_backward else opt_temp,  # in bwd
                       buckets + (shard.gathered_at_loss_bytes if shard.queued_whole else 0),
                       buffers, shard.post_step_bytes),
        # accum_bytes: frozen weights make no gradient: only the adapters accumulate, in
        # their dtype
        (sum(trainable.adapters) * adapter_bytes(wl) if trainable.adapters
         else accumulator_bytes(params, wl, shard.flat_units)),
        load_bytes(st, buffers, trainable.quantize_bytes),  # load
        (flat_partition_step(at_step, opt_temp, st.num_optimizer_params * FP32_BYTES,  # first_
                             buffers, True, shard.bucket_resident, buckets,        # step
                             (shard.first_step or shard).post_step_bytes)
         if wl.flat_partition and not optimizer_on_host(par) else None),
        trainable.nf4_weights if trainable.quantize_bytes else (),  # nf4_weights
        trainable.nf4_loads)


def te_fp8_states(st: StateBytes, spec: ModelSpec, par: ParallelConfig, wl: Workload,
                  num_layers: int) -> tuple[StateBytes, int]:
    """Under Transformer Engine fp8 (``Workload.te_fp8``), a stage of ``num_layers`` decoder
    layers on one TP rank: (its states ``st`` with the parameters' bytes less by what fp8
    parameters save, each TE weight one byte an element in place of the weights' dtype
    under ``te_fp8_param_gather``; what the TE modules keep beside the parameters, resident
    like buffers: ``linear.te_fp8_weight_bytes``). (``st``, 0) without fp8."""
    if wl.te_fp8 is TeFp8Recipe.NONE:
        return st, 0
    dm = Dims.of(spec, par, wl)
    linears = (*attention_linears(spec), *mlp_linears(spec, spec.ffn_hidden_size))
    kept = num_layers * linear.te_fp8_weight_bytes(linears, dm, wl.te_fp8_amax_history_len,
                                                    wl.te_fp8_param_gather)
    if not wl.te_fp8_param_gather:
        return st, kept
    elements = sum(linear.weight_elements(lin, par.tp) for lin in linears)
    saved = num_layers * elements * (wl.precision.policy.param_bytes - te_fp8.FP8_BYTES)
    return st._replace(params_bytes=st.params_bytes - saved), kept


def first_step_states(fx: StageStates, wl: Workload) -> StageStates:
    """``fx`` with step 1's sharding buffers (``ShardingBuffers.first_step``: DeepSpeed's
    ZeRO-3 coordinator gathers each module for its own run while it records the trace)."""
    shard = fx.shard.first_step
    dp = data_parallel(shard, fx.params.total, fx.states.grads_bytes, wl.precision.policy)
    return fx._replace(shard=shard, dp=dp._replace(fresh_only=bool(shard.bucket_bytes)))


def _states(params: StageParams, par: ParallelConfig, wl: Workload,
            trainable: TrainablePolicy) -> tuple[StateBytes, int]:
    """The stage's states and its optimizer step's temporaries. Stepped in backward
    (``memplan.model.step_in_backward``) each gradient is freed by its hook (none held) and
    the temporaries are the largest one-parameter step's, its gradient included."""
    st = state_bytes(params, par, wl, trainable)
    if not wl.optimizer_in_backward:
        return st, optimizer_step_temp_bytes(params, st, par, wl, trainable)
    sizes = trainable.trained(params).tensor_sizes
    return st._replace(grads_bytes=0), step_in_backward.last_step_bytes(wl, sizes)


def load_bytes(st: StateBytes, buffers: int, quantize_bytes: int) -> int:
    """Tensor bytes at the model's load (0 where not modelled): torchtune builds the model on
    the device and then copies the checkpoint into it (``load_state_dict``), quantizing each
    weight as it arrives (``adapters.torchao_quantize_bytes``), its old quantized weight still
    held: every weight and buffer, no gradient or optimizer state yet, and the largest
    weight's quantization. The caching allocator keeps what it reserved for it into training
    (torchtune calls no ``empty_cache``), so a step's reserved peak is at least this."""
    return st.params_bytes + buffers + quantize_bytes if quantize_bytes else 0
