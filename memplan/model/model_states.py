"""Parameters, gradients and optimizer states held by one rank of one pipeline stage.

Sharding follows the frameworks: TP splits matrices and column-parallel biases (ceil for the
vocabulary) and replicates norms, row-parallel biases and the router (Megatron-LM); PP puts the
embedding on the first stage and the final norm and head on the last, and a tied embedding is
held by both when p > 1 (Megatron-LM keeps a copy on the last stage and all-reduces its grads);
EP splits routed experts, then TP splits each expert. ZeRO stage 1 shards optimizer states, 2
also gradients, 3 also parameters (Rajbhandari et al. 2020), across the DP x CP group for dense
parameters and the expert-data-parallel group for experts; the most loaded rank holds the ceil.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import lru_cache
from itertools import accumulate
from typing import Any, NamedTuple

from memplan.errors import LayoutError
from memplan.model import step_in_backward
from memplan.model.adapters import ADAPTER_BYTES, adapter_bytes, adapter_policy
from memplan.model.embedding import EmbeddingBlock
from memplan.model.head import HeadBlock
from memplan.model.layer import layer_tensor_shapes
from memplan.model.mtp import depth_params as mtp_depth_params
from memplan.model.mtp import depth_tensor_shapes as mtp_depth_tensor_shapes
from memplan.model.mtp import embedding_copy, mtp_layer_index
from memplan.model.optimizer import optimizer_policy
from memplan.model.trainable import ALL, Trained, TrainablePolicy
from memplan.model.offload import cpu_offload_policy, host_optimizer_states
from memplan.parallel import (
    ExpertSplit,
    Offload,
    ParallelConfig,
    ZeroStage,
    host_optimizer,
    optimizer_on_host,
    vocab_shard,
    zero_offload,
)
from memplan.spec import ModelSpec, param_counts
from memplan.units import FP32_BYTES, ceil_div
from memplan.workload import FsdpUnits, Precision, Recompute, Workload


class StageParams(NamedTuple):
    """Parameter counts one rank of a pipeline stage holds, before ZeRO sharding."""

    dense: int  # replicated across the DP x CP group
    expert: int  # replicated across the expert-data-parallel group
    layers: tuple[int, ...]  # per layer of the stage, in layer order (dense + expert)
    embedding: int  # token (+ position) embedding on the first stage, else 0
    head: int  # final norm + output projection on the last stage (tied, p = 1: norm only)
    tensor_sizes: tuple[int, ...]  # elements of each parameter tensor on the rank, in the
    #                                order a model registers them (embedding, layers, head)
    largest_unit: int  # elements of the largest FSDP unit (a layer, or the embedding/head)
    num_tensors: int  # parameter tensors on the rank
    embedding_tensors: int = 0  # of tensor_sizes, the embedding's (the first ones)
    head_tensors: int = 0  # ... the final norm's and the head's (the last ones)
    tensor_shapes: tuple[tuple[int, ...], ...] = ()  # the shape of each of tensor_sizes

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_params(spec: ModelSpec, par: ParallelConfig, layers: list[int], *, first: bool,
                 last: bool, mtp: int = 0) -> StageParams:
    """Parameters on one TP rank of the stage holding ``layers`` (and, on the last stage,
    ``mtp`` multi-token prediction depths)."""
    return count_stage_params(spec, par.tp, par.experts, par.pp, tuple(layers), first, last,
                              par.vocab_divisor, mtp)


def count_stage_params(spec: ModelSpec, t: int, ep: int | ExpertSplit, pp: int,
                       layers: tuple[int, ...], first: bool, last: bool,
                       vocab_div: int, mtp: int = 0) -> StageParams:
    """``stage_params`` from the layout's degrees: tensor parallelism ``t``, expert
    parallelism ``ep``, ``pp`` pipeline stages, the vocabulary split by ``vocab_div``
    (``memplan.model.memo.stage_params`` caches it per layout). On the last stage ``mtp``
    depths (``memplan.model.mtp``) add a layer of the decoder's last kind each after the
    stage's ``layers``, and to the head their norms, projections and embedding copy."""
    counts = param_counts(spec)
    h = spec.hidden_size
    vocab_rows = vocab_shard(spec.vocab_size, vocab_div) * h
    depths = mtp if last else 0
    dense, expert, per_layer, embed, head = stage_param_totals(spec, t, ep, pp, layers, first,
                                                               last, vocab_div, mtp)
    shapes: list[tuple[int, ...]] = []
    if first:
        shapes += EmbeddingBlock().tensor_shapes(spec, vocab_div, 1)
    embedding_tensors = len(shapes)
    # the layers' tensors, each layer kind's shapes and sizes made once
    sizes = [math.prod(shape) for shape in shapes]
    for layer_shapes, layer_sizes, n in _layers_shapes(spec, t, ep, layers):
        shapes += layer_shapes * n
        sizes += layer_sizes * n
    layers_end = len(shapes)
    if depths:
        shapes += layer_tensor_shapes(spec, t, ep, spec.is_moe_layer(mtp_layer_index(spec))
                                      ) * depths
    before_head = len(shapes)
    if last:
        head_shapes = HeadBlock().tensor_shapes(spec, vocab_div, 1)
        if spec.param_table is not None:  # its final tensors for the final norm's
            head_shapes = [*spec.param_table.final_shapes(),
                           *head_shapes[2 if spec.norm_bias else 1:]]
        shapes += head_shapes
        # tied under pipeline parallelism the last stage holds its own copy of the embedding
        shapes += [(vocab_rows // h, h)] if spec.tied_embeddings and pp > 1 else []
        shapes += mtp_depth_tensor_shapes(spec, t) * depths
        if depths:  # MTP's embedding under PP: its word table (tied: held above), positions
            copy = [embedding_copy(spec, vocab_rows, 0, pp),
                    embedding_copy(spec, 0, counts.position_embedding, pp)]
            shapes += [(n // h, h) for n in copy if n]
    sizes += [math.prod(shape) for shape in shapes[layers_end:]]
    return StageParams(dense=dense, expert=expert, layers=tuple(per_layer), embedding=embed,
                       head=head, tensor_sizes=tuple(sizes), tensor_shapes=tuple(shapes),
                       largest_unit=max(0, embed, head, *per_layer), num_tensors=len(sizes),
                       embedding_tensors=embedding_tensors,
                       head_tensors=len(sizes) - before_head)


def _layers_shapes(spec: ModelSpec, t: int, ep: int | ExpertSplit, layers: tuple[int, ...]
                   ) -> list[tuple[list[tuple[int, ...]], list[int], int]]:
    """The tensor shapes of ``layers``, in order, as runs: (one layer's shapes, their sizes,
    how many layers in a row have them); each layer kind's made once."""
    if spec.param_table is not None:  # the tensors transformers builds (memplan.hf.param_table)
        ep_div, etp = (ep.ep, ep.etp) if isinstance(ep, ExpertSplit) else (ep, t)
        return [(shapes, [math.prod(shape) for shape in shapes], 1)
                for shapes in (spec.param_table.layer_shapes(i, t, ep_div, etp)
                               for i in layers)]
    out: list[tuple[list[tuple[int, ...]], list[int], int]] = []
    kinds: dict[tuple[bool, str], tuple[list[tuple[int, ...]], list[int]]] = {}
    if spec.moe is None and not spec.has_linear_layers:  # every layer of one kind
        shapes = list(_layer_shapes(spec, t, ep, False, ""))
        return [(shapes, [math.prod(shape) for shape in shapes], len(layers))] if layers else []
    last = None
    for i in layers:
        key = _shape_key(spec, i)
        if key == last:
            out[-1] = (*out[-1][:2], out[-1][2] + 1)
            continue
        if key not in kinds:
            shapes = list(_layer_shapes(spec, t, ep, *key))
            kinds[key] = shapes, [math.prod(shape) for shape in shapes]
        out.append((*kinds[key], 1))
        last = key
    return out


def _shape_key(spec: ModelSpec, i: int) -> tuple[bool, str]:
    """(MoE layer?, "linear" for a layer without attention) of layer ``i``: what its tensors
    depend on."""
    return spec.is_moe_layer(i), "linear" if spec.is_linear_layer(i) else ""


@lru_cache(maxsize=1024)
def _layer_shapes(spec: ModelSpec, t: int, ep: int | ExpertSplit,
                  moe: bool, variant: str = "") -> tuple[tuple[int, ...], ...]:
    """``layer_tensor_shapes``, once per layer kind and layout (every stage repeats them)."""
    return tuple(layer_tensor_shapes(spec, t, ep, moe, variant))


def stage_param_totals(spec: ModelSpec, t: int, ep: int | ExpertSplit, pp: int,
                       layers: tuple[int, ...], first: bool, last: bool, vocab_div: int,
                       mtp: int = 0) -> tuple[int, int, tuple[int, ...], int, int]:
    """``count_stage_params``' counts without the tensors: (dense, expert, each layer's,
    the embedding's, the head's), dense including the embedding's and the head's."""
    counts = param_counts(spec)
    vocab_rows = vocab_shard(spec.vocab_size, vocab_div) * spec.hidden_size
    depths = mtp if last else 0
    mtp_extra = (depths * mtp_depth_params(spec, t)
                 + embedding_copy(spec, vocab_rows, counts.position_embedding, pp)
                 if depths else 0)
    expert_div = ep.ep * ep.etp if isinstance(ep, ExpertSplit) else ep * t
    stage = list(map(counts.layers.__getitem__,
                     (*layers, *[mtp_layer_index(spec)] * depths) if depths else layers))
    # (dense, expert) of each distinct layer once, times its layers on the stage
    split = {lp: (ceil_div(lp.tp_sharded, t) + lp.replicated, lp.expert // expert_div)
             for lp in set(stage)}
    repeats = Counter(stage)
    dense = sum(split[lp][0] * n for lp, n in repeats.items())
    expert = sum(split[lp][1] * n for lp, n in repeats.items())
    per_layer = list(map({lp: d + e for lp, (d, e) in split.items()}.__getitem__, stage))
    embed = vocab_rows + counts.position_embedding if first else 0
    # Tied and p == 1: the head is the embedding itself, already counted.
    head = (counts.final_norm + (vocab_rows if counts.head or pp > 1 else 0)
            + mtp_extra) if last else 0
    return dense + embed + head, expert, tuple(per_layer), embed, head


class StateBytes(NamedTuple):
    """Persistent bytes of one rank: weights, gradients, optimizer (master copy included)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int  # master copy + optimizer states
    master_bytes: int  # the fp32 master copy alone: created with the optimizer, before step 1
    num_optimizer_params: int  # elements this rank's optimizer updates
    host_bytes: int = 0  # in host memory instead (offload): master copy, states, fp32 gradients
    scaler_bytes: int = 0  # GradScaler's state (in optimizer_bytes): made at step 1's loss
    setup_bytes: int = 0  # of optimizer_bytes, made with the optimizer beside the master copy,
    #                       before step 1 (bitsandbytes' quantization maps)
    paged_bytes: int = 0  # optimizer states in unified memory (paged optimizers), not in
    #                       optimizer_bytes: on the device while it has room


# torch.amp.GradScaler's state on the device: an fp32 scale and an int32 growth tracker, made
# at its first ``scale()`` (``_lazy_init_scale_growth_tracker`` in torch/amp/grad_scaler.py)
GRAD_SCALER_STATE_BYTES = 4 + 4
# ... and during the step, the found-inf flag ``unscale_`` makes per device (an fp32 scalar),
# alive until ``update()``; before it, ``unscale_`` computes the inverse scale in fp64
# (``self._scale.double().reciprocal()``: two fp64 scalars at once)
GRAD_SCALER_STEP_BYTES = 4
GRAD_SCALER_UNSCALE_BYTES = 8 + 8


def _shard(num: int, degree: int, sharded: bool) -> int:
    return ceil_div(num, degree) if sharded else num


def state_bytes(params: StageParams, par: ParallelConfig, wl: Workload,
                trainable: TrainablePolicy = ALL) -> StateBytes:
    """The rank's weights (all of them), and the gradients and optimizer states of the
    parameters that train (``trainable``), each sharded by ZeRO from its stage on."""
    policy = wl.precision.policy
    optimizer = optimizer_policy(wl.optimizer)
    trained = trainable.trained(params)
    z = par.zero
    dense_d, expert_d = par.dense_shard_degree, par.expert_shard_degree

    def held(dense: int, expert: int, stage: ZeroStage) -> int:
        on = z >= stage
        return _shard(dense, dense_d, on) + _shard(expert, expert_d, on)

    opt_params = held(trained.dense, trained.expert, ZeroStage.OPTIMIZER)
    params_bytes = held(params.dense, params.expert, ZeroStage.PARAMETERS) * policy.param_bytes
    device_only = 0  # bytes that are no parameter: the quantization state, whole on the device
    if trainable.adapters:
        params_bytes, device_only = lora_params_bytes(params, trainable, par,
                                                      policy.param_bytes, adapter_bytes(wl))
        policy = adapter_policy(wl)
    # only a per-tensor optimizer reads the updated tensors' shapes
    shapes = _updated_shapes(_shapes(trained), par) if optimizer.shaped else ()
    states = (step_in_backward.states(optimizer, policy, opt_params, shapes) if wl.optimizer_in_backward
              else optimizer.states(policy, opt_params, shapes))
    # one flat partition per parameter group (DeepSpeed): one tensor's step count
    updated = 1 if wl.flat_partition else len(trained.tensor_sizes)
    steps = optimizer.step_counter_bytes(wl.optimizer_impl, updated, shapes)
    grads_bytes = held(trained.dense, trained.expert, ZeroStage.GRADIENTS) * policy.grad_bytes
    num_tensors = len(trained.tensor_sizes)
    if Offload.PARAMS in par.offload and not wl.flat_partition:  # FSDP2's CPUOffloadPolicy
        # the weights move in their own dtypes (with adapters: the sharded bytes computed
        # above); a quantization state is no parameter and stays on the device
        moved = cpu_offload_policy(params_bytes - device_only, opt_params, num_tensors,
                                   policy, optimizer)
        return StateBytes(params_bytes=moved.params_bytes + device_only,
                          grads_bytes=moved.grads_bytes,
                          optimizer_bytes=0, master_bytes=0, num_optimizer_params=opt_params,
                          host_bytes=moved.host_bytes)
    if host_optimizer(par):  # torchao's CPUOffloadOptimizer (memplan.model.offload)
        device, host = host_optimizer_states(trained.tensor_sizes, policy, optimizer)
        scaler = GRAD_SCALER_STATE_BYTES if policy.grad_scaler else 0  # stays on the device
        return StateBytes(params_bytes=params_bytes, grads_bytes=grads_bytes,
                          optimizer_bytes=device + scaler, master_bytes=0,
                          num_optimizer_params=opt_params, host_bytes=host, scaler_bytes=scaler)
    if zero_offload(par) or (wl.flat_partition and optimizer_on_host(par)):  # (+ offload_param)
        return _zero_offload_states(params_bytes, grads_bytes, opt_params, wl, optimizer,
                                    max(trained.tensor_sizes, default=0), par)
    scaler = GRAD_SCALER_STATE_BYTES if policy.grad_scaler else 0
    return StateBytes(
        params_bytes=params_bytes,
        grads_bytes=grads_bytes,
        optimizer_bytes=opt_params * policy.master_bytes + states.device_bytes + steps + scaler,
        master_bytes=opt_params * policy.master_bytes,
        num_optimizer_params=opt_params,
        scaler_bytes=scaler,
        setup_bytes=states.setup_bytes,
        paged_bytes=states.paged_bytes,
    )


def _zero3_offload_states(partition_numel: int, opt_params: int, par: ParallelConfig,
                          wl: Workload) -> StateBytes:
    """DeepSpeed's ZeRO-3 with offload_optimizer (and offload_param) for a rank whose bit16
    partitions hold ``partition_numel`` elements (``memplan.model.deepspeed_zero.
    zero3_offload``): on the device the partitions alone, or nothing with offload_param."""
    from memplan.model.deepspeed_zero import zero3_offload

    policy = wl.precision.policy
    moved = zero3_offload(partition_numel, Offload.PARAMS in par.offload, policy.param_bytes,
                          policy.grad_bytes,
                          optimizer_policy(wl.optimizer).host_state_bytes_per_param())
    return StateBytes(params_bytes=moved.device_weights, grads_bytes=0, optimizer_bytes=0,
                      master_bytes=0, num_optimizer_params=opt_params, host_bytes=moved.host)


def _zero_offload_states(params_bytes: int, grads_bytes: int, opt_params: int, wl: Workload,
                         optimizer: Any, largest: int, par: ParallelConfig) -> StateBytes:
    """ZeRO-Offload's device states: the weights, and the gradient shard except under
    DeepSpeed (``wl.flat_partition``: its reduce copies each slice to the host, no device
    partition); the rest on the host. DeepSpeed's ZeRO-3: ``_zero3_offload_states``."""
    if wl.flat_partition and par.zero >= ZeroStage.PARAMETERS:
        return _zero3_offload_states(params_bytes // wl.precision.policy.param_bytes,
                                     opt_params, par, wl)
    if wl.flat_partition:
        # ZeRO-1 keeps the whole gradients through backward (``grads_bytes``, unsharded
        # below stage 2) and reduces them after it (``memplan.model.deepspeed_zero.
        # stage1_offload_reduce_bytes``); ZeRO-2 copies each slice to the host in its hook
        return StateBytes(params_bytes=params_bytes,
                          grads_bytes=grads_bytes if par.zero < ZeroStage.GRADIENTS else 0,
                          optimizer_bytes=0,
                          master_bytes=0, num_optimizer_params=opt_params,
                          host_bytes=deepspeed_offload_host_bytes(
                              opt_params, largest, wl.precision.policy.grad_bytes, optimizer))
    return StateBytes(params_bytes=params_bytes, grads_bytes=grads_bytes, optimizer_bytes=0,
                      master_bytes=0, num_optimizer_params=opt_params,
                      host_bytes=_zero_offload_host_bytes(opt_params, optimizer))


def deepspeed_offload_host_bytes(opt_params: int, largest: int, grad_bytes: int,
                                 optimizer: Any) -> int:
    """Host bytes of DeepSpeed's ZeRO-Offload at stage 1/2 (stage_1_and_2.py ``__init__`` with
    ``cpu_offload``): the fp32 partition, its fp32 gradient (``async_inplace_copy_grad_to_
    fp32_buffer_from_gpu`` copies each reduced slice into it) and the states (the CPU step's),
    as ``_zero_offload_host_bytes``; a bit16 copy of the partition
    (``param_buffer_of_bit16_for_cpu_offload_groups``) and a buffer of the largest
    parameter's size in the gradients' dtype (``temp_grad_buffer_for_cpu_offload``)."""
    return (_zero_offload_host_bytes(opt_params, optimizer) + opt_params * grad_bytes
            + largest * grad_bytes)


def _zero_offload_host_bytes(opt_params: int, optimizer: Any) -> int:
    """Host bytes of ZeRO-Offload's CPU optimizer for ``opt_params`` updated elements: an fp32
    master copy even when the GPU trains in fp32 (DeepSpeed's CPU-Adam updates its own fp32
    partition), its states, and an fp32 copy of the gradient shard it reads; the step
    counters stay on the host."""
    master, grad = FP32_BYTES, FP32_BYTES
    return opt_params * (master + optimizer.host_state_bytes_per_param() + grad)


def lora_params_bytes(params: StageParams, trainable: TrainablePolicy, par: ParallelConfig,
                      param_bytes: int, adapter_b: int = ADAPTER_BYTES) -> tuple[int, int]:
    """(weights, of them the quantization state) on one rank with LoRA: the frozen base as
    stored (unquantized weights at ``param_bytes``, a quantized weight's data and its state)
    and the adapters at ``adapter_b`` bytes each (fp32: peft's autocast_adapter_dtype; the
    model's dtype where the engine casts them, ``adapters.adapter_bytes``). ZeRO-3 shards the
    parameters (the unquantized weights, a quantized weight's data, the adapters) over the
    DP x CP group, dense and expert apart; a quantized weight's state is no parameter and
    stays whole (``adapters.quant_data_bytes``)."""
    on = par.zero >= ZeroStage.PARAMETERS
    dense_d, expert_d = par.dense_shard_degree, par.expert_shard_degree
    base = (_shard(params.dense - trainable.quantized, dense_d, on) * param_bytes
            + _shard(params.expert, expert_d, on) * param_bytes
            + _shard(trainable.quant_data_bytes, dense_d, on))
    adapters = _shard(sum(trainable.adapters), dense_d, on) * adapter_b
    return base + adapters + trainable.quant_state_bytes, trainable.quant_state_bytes


def _shapes(trained: Trained) -> tuple[tuple[int, ...], ...]:
    """The trained tensors' shapes (flat ones where only their sizes are known)."""
    return trained.tensor_shapes or tuple((n,) for n in trained.tensor_sizes)


def _updated_shapes(shapes: tuple[tuple[int, ...], ...],
                    par: ParallelConfig) -> tuple[tuple[int, ...], ...]:
    """The shape of each tensor the rank's optimizer updates: its shard of each under ZeRO
    (FSDP2 shards every parameter on dim 0; the most loaded rank holds the ceil)."""
    if par.zero >= ZeroStage.OPTIMIZER:
        d = par.dense_shard_degree
        return tuple((ceil_div(shape[0], d), *shape[1:]) for shape in shapes)
    return shapes


def optimizer_step_temp_bytes(params: StageParams, st: StateBytes, par: ParallelConfig,
                              wl: Workload, trainable: TrainablePolicy = ALL) -> int:
    """Temporaries of the optimizer step beyond the states: the implementation's
    (``memplan.model.optimizer``), over the tensors it updates (this rank's shards of them
    under ZeRO), in the dtype of what it updates (fp32 for a master copy, the weights' dtype
    without one). With a low-precision gradient and an fp32 master copy the step reads fp32
    gradients, copied shard by shard (Megatron-LM's ``_copy_model_grads_to_main_grads``):
    one fp32 copy of the updated shard. A paged optimizer (``StateBytes.paged_bytes``) adds
    the unified-memory pages of the tensor it updates, prefetched to the device.
    """
    policy = wl.precision.policy if not trainable.adapters else adapter_policy(wl)
    if optimizer_on_host(par):  # the step runs on the host
        return 0
    optimizer = optimizer_policy(wl.optimizer)
    shapes: tuple[tuple[int, ...], ...] = ()
    if optimizer.shaped:
        shapes = _updated_shapes(_shapes(trainable.trained(params)), par)
    elif optimizer.step(wl.optimizer_impl).per_tensor:  # by elements, each shard ceil(n / d)
        d = par.dense_shard_degree if par.zero >= ZeroStage.OPTIMIZER else 1
        shapes = tuple((ceil_div(n, d),) for n in trainable.trained(params).tensor_sizes)
    temp = optimizer.temp_bytes(wl.optimizer_impl, st.num_optimizer_params, shapes,
                                policy.updated.itemsize)
    if policy.master_bytes and policy.grad_bytes < FP32_BYTES:
        temp += st.num_optimizer_params * FP32_BYTES
    if wl.flat_partition:  # beside the partition and its fp32 copy (deepspeed_zero)
        from memplan.model.deepspeed_zero import step_flat_copy_bytes

        temp += step_flat_copy_bytes(st.num_optimizer_params, policy.grad_bytes)
    if policy.grad_scaler:
        return max(temp + GRAD_SCALER_STEP_BYTES, GRAD_SCALER_UNSCALE_BYTES)
    return temp


# DeepSpeed's default ZeRO reduce bucket, in elements ("reduce_bucket_size": 5e8, DeepSpeed
# configuration docs): with ZeRO-2 the unsharded gradients of one bucket exist before the
# reduce-scatter leaves only this rank's shard.
REDUCE_BUCKET_NUMEL = 500_000_000


class ShardingBuffers(NamedTuple):
    """Unsharded buffers ZeRO-2/3 needs while layers run, in bytes."""

    gathered_bytes: int  # ZeRO-3 weights gathered while a block runs, forward and backward
    gathered_at_loss_bytes: int  # ... at the loss and the head (the root and one block)
    grad_bytes: int  # unsharded gradients before their reduce-scatter (backward, from the
    #                  first gradient on)
    # gathered in backward (0 where nothing is gathered): at the head's backward, while a
    # block's backward runs, while the stage's first block's (the last in backward) runs, and
    # at the embedding's
    backward_head_bytes: int = 0
    backward_block_bytes: int = 0
    backward_last_block_bytes: int = 0
    backward_end_bytes: int = 0
    backward_final_norm_bytes: int | None = None  # gathered at the final norm's backward
    #                                              (None: ``backward_head_bytes``)
    backward_head_prefetch_bytes: int = 0  # of ``backward_head_bytes``, the block the head's
    #                                        unit prefetches, gathered only after the loss's
    #                                        backward (0: gathered through it too)
    backward_head_regather_bytes: int = 0  # the head's unit's all-gather output, alive
    #                                        beside its unsharded weights at their copy-out
    #                                        where a loss that runs the head's backward
    #                                        itself resharded it (``head.in_loss``) and the
    #                                        backward gathers it again (0: copied from the
    #                                        shard, or not gathered again)
    reduce_copies: int = 0  # unit-sized reduce-dtype tensors at a unit's reduce, where that
    #                         moment is modelled (FSDP2 at shard degree 1)
    kept_gathered: bool = False  # FSDP2 under pipeline parallelism as torchtitan runs it: every
    #                              unit stays gathered from its first forward to the step's
    #                              reduce, and gradients accumulate unsharded until then
    separate_units: bool = False  # embedding and head are units of their own (reduce-scattered
    #                               after their own backward, not at the end)
    forward_start_bytes: int = 0  # gathered at a block's start in forward, before it computes
    #                               (0: not above ``gathered_bytes`` there)
    forward_first_start_bytes: int = 0  # ... at the stage's first block's start
    queued_whole: bool = False  # gradients wait in whole unsharded buckets beside the
    #                             persistent shard (``grad_bytes`` the most alive at once),
    #                             which exists from the start (``FsdpUnits.BUCKETS``)
    window_units: int = 0  # units of ``gathered_bytes`` gathered at once in forward, fewer
    #                        over the stage's last blocks (0: not modelled)
    window_unit: int = 0  # ... the bytes of one
    bucket_bytes: int = 0  # preallocated reduce buckets held through backward (already in
    #                        the backward_* bytes above; here for the record)
    partition_bytes: int = 0  # the rank's gradient partition, whole from one point of the
    #                           backward on (not growing with the gradients made)
    partition_from: int = 0  # ... that point: -1 the head's backward, i the i-th block in
    #                          backward (0: the stage's last), beyond the blocks: at its end
    backward_reduce_bytes: int = 0  # FSDP1: gathered at a block's reduce-scatter, its own
    #                                 weights freed (the root and the block prefetched)
    flat_units: bool = False  # FSDP1: each unit's reduce-scatter input and output made and
    #                          dropped in its own post-backward hook, none held to the next
    kept_layer_bytes: int = 0  # FSDP1 SHARD_GRAD_OP: a block's gathered bytes, kept from its
    #                            gather in forward to its post-backward
    kept_layers_bytes: int = 0  # ... the stage's blocks', all kept at the forward's end
    grads_to_forward: bool = False  # FSDP1 with use_orig_params: from step 2 the sharded
    #                                 gradients are alive at the forward's start
    prefetch_tail_bytes: int = 0  # FSDP1 with LoRA's adapter units and a backward prefetch:
    #                               the block before, gathered from the hook of a block's
    #                               first adapter on (its input projections and norm)
    lazy_init_bytes: int = 0  # made and freed one at a time in the first step's forward,
    #                           before any activation: the largest such buffer (FSDP1's
    #                           padded unsharded flat parameters, ``memplan.model.fsdp1``)
    reduce_after_bytes: int = 0  # gradient bytes at a reduce after backward, nothing else of
    #                              backward alive (DeepSpeed's ZeRO-1); 0: none
    step_grads_bytes: int | None = None  # gradient bytes the optimizer step sees where they
    #                                      are not the backward's (ZeRO-1's partition; 0 with
    #                                      ZeRO-Offload); None: the same
    bucket_resident: bool = False  # ``bucket_bytes`` held from the wrap on, forward and step
    #                                included (DeepSpeed's ZeRO-3), not in the backward_* bytes
    resident_bytes: int = 0  # a device buffer held from the wrap on, every phase (DeepSpeed's
    #                          ZeRO-Offload temp_grad_buffer_for_gpu_offload)
    zero3_reduces: Any = None  # DeepSpeed's ZeRO-3: its bucket reduces, where each falls
    #                            (memplan.model.deepspeed_zero.Zero3ReducesAt)
    layer_hooks: tuple[int, ...] = ()  # ... a layer's tensors in the order of their hooks
    hook_gathers: Any = None  # ... the coordinator's gathered bytes through a layer's backward
    #                           by hook (memplan.model.deepspeed_coordinator.HookGathers), the
    #                           layers of backward_block_bytes; None: those bytes throughout
    first_hook_gathers: Any = None  # ... the stage's first layer's (backward_last_block_bytes)
    forward_block_gathers: tuple[tuple[str, int], ...] = ()  # ... gathered beside each block
    #                           of a layer's forward (deepspeed_coordinator.Positions.
    #                           layer_blocks), at most gathered_bytes; (): that throughout
    post_step_bytes: int = 0  # gathered at the optimizer step's end, no temporary of it
    #                           alive (DeepSpeed's ZeRO-3: the persistent parameters,
    #                           stage3.py _post_step)
    first_step: Any = None  # the ShardingBuffers of step 1 where they differ (DeepSpeed's
    #                         ZeRO-3 coordinator records its module trace then); None: these

    @property
    def peak_bytes(self) -> int:
        return self.gathered_bytes + self.grad_bytes + (
            0 if self.bucket_resident else self.bucket_bytes)

    def at_step(self, states: Any) -> Any:
        """``states`` (``StateBytes``) with the gradients the optimizer step sees
        (``step_grads_bytes``) where they differ from the backward's."""
        if self.step_grads_bytes is None:
            return states
        return states._replace(grads_bytes=self.step_grads_bytes)

    def forward_start(self, steady: bool, grads_bytes: int) -> int:
        """Bytes beside the weights and optimizer states at the forward's start, before any
        activation: step 1's lazy init (``lazy_init_bytes``), later steps' gradients that
        live on into it (``grads_to_forward``: ``grads_bytes``)."""
        if steady:
            return grads_bytes if self.grads_to_forward else 0
        return self.lazy_init_bytes


def separate_units(wl: Workload) -> bool:
    """torchtitan's FSDP units: the embedding and [final norm, head] units of their own."""
    return wl.fsdp_units is FsdpUnits.TORCHTITAN


def unit_bytes(params: StageParams, trainable: TrainablePolicy, e: int,
               grad_bytes: int, float8_saving: int = 0) -> tuple[int, int]:
    """(gathered, unsharded gradient) bytes of the stage's largest decoder-layer unit under
    FSDP: its weights gathered at ``e`` bytes each and gradients of ``grad_bytes``. With LoRA
    (``trainable.adapters``) a unit gathers what its parameters store: the unquantized frozen
    weights at ``e``, a quantized weight's own data as stored (``adapters.quant_data_bytes``;
    its quantization state is no parameter and is never gathered) and the fp32 adapters; and
    only the adapters have gradients (FSDP2's ``foreach_reduce`` reduces the parameters whose
    gradient is not None: frozen ones make none), in fp32."""
    if not trainable.adapters:
        layer = max(params.layers, default=0)  # less what float8 all-gathers save
        return layer * e - float8_saving, params.largest_unit * grad_bytes
    units = [(n - q) * e + data + a * ADAPTER_BYTES for n, q, data, a in zip(
        params.layers, trainable.layer_quantized, trainable.layer_quant_data_bytes,
        trainable.layer_adapters)]
    return max(units, default=0), max(trainable.layer_adapters, default=0) * ADAPTER_BYTES


def _kept_gathered_under_pp(params: StageParams, par: ParallelConfig,
                            wl: Workload) -> ShardingBuffers:
    """torchtitan's FSDP2 under PP: reshard_after_forward = not pp_enabled
    (distributed/fsdp.py get_fsdp_reshard_after_forward_policy, "default"), and torch's
    pipeline stage runs every micro-batch's backward with set_reshard_after_backward(False)
    and set_requires_gradient_sync(False) (torch/distributed/pipelining/stage.py
    backward_maybe_with_nosync), so the stage's weights stay gathered in the compute dtype
    and its gradients accumulate unsharded in the reduce dtype (_fsdp_param.py
    to_accumulated_grad_if_needed) until perform_reduce_grad runs post_backward once after
    the last micro-batch: there a unit's reduce-scatter input and its output shard exist
    beside them."""
    policy = wl.precision.policy
    gathered = params.total * policy.unsharded.itemsize
    unit = params.largest_unit * policy.grad_bytes
    return ShardingBuffers(gathered, gathered, unit + ceil_div(unit, par.dense_shard_degree),
                           kept_gathered=True)


def _forward_blocks(one_rank: bool) -> int:
    """Blocks' worth of gathered bytes while an FSDP2 block runs forward (memplan's root
    unit): its unsharded parameters and its own flat all-gather output, which
    FSDPParamGroup.wait_for_unshard (torch 2.13 _fully_shard/_fsdp_param_group.py) keeps in
    comm_ctx.all_gather_state (implicit prefetch) until the next unit's wait_for_unshard or
    the root's _post_forward (_fsdp_state.py) frees it, so a stage's only block holds it too
    (traced: one block at dp 8, its 1,319,936 B all-gather output to its forward's end); one
    at shard degree 1 (no flat all-gather output)."""
    return 1 if one_rank else 2


def sharding_buffers(params: StageParams, par: ParallelConfig, wl: Workload,
                     trainable: TrainablePolicy = ALL, float8_saving: int = 0,
                     one_rank_gather: int = 0) -> ShardingBuffers:
    """ZeRO-3/FSDP: the root's weights and two blocks gathered in the compute dtype (with
    LoRA as ``unit_bytes`` counts them: decoder-layer units and a root), and in backward a
    unit's unsharded gradient before its reduce-scatter. ZeRO-2: one reduce bucket. A block
    gathers ``float8_saving`` bytes fewer (``layer.float8_gather_saving``). At shard degree 1
    a block's gather reaches ``one_rank_gather`` bytes (``memplan.model.one_rank_unshard``;
    0: not modelled)."""
    policy = wl.precision.policy
    if par.zero >= ZeroStage.GRADIENTS and wl.fsdp_units is FsdpUnits.BUCKETS:
        return _bucketed_units(params, par, wl)
    if (par.zero >= ZeroStage.PARAMETERS and par.pp > 1
            and wl.fsdp_units in (FsdpUnits.TORCHTITAN, FsdpUnits.ROOT_RESHARDED)):
        return _kept_gathered_under_pp(params, par, wl)
    # torchtitan shards even one rank (models/llama3/parallelize.py parallelize_llama:
    # apply_fsdp_to_decoder always runs), so its gathered copies exist at any degree
    if wl.zero_bucket_buffers and par.zero >= ZeroStage.OPTIMIZER:  # DeepSpeed's
        return _preallocated_buckets(params, par, wl, trainable, policy.grad_bytes)
    if par.zero >= ZeroStage.PARAMETERS and (par.dense_shard_degree > 1 or separate_units(wl)):
        # FSDP2 as torchtitan wraps it: each block is a unit, the root holds the embedding,
        # final norm and head. The root is not resharded after forward, so its weights stay
        # gathered until the end of backward; a block's gathered weights live while the next
        # one is gathered (prefetch): two blocks at a time (traced,
        # tests/traced/test_parallel_trace).
        layer, e = max(params.layers, default=0), policy.unsharded.itemsize
        layer_b, unit_grad = unit_bytes(params, trainable, e, policy.grad_bytes, float8_saving)
        # At shard degree 1 there is no flat all-gather output: each parameter's unsharded
        # storage is filled from its cast shard (torch/.../_fully_shard/_fsdp_param_group.py
        # FSDPParamGroup.wait_for_unshard, world_size == 1): one block gathered at a time.
        one_rank = par.dense_shard_degree == 1
        blocks = 2 if len(params.layers) > 1 and not one_rank else 1  # gathered at once
        # in forward a block's own all-gather output too, a stage's only block's included
        # (``_forward_blocks``)
        forward_blocks = _forward_blocks(one_rank)
        root = params.embedding + params.head
        if separate_units(wl):
            return _separate_units(params, one_rank, layer * e - float8_saving, blocks, e,
                                   policy.grad_bytes, one_rank_gather)
        # a block's start in forward, as with torchtitan's units below: the previous unit's
        # all-gather output still held beside the block's own and its parameters (for the
        # first block the previous unit is the root, gathered itself); the root stays gathered
        root_b, blocks_b = root * e, blocks * layer_b
        start, first_start = ((0, 0) if one_rank else
                              (root_b + 3 * layer_b, 2 * root_b + 2 * layer_b))
        # a root resharded after forward: the loss's forward and backward beside the last
        # block alone (FsdpUnits.ROOT_RESHARDED), the root gathered again for the head
        resharded = root_b if wl.fsdp_units is FsdpUnits.ROOT_RESHARDED else 0
        return ShardingBuffers(root_b + forward_blocks * layer_b,
                               root_b + layer_b - resharded, unit_grad,
                               backward_head_bytes=root_b + layer_b,
                               backward_head_prefetch_bytes=resharded,
                               backward_block_bytes=root_b + blocks_b,
                               backward_last_block_bytes=root_b + layer_b,
                               # at the embedding's backward every block is resharded
                               backward_end_bytes=root_b,
                               forward_start_bytes=start, forward_first_start_bytes=first_start)
    if par.zero == ZeroStage.GRADIENTS and par.dense_shard_degree > 1:
        return ShardingBuffers(0, 0, _reduce_bucket(params, par, trainable, policy.grad_bytes))
    return ShardingBuffers(0, 0, 0)


def _preallocated_buckets(params: StageParams, par: ParallelConfig, wl: Workload,
                          trainable: TrainablePolicy, grad_bytes: int) -> ShardingBuffers:
    """DeepSpeed's reduce buckets and gradient partition (``memplan.model.deepspeed_zero``).
    The buckets are whole from the first gradient of a backward to its end, at any
    data-parallel size, nothing growing with the gradients made; the first gradient hook runs
    after the loss's backward (the head's weight gradient), so they are held beside every
    backward moment but the loss's (the ``backward_head_prefetch_bytes`` share of the head's
    bytes). The rank's gradient partition is whole from the first bucket reduce on
    (``first_reduce``, the last rank's: the most loaded), not growing with the gradients
    made. ZeRO-1's: ``_reduce_after_backward``; ZeRO-3's: ``_coordinator_gathers``."""
    from memplan.model.deepspeed_zero import bucket_bytes, first_reduce

    if par.zero >= ZeroStage.PARAMETERS:
        return _coordinator_gathers(params, par, wl, wl.precision.policy.unsharded.itemsize,
                                    grad_bytes, trainable)
    if par.zero == ZeroStage.OPTIMIZER:
        return _reduce_after_backward(params, par, wl, grad_bytes)
    held = bucket_bytes(wl.zero_bucket_numel, wl.zero_bucket_buffers, grad_bytes)
    trained = trainable.trained(params)
    partition = (_shard(trained.dense, par.dense_shard_degree, True)
                 + _shard(trained.expert, par.expert_shard_degree, True)) * grad_bytes
    if trainable.adapters:
        # LoRA (traced, tests/traced/test_deepspeed_trace.py): the optimizer's groups hold
        # the adapters alone (the Trainer's, requires_grad only), so the flat buffer, the
        # partition and the hooks are theirs; the first hook (setup_buckets) is the last
        # layer's first adapter gradient: the frozen head and final norm make none, the
        # bucket comes after their backward
        start = first_reduce(0, trainable.layer_adapters, 0, wl.zero_bucket_numel)
        return ShardingBuffers(0, 0, 0, backward_block_bytes=held,
                               backward_last_block_bytes=held, backward_end_bytes=held,
                               bucket_bytes=held, partition_bytes=partition,
                               partition_from=start)
    start = first_reduce(params.head, params.layers, params.embedding, wl.zero_bucket_numel)
    resident, hooks = 0, {}
    if zero_offload(par):
        # ZeRO-Offload (stage_1_and_2.py): no device partition; each reduce copies the rank's
        # slices to the host through an fp64 copy for the norm (set_norm_for_param_grad_in_
        # gpu) and an fp32 one (async_inplace_copy_grad_to_fp32_buffer_from_gpu), one slice at
        # a time, at the hook where the reduce runs (zero2_offload_reduces_at, placed as
        # ZeRO-3's are); a device buffer of the largest parameter
        # (temp_grad_buffer_for_gpu_offload) from the wrap on; a gradient larger than the
        # bucket is cloned in its hook and reduced alone at the next, placed the same way
        resident = max(trained.tensor_sizes, default=0) * grad_bytes
        partition, hooks = 0, _zero2_offload_hooks(params, par, wl, grad_bytes)
        start = hooks.pop("partition_from")
    return ShardingBuffers(0, 0, 0, backward_head_bytes=held, backward_block_bytes=held,
                           backward_last_block_bytes=held, backward_end_bytes=held,
                           backward_head_prefetch_bytes=held, bucket_bytes=held, **hooks,
                           partition_bytes=partition, partition_from=start,
                           resident_bytes=resident)


def _coordinator_gathers(params: StageParams, par: ParallelConfig, wl: Workload, e: int,
                         grad_bytes: int, trainable: TrainablePolicy = ALL) -> ShardingBuffers:
    """DeepSpeed's ZeRO-3 (``memplan.model.deepspeed_zero.zero3_gathers``): each module's own
    weights gathered while it runs, forward and backward (none at the loss: the head is
    released after its forward), the head's from its backward's start (its pre-backward hook,
    after the loss's backward); the reduce bucket (one, ``overlap_comm`` adds none:
    stage3.py ``_setup_for_real_optimizer``) and the gradient partition held from the wrap on,
    the hooks copying each gradient into the bucket."""
    from memplan.model.deepspeed_coordinator import (
        coordinator_positions,
        persistent,
        zero3_coordinator,
    )
    from memplan.model.deepspeed_zero import bucket_bytes, zero3_gathers

    g = zero3_gathers(params.tensor_sizes, params.embedding_tensors, params.head_tensors, e)
    held = bucket_bytes(wl.zero_bucket_numel, 1, grad_bytes)
    dp = par.dense_shard_degree
    c = zero3_coordinator(wl)
    plain_c = wl.zero3_plain_gathers or c.plain
    offload = (_zero3_lora(params, par, wl, grad_bytes, e, trainable)
               if trainable.adapters else _zero3_reduce(params, par, wl, grad_bytes, dp))
    if not plain_c:  # stage3.py _post_step: the persistent parameters gathered after each step
        kept = persistent(params.tensor_sizes, c)
        offload["post_step_bytes"] = sum(params.tensor_sizes[i] for i in kept) * e
    plain = ShardingBuffers(g.in_layer, 0, 0, backward_head_bytes=g.head, **offload,
                            backward_head_prefetch_bytes=g.head,
                            backward_block_bytes=g.in_layer,
                            backward_last_block_bytes=g.in_layer,
                            # a frozen embedding runs no backward (LoRA): nothing gathered
                            backward_end_bytes=0 if trainable.adapters else g.embedding,
                            bucket_bytes=held, bucket_resident=True)
    recomputed = wl.recompute is Recompute.FULL
    if plain_c and not recomputed:
        return (plain._replace(forward_block_gathers=_lora_block_gathers(params, e))
                if trainable.adapters else plain)
    # step 1 records the module trace (each module for its own run: ``plain``, or with
    # recomputation the replay's, which holds the weights a recomputation saved); from step
    # 2 on the coordinator prefetches, keeps and persists by it
    if recomputed:
        plain = _replayed(coordinator_positions(params, wl, c, dp, e, False), held)._replace(
            **offload)
        if trainable.adapters:
            # a frozen embedding runs no backward without checkpointing; with it (peft's
            # enable_input_require_grads) it does; an adapter's sum runs between modules:
            # nothing gathered there by the plain coordinator
            plain = plain._replace(forward_block_gathers=(
                *plain.forward_block_gathers,
                *((f"mlp.{n}_lora", 0) for n in ("gate", "up", "down"))))
    elif trainable.adapters:
        plain = plain._replace(forward_block_gathers=_lora_block_gathers(params, e))
    if plain_c:
        return plain
    if trainable.adapters:
        return _lora_replayed(params, wl, c, dp, e, held, trainable, offload, plain)
    return _replayed(coordinator_positions(params, wl, c, dp, e), held)._replace(
        first_step=plain, **offload)


def _lora_replayed(params: StageParams, wl: Workload, c: Any, dp: int, e: int, held: int,
                   trainable: TrainablePolicy, offload: dict[str, Any],
                   step1: ShardingBuffers) -> ShardingBuffers:
    """DeepSpeed's ZeRO-3 coordinator from step 2 on, replayed over a peft-wrapped Llama
    (``deepspeed_coordinator.llama_lora_trace``: each adapter a module of the recorded trace,
    each at most ``stage3_param_persistence_threshold`` elements persistent, the frozen
    weights a checkpoint's recomputation gathers released with the backward module it runs
    under; replayed exactly, tests/traced/test_deepspeed_trace.py); step 1 (``step1``) as
    the plain coordinator's; the persistent parameters gathered after each step."""
    from memplan.model.adapters import adapters_of
    from memplan.model.deepspeed_coordinator import LLAMA_PROJECTIONS, lora_positions

    ad = adapters_of(wl)
    adapted = tuple(ad is not None and name in ad.targets for name in LLAMA_PROJECTIONS)
    replayed = lora_positions(params, wl, c, dp, e, adapted, trainable.adapters)
    if replayed is None:
        raise LayoutError("DeepSpeed ZeRO-3 with LoRA on other than Llama layers",
                          "--framework deepspeed --zero 3 with LoRA: the coordinator's module "
                          "trace with adapters is modelled for Llama layers (norms, q, k, v, "
                          "o, gate, up, down)")
    steady, kept = replayed
    return _replayed(steady, held)._replace(
        first_step=step1._replace(post_step_bytes=kept), **{**offload, "post_step_bytes": kept})


def _lora_block_gathers(params: StageParams, e: int) -> tuple[tuple[str, int], ...]:
    """What the plain coordinator holds gathered beside each block of a Llama layer's forward
    under LoRA (``ShardingBuffers.forward_block_gathers``): each block's largest module
    weight (its norm's; the attention's and the MLP's largest projection), and nothing at
    the MLP's adapter sum (``mlp.lora``: peft's ``Linear.forward`` sums after ``lora_B``
    returned and was released, the base projection released before its adapter ran);
    () for a layer of other than the 9 tensors of a Llama layer."""
    from memplan.model.deepspeed_coordinator import layer_tensor_counts

    counts = layer_tensor_counts(params.tensor_sizes, params.embedding_tensors, params.layers)
    if not counts or any(n != 9 for n in counts):
        return ()
    out: dict[str, int] = {}
    start = params.embedding_tensors
    for _ in counts:
        t = params.tensor_sizes[start:start + 9]
        for name, most in (("attn_norm", t[0]), ("attn", max(t[1:5])), ("mlp_norm", t[5]),
                           ("mlp", max(t[6:9]))):
            out[name] = max(out.get(name, 0), most * e)
        start += 9
    return (*out.items(), ("mlp.lora", 0))


def _zero3_lora(params: StageParams, par: ParallelConfig, wl: Workload, grad_bytes: int,
                e: int, trainable: TrainablePolicy) -> dict[str, Any]:
    """The reduces of DeepSpeed's ZeRO-3 under peft's LoRA (traced,
    tests/traced/test_deepspeed_trace.py). Every module parameter is partitioned, the frozen
    base weights too (parameter_offload.py ``_convert_to_zero_parameters`` over
    ``module.parameters()``), and the coordinator gathers each module's own before it runs,
    the base linears' as without LoRA; the gradient hooks, the gradient partitions and the
    fp32 partitions are the adapters' alone (stage3.py
    ``create_reduce_and_remove_grad_hooks``: parameters that require grad; the optimizer's
    groups, the Trainer's, hold no other). The frozen embedding makes no gradient; without
    checkpointing its output needs none either, so it runs no backward and nothing is
    gathered for it then. The adapters' gradients fill the bucket from the last layer's on;
    when all of them fit (``reduce_bucket_size`` 5e8 elements by default) the backward's
    epilogue reduces them at once (``zero3_reduces_at``: its flat copy), after the
    embedding's place in backward. The head is released after its backward (its module's
    post-backward hook, parameter_offload.py ``PostBackwardFunctionModule`` on its input's
    gradient): the final norm's backward holds its own weight alone (``e`` bytes each).

    Refused (``LayoutError``): adapters beyond one bucket (reduced inside the layers'
    backward, not traced)."""
    from memplan.model.deepspeed_zero import zero3_reduces_at

    if sum(trainable.adapters) > wl.zero_bucket_numel:
        raise LayoutError("DeepSpeed ZeRO-3 with LoRA adapters beyond one reduce bucket",
                          f"--framework deepspeed --zero 3 with LoRA: the adapters' gradients "
                          f"({sum(trainable.adapters):,} elements) exceed the reduce bucket "
                          f"({wl.zero_bucket_numel:,}); reduces inside the layers' backward "
                          f"are not modelled with adapters")
    at = zero3_reduces_at((), tuple(() for _ in trainable.layer_adapters), trainable.adapters,
                          wl.zero_bucket_numel, par.dense_shard_degree, grad_bytes, False)
    # the one reduce is the epilogue's, beside the end of backward
    norm = params.tensor_sizes[-params.head_tensors] if params.head_tensors else 0
    return dict(zero3_reduces=at._replace(end=max(at.end, at.first)),
                partition_from=at.first_layer, layer_hooks=(),
                backward_final_norm_bytes=norm * e)


def _zero3_reduce(params: StageParams, par: ParallelConfig, wl: Workload,
                  grad_bytes: int, dp: int) -> dict[str, Any]:
    """ZeRO-3's bucket reduces (``memplan.model.deepspeed_zero.zero3_reduce_bytes``): the
    reduce-scatter's interleaved flat copy of the bucket and, with offload_optimizer, the
    device copies of a gradient partition on its way to the host; the first reduce's at the
    hook where it falls, the most a later one makes at each hook of a layer in the blocks
    after, the epilogue's at the embedding (``memplan.model.deepspeed_zero.
    zero3_reduces_at``, placed by ``memplan.model.sharding.DataParallel.block_peak``). Hooks
    in backward order: the parameters' registration order reversed (the head, the final
    norm, each layer's from its down projection to its first norm, the embedding)."""
    from memplan.model.deepspeed_zero import zero3_reduces_at

    head, layers, embedding = _in_hook_order(params, params.tensor_sizes)
    at = zero3_reduces_at(head, layers, embedding, wl.zero_bucket_numel, dp, grad_bytes,
                          optimizer_on_host(par))
    return dict(zero3_reduces=at, partition_from=at.first_layer,
                layer_hooks=layers[0] if layers else ())


def _in_hook_order(params: StageParams, items: tuple) -> tuple[tuple, tuple, tuple]:
    """``items`` (one per tensor, in the parameters' order) grouped as DeepSpeed's gradient
    hooks run: the head's (and final norm's), each layer's last to first, the embedding's,
    each group in backward order (registration order reversed)."""
    from memplan.model.deepspeed_coordinator import layer_tensor_counts

    counts = layer_tensor_counts(params.tensor_sizes, params.embedding_tensors, params.layers)
    layers, start = [], params.embedding_tensors
    for count in counts:
        layers.append(tuple(reversed(items[start:start + count])))
        start += count
    return (tuple(reversed(items[start:])), tuple(reversed(layers)),
            tuple(reversed(items[:params.embedding_tensors])))


def _zero2_offload_hooks(params: StageParams, par: ParallelConfig, wl: Workload,
                         grad_bytes: int) -> dict[str, Any]:
    """ZeRO-Offload's reduces at stage 2 (``memplan.model.deepspeed_zero.
    zero2_offload_reduces_at``) for the last rank (its partition, the flat buffer's tail,
    holds the head and the last layers, whose gradients are reduced first), hooks in backward
    order as ZeRO-3's (``_zero3_reduce``), each with its start in the flat buffer (the
    parameters in order, padded to 2 x dp elements: ``flatten_dense_tensors_aligned``)."""
    from memplan.model.deepspeed_zero import zero2_offload_reduces_at

    sizes, dp = params.tensor_sizes, par.dense_shard_degree
    items = tuple(zip((0, *accumulate(sizes[:-1])), sizes))
    size = ceil_div(sum(sizes), 2 * dp) * 2
    head, layers, embedding = _in_hook_order(params, items)
    at = zero2_offload_reduces_at(head, layers, embedding, wl.zero_bucket_numel,
                                  (dp - 1) * size, dp * size, grad_bytes)
    if at.first_layer == len(layers):  # everything in one bucket: reduced at the epilogue,
        at = at._replace(end=max(at.end, at.first))  # beside the embedding's backward
    return dict(zero3_reduces=at, partition_from=at.first_layer,
                layer_hooks=tuple(n for _, n in layers[0]) if layers else ())


def _replayed(at: Any, held: int) -> ShardingBuffers:
    """ZeRO-3's buffers from the coordinator's gathered bytes at the walk's positions
    (``memplan.model.deepspeed_coordinator.Positions``) and the resident reduce bucket."""
    return ShardingBuffers(at.in_layer, at.at_loss, 0, backward_head_bytes=at.head,
                           backward_head_prefetch_bytes=at.head - at.loss_backward,
                           backward_block_bytes=at.in_block,
                           backward_last_block_bytes=at.in_first_block,
                           backward_end_bytes=at.embedding, bucket_bytes=held,
                           bucket_resident=True, hook_gathers=at.block_hooks,
                           first_hook_gathers=at.first_block_hooks,
                           forward_block_gathers=at.layer_blocks)


def _reduce_after_backward(params: StageParams, par: ParallelConfig, wl: Workload,
                           grad_bytes: int) -> ShardingBuffers:
    """DeepSpeed's ZeRO-1 (``memplan.model.deepspeed_zero.stage1_reduce_bytes``): the bucket
    held from the first gradient hook to the end of backward (``setup_buckets``), the
    gradients whole through backward; after it, the reduce in forward order makes the first
    rank's partition (the most loaded) beside the gradients not yet moved and the bucket;
    the step sees the partition alone (``_clear_param_grad_only``)."""
    from memplan.model.deepspeed_zero import (
        bucket_bytes,
        stage1_offload_reduce_bytes,
        stage1_reduce_bytes,
    )

    held = bucket_bytes(wl.zero_bucket_numel, wl.zero_bucket_buffers, grad_bytes)
    d = par.dense_shard_degree
    partition = _shard(params.dense, d, True) * grad_bytes
    resident = 0
    if zero_offload(par):
        # ZeRO-Offload at stage 1: no device partition, each owned slice copied to the host
        # at its reduce (stage1_offload_reduce_bytes), nothing of the gradients at the step
        # (it runs on the host); temp_grad_buffer_for_gpu_offload from the wrap on
        reduce = stage1_offload_reduce_bytes(params.tensor_sizes, wl.zero_bucket_numel, d, 0,
                                             grad_bytes)
        partition, resident = 0, max(params.tensor_sizes, default=0) * grad_bytes
    else:
        reduce = stage1_reduce_bytes(params.tensor_sizes, wl.zero_bucket_numel, d, 0,
                                     grad_bytes)
    return ShardingBuffers(0, 0, 0, backward_head_bytes=held, backward_block_bytes=held,
                           backward_last_block_bytes=held, backward_end_bytes=held,
                           backward_head_prefetch_bytes=held, reduce_after_bytes=reduce,
                           step_grads_bytes=partition, resident_bytes=resident)


def _reduce_bucket(params: StageParams, par: ParallelConfig, trainable: TrainablePolicy,
                   grad_bytes: int) -> int:
    """ZeRO-2's reduce bucket of unsharded gradients, in bytes: the gradients not yet
    reduced, which are at most the ones this rank does not own (ZeRO-2 never holds more
    gradient bytes than ZeRO-1); with LoRA only the adapters' (fp32) make gradients."""
    trained, e = ((sum(trainable.adapters), ADAPTER_BYTES) if trainable.adapters
                  else (params.total, grad_bytes))
    not_owned = trained - ceil_div(trained, par.dense_shard_degree)
    return min(REDUCE_BUCKET_NUMEL, not_owned) * e


def _separate_units(params: StageParams, one_rank: bool, layer_b: int, blocks: int, e: int,
                    grad_bytes: int, one_rank_gather: int = 0) -> ShardingBuffers:
    """FSDP2 with torchtitan's units (``sharding_buffers``): ``layer_b`` the gathered bytes of
    one block, ``blocks`` how many are gathered at once, ``e`` the embedding's and head's
    weights' bytes per element, ``one_rank_gather`` a block's gather at shard degree 1."""
    # torchtitan's units: the embedding resharded after its forward; [final norm,
    # head] gathered from its forward (prefetched during the last block) to its
    # backward. In backward a block runs beside the all-gather buffer of the unit its
    # backward prefetches (the block before it; for the first block, the embedding);
    # the head's unit beside the last block's prefetch; the embedding's at the end
    # (traced: tests/traced/test_frameworks.py, torchtitan cases). The head's unit
    # prefetches in its pre_backward, a hook on its output, the logits (torch 2.13
    # _fsdp_state.py _register_pre_backward_hook, FSDPParamGroup.pre_backward ->
    # _backward_prefetch): it fires once the loss's backward has made the logits'
    # gradient, so the loss's backward runs beside the head's unit alone (traced, the
    # dp 8 torchtitan case at vocabulary 32,000, where the loss's backward is the peak).
    # At shard degree 1 a prefetch allocates nothing (unshard only marks the unit;
    # its storage is made in wait_for_unshard), so each unit is gathered alone.
    head, emb = params.head, params.embedding
    ahead = 0 if one_rank else 1  # the unit prefetched beside the running one
    # A block's start in forward: FSDPParamGroup.wait_for_unshard (torch 2.13
    # _fully_shard/_fsdp_param_group.py) drops the previous unit's all-gather output
    # from comm_ctx.all_gather_state but still holds it in its local
    # prev_all_gather_state until it returns, so the block's own all-gather output
    # and its unsharded parameters are made beside it: three units, the embedding's
    # output instead of a block's for the first (traced, torchtitan full AC cases).
    # At shard degree 1 the gather holds the block's unsharded parameters and each one's cast
    # (memplan.model.one_rank_unshard), the embedding's unit resharded after its forward.
    start, first_start = ((one_rank_gather, one_rank_gather) if one_rank
                          else (3 * layer_b, emb * e + 2 * layer_b))
    # The head's unit resharded by a loss that runs the head's backward itself (torchtitan
    # 0.3 components/loss.py ``ChunkedLossWrapper.__call__``: set_reshard_after_forward(True)
    # and lm_head.reshard() after its chunks) is gathered again in its pre_backward, at the
    # backward's start (a hook on the final norm's output, the decoder's gradient
    # ``_DecoderOutputGradientBackProp`` hands on). FSDPParamGroup.wait_for_unshard's
    # foreach_all_gather_copy_out (torch 2.13 _fsdp_collectives.py) allocates the unsharded
    # parameters (alloc_all_gather_outputs) and copies into them while the all-gather output,
    # the whole unit, is alive: it is freed after the copy-out in backward. At shard degree 1
    # the parameters are copied from the shard directly (wait_for_unshard's world_size 1
    # branch): no all-gather output (traced: tests/traced/test_frameworks.py, torchtitan
    # ``loss_chunks`` at vocabulary 32,000, dp 2 and 8; dp 1 shows none).
    regather = 0 if one_rank else head * e
    return ShardingBuffers(max(blocks * layer_b, layer_b + ahead * head * e), head * e,
                           params.largest_unit * grad_bytes,
                           backward_head_bytes=head * e + ahead * layer_b,
                           backward_head_prefetch_bytes=ahead * layer_b,
                           backward_head_regather_bytes=regather,
                           backward_block_bytes=blocks * layer_b,
                           backward_last_block_bytes=layer_b + ahead * emb * e,
                           backward_end_bytes=emb * e, separate_units=True,
                           # at shard degree 1 a unit's reduce holds its input, its
                           # output (the new gradient) and the input divided by
                           # torchtitan's factor 1.0 (_fsdp_collectives.py
                           # foreach_reduce, world_size 1 branch; torchtitan
                           # distributed/fsdp.py disable_fsdp_gradient_division)
                           reduce_copies=3 if one_rank else 0,
                           forward_start_bytes=start,
                           forward_first_start_bytes=first_start)


def _bucketed_units(params: StageParams, par: ParallelConfig, wl: Workload) -> ShardingBuffers:
    """FSDP units as buckets (``FsdpUnits.BUCKETS``, ``memplan.model.fsdp_buckets``) on one
    rank, in bytes. Weights sharded (ZeRO-3): a window of units (``gathered_units``) gathered
    in the weights' dtype beside a block in forward (fewer over the stage's last blocks) and
    in backward, one at the stage's first block's backward; the other weights (embedding,
    final norm, head) gathered from their forward to the end of backward. Gradients: the unsharded buckets of ``queued_units``
    units and the other weights' unsharded gradients, in the gradient dtype, whole beside the
    persistent shard. At shard degree 1 nothing is temporary: the buffers are the weights and
    gradients themselves (``DataParallelBuffer.is_data_distributed`` needs a group of 2)."""
    from memplan.model.fsdp_buckets import gathered_units, queued_units

    if par.dense_shard_degree == 1:
        return ShardingBuffers(0, 0, 0, queued_whole=True)
    layer, root = max(params.layers, default=0), params.embedding + params.head
    grads = (queued_units(params.layers) * layer + root) * wl.precision.policy.grad_bytes
    if par.zero < ZeroStage.PARAMETERS:  # weights whole: only the gradient buckets
        return ShardingBuffers(0, 0, grads, queued_whole=True)
    e = wl.precision.policy.param_bytes  # the gathered bucket is in the weights' dtype
    units = gathered_units(params.layers)
    window = (root + units * layer) * e
    return ShardingBuffers(window, root * e, grads, backward_head_bytes=root * e,
                           backward_block_bytes=window,
                           backward_last_block_bytes=(root + layer) * e,
                           backward_end_bytes=root * e, queued_whole=True,
                           window_units=units, window_unit=layer * e)
