"""Step-time model: FLOPs, communication per parallel dimension, pipeline bubble.

Torch-free, for ranking layouts (``memplan plan``), not for promising a wall-clock number: the
achievable FLOP/s is the catalog peak times a stated MFU assumption until calibration measures
it, and each kind of communication has a stated overlap with compute.

FLOPs per token (forward, one model replica) count every matmul: 2 FLOPs per multiply-add of the
projection weights (MoE: the top-k experts a token visits) and the output head, plus causal
attention's two batched matmuls, 2 * 2 * (s/2) * a * d on average per token per layer
(Narayanan et al. 2021, arXiv 2104.04473, section 5.1, without the causal halving there).
Backward costs twice the forward. With ``Workload.step_model`` kernels (the Megatron-LM preset's,
``memplan.presets``) the step is timed kernel by kernel instead of at a flat fraction of peak:
GEMMs at their measured rates, the memory-bound per-token kernels (norms, bias-dropout-add,
activation, softmax over materialised scores, the loss) by the bytes they move over the HBM
bandwidth (``elementwise_seconds``), the optimizer's step by its bytes too
(``optimizer_step_seconds``). Full recompute reruns each
recomputed layer's forward, read per pipeline stage as the memory model reads it:
``recompute_layers`` = k is the first k layers of every stage's layer list
(``memplan.model.stage_parts.layer_recompute``), so k * pp layers in all. Selective recompute reruns the attention core's matmuls.

The formulas take numpy arrays with one entry per candidate (``Columns.of``), so a search times
all its candidates in one pass; ``step_time`` is the same computation for one layout on plain
numbers (``Columns.one``), so that timing one estimate imports no numpy (about 75 ms of a cold
``memplan estimate``) and gives the same floats as the vectorised pass.
"""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import accumulate
from typing import TYPE_CHECKING, Any, NamedTuple

from memplan.choices import PlainEnum
from memplan.hardware import GpuSpec
from memplan.model.flops import head_flops_per_token, layer_flops
from memplan.model.layer import float8_gather_saving
from memplan.model.mtp import mtp_flops_per_token, mtp_layer_index
from memplan.model.optimizer import optimizer_policy
from memplan.model.pipeline import stage_layers
from memplan.model.sac import recomputed
from memplan.model import sac_ops
from memplan.parallel import (Offload, ParallelConfig, ZeroStage, local_seq, optimizer_on_host,
                             pipeline_only, rank_layers)
from memplan.spec import ModelSpec
from memplan.units import FP32_BYTES
from memplan.planning.kernels import (ACHIEVABLE_HBM, attention_time_factor,
                                      elementwise_bytes, float8_cast_seconds, gemm_best_rate,
                                      gemm_time_factor, linear_time_factor, loss_bytes_per_token)
from memplan.workload import (Attention, CpExchange, Float8Recipe, MoeImpl, PipelineP2p,
                              Recompute, SelectiveImpl, StepModel, Workload)

if TYPE_CHECKING:
    import numpy as np

    from memplan.model.estimate import Estimate

# Llama 3 405B pre-training reached 38-43% BF16 MFU on 16k H100s (Dubey et al. 2024, arXiv
# 2407.21783, Table 4); the midpoint is the assumption until calibration measures it. It is an
# end-to-end rate: the whole step's model FLOPs over its time, so it holds the GEMMs, the
# memory-bound kernels and everything else a step spends per FLOP. Where the step is timed
# kernel by kernel (``StepModel.KERNELS``: ``_step_fields``) the GEMMs run at their own measured rates
# (``memplan.planning.kernels.gemm_time_factor``) and the memory-bound kernels by their bytes
# (``elementwise_seconds``) instead; ``mfu`` then only scales FLOPs to seconds and cancels.
DEFAULT_MFU = 0.40
MFU_SOURCE = "assumption: 40% of peak (Llama 3 paper, Table 4: 38-43% on H100) until calibrated"

# Fraction of each communication hidden behind compute, stated assumptions: tensor-parallel
# collectives sit between dependent matmuls (exposed, Megatron-LM without TP comm overlap);
# pipeline sends of one micro-batch overlap the next one's compute (unless they block:
# ``PipelineP2p.BLOCKING``); expert all-to-all is exposed. Data-parallel collectives and the
# context-parallel ring are timed against the compute beside them instead (``_windowed``:
# ``dp_exposed``, ``ring_exposed``; their entries here are not read).
# An offloaded optimizer (ZeRO-Offload, Ren et al. 2021, section 4.1) copies each gradient
# shard to the host during backward (overlapped as the data-parallel reduction is); its CPU
# step and the copy of the updated weights back to the GPU sit between two steps (exposed,
# without the one-step delayed update). Weights kept on the host (DeepSpeed's offload_param)
# are copied to the GPU before each gather (partitioned_param_swapper's swap-in ahead of the
# all-gather): taken as exposed, an upper bound where the coordinator's prefetch hides some.
OVERLAP = {"tp": 0.0, "dp": 0.8, "pp": 0.5, "cp": 0.5, "ep": 0.0, "host_grads": 0.8,
           "host_step": 0.0, "host_params": 0.0}


class Bound(PlainEnum):
    COMPUTE = "compute"
    COMMUNICATION = "communication"
    BUBBLE = "pipeline bubble"


# StepTime, Columns and StepTimes are NamedTuples: immutable like a frozen dataclass, and
# defined in a fifth of the time, which every `memplan estimate` pays (~1 ms each otherwise).
class StepTime(NamedTuple):
    """One training step of one GPU, seconds; FLOPs of the whole job."""

    model_flops: float  # 3x forward, what MFU counts
    hardware_flops: float  # model FLOPs plus recompute
    compute_s: float
    comm_s: dict[str, float]  # per dimension, before overlap
    exposed_comm_s: float
    bubble_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    bound: Bound


@lru_cache(maxsize=256)
def forward_flops_per_token(spec: ModelSpec, seq_len: int, every_expert: bool = False
                            ) -> tuple[float, float, float]:
    """(projection and head matmuls, attention score matmuls, the latter's mean per layer)
    FLOPs of one token's forward through the whole model: the layers' from their blocks
    (``memplan.model.flops``; ``every_expert``: the MoE layers' every expert, as the code
    runs them, ``runs_every_expert``), the head's 2 per weight."""
    layers = layer_flops(spec, seq_len, every_expert)
    attention = sum(layer.attention for layer in layers)
    return (sum(layer.matmul for layer in layers) + head_flops_per_token(spec), attention,
            attention / spec.num_layers)


@lru_cache(maxsize=256)
def layer_forward_flops(spec: ModelSpec, seq_len: int, every_expert: bool = False
                        ) -> tuple[float, ...]:
    """Forward FLOPs of one token through each layer (``memplan.model.flops``)."""
    return tuple(layer.total for layer in layer_flops(spec, seq_len, every_expert))


def runs_every_expert(spec: ModelSpec, wl: Workload) -> bool:
    """Whether the MoE layers run every token through every expert (``MoeImpl.EVERY``:
    transformers' Llama4TextMoe.forward, a bmm over all experts with the unrouted scores
    zero): the step's hardware FLOPs count them all, its model FLOPs the routed top-k."""
    return spec.moe is not None and wl.moe_impl is MoeImpl.EVERY


@lru_cache(maxsize=1024)
def recomputed_layers(num_layers: int, recompute_layers: int | None, pp: int,
                      vpp: int = 1, split: tuple[int, ...] | None = None,
                      every: int | None = None) -> tuple[int, ...]:
    """Indices of the layers full recompute of ``recompute_layers`` per stage reruns: the first
    k of each pipeline rank's layer list, its chunks in order; with ``every`` n instead, the
    n-th, 2n-th, ... of that list (``memplan.model.stage_parts.layer_recompute`` on
    ``memplan.model.pipeline.stage_layers``)."""
    par = pipeline_only(pp, vpp, split)
    out: list[int] = []
    for stage in range(pp):
        layers = [i for chunk in stage_layers(num_layers, par, stage) for i in chunk]
        out += layers[every - 1::every] if every is not None else layers[:recompute_layers]
    return tuple(sorted(out))


@lru_cache(maxsize=4096)
def stage_balance(spec: ModelSpec, wl: Workload, pp: int, vpp: int = 1,
                  split: tuple[int, ...] | None = None) -> float:
    """The busiest pipeline rank's FLOPs over the mean rank's: a pipeline runs at the pace of
    its slowest stage (each micro-batch waits for it), so its compute time is the mean's
    times this. A rank's FLOPs per token are its layers' (``layer_forward_flops``) and, on
    the rank of the last virtual stage, the head's, three forwards each (forward and
    backward) plus one more for what full recompute reruns and for the head of a chunked
    loss. 1.0 without pipeline parallelism."""
    if pp == 1:
        return 1.0
    per_layer = layer_forward_flops(spec, wl.seq_len, runs_every_expert(spec, wl))
    par = pipeline_only(pp, vpp, split)
    rerun = set()
    if wl.recompute is Recompute.FULL:
        rerun = (set(range(spec.num_layers))
                 if wl.recompute_layers is None and wl.recompute_every is None else
                 set(recomputed_layers(spec.num_layers, wl.recompute_layers, pp, vpp, split,
                                       wl.recompute_every)))
    head = (head_flops_per_token(spec) * (4 if wl.loss_checkpointed else 3)
            + 3 * _mtp_flops(spec, wl))
    # op-level checkpointing with a list per stage: each rank reruns its own list's ops
    ops = (ops_stage_rerun(spec, wl, pp) if wl.recompute is Recompute.OPS
           and sac_ops.stage_scoped(wl.recompute_save) else [0.0] * pp)
    ranks = []
    for stage in range(pp):
        layers = [i for chunk in stage_layers(spec.num_layers, par, stage) for i in chunk]
        ranks.append(sum(per_layer[i] * (4 if i in rerun else 3) + ops[stage] for i in layers)
                     + (head if stage == pp - 1 else 0.0))
    return max(ranks) * pp / sum(ranks)


def step_flops(spec: ModelSpec, wl: Workload, global_batch: int, *, pp: int,
               vpp: int = 1, split: tuple[int, ...] | None = None) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step of the whole job with ``pp`` pipeline stages
    of ``vpp`` chunks each: ``wl.recompute_layers`` counts per stage, as in memory."""
    tokens = global_batch * wl.seq_len
    matmul, attention, _ = forward_flops_per_token(spec, wl.seq_len)
    forward = matmul + attention
    model = (3.0 * (forward + _mtp_flops(spec, wl)) - _frozen_wgrad(spec, wl, matmul)) * tokens
    head = head_flops_per_token(spec)
    # a chunked loss reruns each chunk's head projection in its backward
    extra = head * tokens if wl.loss_checkpointed else 0.0
    every = runs_every_expert(spec, wl)
    if every:  # the unrouted experts' forward and backward: work, not model FLOPs
        ran = forward_flops_per_token(spec, wl.seq_len, True)[0] - matmul
        extra += (2.0 if _frozen_wgrad(spec, wl, matmul) else 3.0) * ran * tokens
        forward += ran
    if wl.recompute is Recompute.FULL:
        k = wl.recompute_layers
        largest = max(rank_layers(spec.num_layers, pipeline_only(pp, vpp, split)))
        if wl.recompute_every is None and (k is None or k >= largest):  # every layer
            per_layer = (forward - head) / spec.num_layers
            extra += per_layer * spec.num_layers * tokens
        else:
            per_token = layer_forward_flops(spec, wl.seq_len, every)
            rerun = sum(per_token[i] for i in recomputed_layers(spec.num_layers, k, pp, vpp,
                                                                         split, wl.recompute_every))
            extra += float(rerun * tokens)
    elif wl.recompute is Recompute.OPS:
        # op-level checkpointing reruns the ops its save list does not keep (each stage's)
        par = pipeline_only(pp, vpp, split)
        per_stage = ops_stage_rerun(spec, wl, pp)
        extra += sum(per_stage[s] * rank_layers(spec.num_layers, par)[s]
                     for s in range(pp)) * tokens
    elif wl.recompute is Recompute.SELECTIVE and wl.selective_impl is SelectiveImpl.OP:
        # per-op SAC reruns the matmuls it does not keep (every second one; memplan.model.sac)
        # and not the attention kernel, whose output it keeps
        extra += sum(_sac_rerun_flops(spec, wl, spec.is_moe_layer(i))
                     for i in range(spec.num_layers)) * tokens
    elif wl.recompute is Recompute.SELECTIVE:
        extra += attention * tokens
    return model, model + extra


def _frozen_wgrad(spec: ModelSpec, wl: Workload, matmul: float) -> float:
    """Per token, the weight-gradient FLOPs frozen weights skip, less what LoRA's adapters
    add. With adapters (``memplan.model.adapters``) every base weight is frozen: its backward
    makes the input's gradient (as many FLOPs as its forward) and no weight gradient, so the
    step is 2x the matmuls' forward, not 3x. Each adapted projection adds its two rank-r
    matmuls, 2r(d_in + d_out) per token forward, 3x that with their gradients (both train)."""
    from memplan.model.adapters import adapters_of
    from memplan.model.layer import layer_linears

    ad = adapters_of(wl, spec.fused_qkv or wl.fused_qkv)
    if ad is None:
        return 0.0
    added = sum(2 * ad.rank * (lin.d_in + lin.d_out)
                for i in range(spec.num_layers)
                for lin in layer_linears(spec, spec.is_moe_layer(i),
                                         "linear" if spec.is_linear_layer(i) else "")
                if ad.adapts(lin))
    return matmul - 3.0 * added


def _mtp_flops(spec: ModelSpec, wl: Workload) -> float:
    """Forward FLOPs per token of the multi-token prediction depths on the last stage
    (``memplan.model.mtp.mtp_flops_per_token``: a layer of the decoder's last kind, the
    output layer, ``eh_proj`` and three norms each; their recompute is not counted)."""
    if not wl.mtp_layers:
        return 0.0
    layer = layer_forward_flops(spec, wl.seq_len)[mtp_layer_index(spec)]
    return wl.mtp_layers * mtp_flops_per_token(spec, layer, head_flops_per_token(spec))


def ops_rerun_flops(spec: ModelSpec, wl: Workload) -> float:
    """Forward FLOPs per token that one layer's rerun spends under ``Recompute.OPS``: the
    ops its save list does not keep (``memplan.model.sac_ops``; a Mamba2 layer's scan,
    Falcon-H1's too, never kept: ``sac_mamba.scan_flops_per_token``), for the whole layer (one
    rank's, tensor parallelism aside); where dense and MoE layers differ, their mean over
    the model's layers. A list without stage scopes."""
    from memplan.model import sac_mamba, sac_ops
    from memplan.model.dims import Dims
    from memplan.model.layer import ops_kept, ops_kinds, ops_variants

    dm = Dims.of(spec, ParallelConfig(), wl)
    total = 0.0
    for kind, moe, n in ops_kinds(spec):
        for variant, count in ops_variants(spec, kind, n):  # (Llama 4's NoPE layers apart)
            items, kept = ops_kept(spec, wl, dm, moe, variant, kind, wl.recompute_save)
            total += count * sac_ops.rerun_flops_per_token(items, kept)
            # the chunked scan, which no item keeps, reruns always (Granite 4.0-H's Mamba2
            # layers; Falcon-H1's, each beside its attention: sac_falcon)
            if kind == "mamba" or spec.mamba is not None and spec.mamba.parallel_attention:
                total += count * sac_mamba.scan_flops_per_token(spec, wl.seq_len)
    return total / spec.num_layers


@lru_cache(maxsize=4096)
def ops_stage_rerun(spec: ModelSpec, wl: Workload, pp: int) -> list[float]:
    """``ops_rerun_flops`` of each of ``pp`` stages' layers (``sac_ops.for_stage``)."""
    from memplan.model import sac_ops

    if not sac_ops.stage_scoped(wl.recompute_save):
        return [ops_rerun_flops(spec, wl)] * pp
    return [ops_rerun_flops(spec, wl.model_copy(update={
        "recompute_save": sac_ops.for_stage(wl.recompute_save, s)})) for s in range(pp)]


def _sac_rerun_flops(spec: ModelSpec, wl: Workload, moe: bool = False) -> float:
    """Forward FLOPs per token of the matmuls per-op SAC recomputes in one layer: 2 per
    weight (``memplan.model.sac.recomputed``). A layer of torchtitan's MoE block
    (``moe_impl titan``, ``memplan.model.moe_titan.sac_matmuls``) reruns the even counted
    matmuls, the router's gate (h E) and the routed experts' grouped matmuls (3 h f per
    routed row, k rows a token)."""
    fused = wl.fused_qkv or spec.fused_qkv
    if not (moe and spec.moe is not None and wl.moe_impl is MoeImpl.TITAN):
        return 2.0 * sum(d_in * d_out for _, d_in, d_out, _ in recomputed(spec, fused))
    from memplan.model import moe_titan

    m, h = spec.moe, spec.hidden_size
    mms = recomputed(spec, fused, moe_titan.sac_matmuls(spec, fused))
    routed = 3 * m.top_k * h * m.expert_ffn_hidden_size
    return 2.0 * (sum(d_in * d_out for _, d_in, d_out, _ in mms) + h * m.num_experts + routed)


class _Numbers:
    """numpy's few array functions the formulas use, for one candidate's plain numbers."""

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        return a if cond else b

    @staticmethod
    def take(values: tuple[int, ...], index: int) -> int:
        return values[index]

    @staticmethod
    def first_max(*cols: float) -> int:
        return max(range(len(cols)), key=cols.__getitem__)  # the first of equals, as argmax

    @staticmethod
    def like(value: float, _shape: Any) -> float:
        return value

    @staticmethod
    def per_value(fn: Any, value: Any) -> Any:
        return fn(value)


class _Arrays:
    """The same functions on numpy arrays (imported by whoever built the arrays)."""

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        import numpy as np

        return np.where(cond, a, b)

    @staticmethod
    def take(values: tuple[int, ...], index: Any) -> Any:
        import numpy as np

        return np.asarray(values)[index]

    @staticmethod
    def first_max(*cols: Any) -> Any:
        import numpy as np

        return np.argmax(np.stack(cols), axis=0)

    @staticmethod
    def like(value: Any, shape: Any) -> Any:
        import numpy as np

        return np.broadcast_to(value, shape)

    @staticmethod
    def per_value(fn: Any, values: Any) -> Any:
        """``fn`` of each entry, computed once per distinct value."""
        import numpy as np

        keys, inverse = np.unique(values, return_inverse=True)
        return np.array([fn(k) for k in keys])[inverse]


class Columns(NamedTuple):
    """Layouts and batch splits of candidates: one integer array per field, one entry per
    candidate (``sp`` and ``offload`` boolean), or one plain number per field for a single
    candidate (``Columns.one``); ``ops`` does what numpy would for either."""

    tp: Any
    pp: Any
    vpp: Any
    dp: Any
    cp: Any
    ep: Any
    zero: Any
    sp: Any
    mbs: Any
    m: Any  # micro-batches per step
    params_on_rank: Any  # parameters of the most loaded rank, before ZeRO sharding
    offload: Any  # 0: nothing on the host; 1: the optimizer; 2: the weights too
    layers: Any  # decoder layers of the busiest pipeline rank
    shard: Any  # data-parallel ranks of one ZeRO shard group (dp without HSDP)
    balance: Any  # the busiest rank's FLOPs over the mean rank's (``stage_balance``)
    rerun: Any = 0.0  # the busiest rank's share of layers full recompute reruns
    ops: Any = _Arrays

    @classmethod
    def of(cls, layouts: list[ParallelConfig], mbs: list[int], m: list[int],
           params_on_rank: list[int], *, num_layers: int,
           balance: list[float] | None = None,
           rerun: list[float] | None = None) -> Columns:
        import numpy as np

        rows = np.array([_layout_row(num_layers, p) for p in layouts],
                        dtype=np.int64).reshape(len(layouts), 11)
        tp, pp, vpp, dp, cp, ep, zero, sp, offload, layers, shard = rows.T
        return cls(tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, ep=ep, zero=zero, sp=sp.astype(bool),
                   mbs=np.array(mbs, dtype=np.int64), m=np.array(m, dtype=np.int64),
                   params_on_rank=np.array(params_on_rank, dtype=np.int64),
                   offload=offload, layers=layers, shard=shard,
                   balance=np.ones(len(layouts)) if balance is None else np.array(balance),
                   rerun=np.zeros(len(layouts)) if rerun is None else np.array(rerun))

    @classmethod
    def one(cls, par: ParallelConfig, mbs: int, m: int, params_on_rank: int, *,
            num_layers: int, balance: float = 1.0, rerun: float = 0.0) -> Columns:
        return cls(tp=par.tp, pp=par.pp, vpp=par.vpp, dp=par.dp, cp=par.cp, ep=par.ep,
                   zero=int(par.zero), sp=par.sequence_parallel, mbs=mbs, m=m,
                   params_on_rank=params_on_rank, offload=_on_host(par),
                   layers=_busiest_layers(num_layers, par), shard=par.shard_group,
                   balance=balance, rerun=rerun, ops=_Numbers)

    @property
    def world_size(self) -> Any:
        return self.tp * self.pp * self.cp * self.dp


def _busiest_layers(num_layers: int, par: ParallelConfig) -> int:
    return max(rank_layers(num_layers, par))


@lru_cache(maxsize=16384)
def _layout_row(num_layers: int, par: ParallelConfig) -> tuple[int, ...]:
    """A layout's columns (``Columns.of``, in its order), once per layout."""
    return (par.tp, par.pp, par.vpp, par.dp, par.cp, par.ep, int(par.zero),
            int(par.sequence_parallel), _on_host(par),
            _busiest_layers(num_layers, par), par.shard_group)


def _on_host(par: ParallelConfig) -> int:
    """``Columns.offload``: 0, 1 with the optimizer on the host, 2 with the weights too."""
    return int(optimizer_on_host(par)) + int(Offload.PARAMS in par.offload)


def _bandwidth(gpu: GpuSpec, c: Columns, span: Any) -> Any:
    """Intra-node links when a group's ranks fit in one node, else the network."""
    return c.ops.where(span <= gpu.gpus_per_node, gpu.intra_node_bytes_per_s,
                       gpu.inter_node_bytes_per_s)


# NCCL's latency model of a ring collective with the Simple protocol (NVIDIA/nccl
# src/graph/tuning.cc, ncclTopoTuneModel: baseLat ring/Simple 8.4 us, hwLat ring/Simple 3.4 us
# per step over NVLink and 9.6 us per step over the network): a reduce-scatter or all-gather of
# n ranks takes n - 1 steps, an all-reduce 2 (n - 1), the steps between nodes at the network's
# latency. A point-to-point send pays one step.
RING_BASE_S = 8.4e-6
RING_STEP_NVLINK_S = 3.4e-6
RING_STEP_NET_S = 9.6e-6
NCCL_LATENCY_SOURCE = "NVIDIA/nccl src/graph/tuning.cc (ring, Simple protocol)"


def _ring_latency(gpu: GpuSpec, ranks: Any, span: Any, passes: int = 1) -> Any:
    """Seconds of latency of one ring collective over ``ranks`` ranks whose group spans
    ``span`` consecutive global ranks (``passes`` 2 for an all-reduce); 0 for one rank."""
    g = gpu.gpus_per_node
    steps = ranks - 1
    crossings = (span + g - 1) // g - 1  # node boundaries the group's span crosses
    inter = (crossings + steps - abs(crossings - steps)) / 2  # min of the two, arrays too
    one = RING_BASE_S + (steps - inter) * RING_STEP_NVLINK_S + inter * RING_STEP_NET_S
    return (ranks > 1) * passes * one


def _step_latency(gpu: GpuSpec, span: Any) -> Any:
    """One ring step or point-to-point send: NVLink inside a node, else the network."""
    return (span <= gpu.gpus_per_node) * RING_STEP_NVLINK_S + (span > gpu.gpus_per_node) * \
        RING_STEP_NET_S


def _ring(size: Any) -> Any:
    """Bytes each rank sends per byte of a ring all-gather or reduce-scatter (0 alone)."""
    return (size - 1) / size


@lru_cache(maxsize=64)
def _moe_layers_before(spec: ModelSpec) -> tuple[int, ...]:
    """Entry k: MoE layers among the model's first k layers."""
    return tuple(accumulate((spec.is_moe_layer(i) for i in range(spec.num_layers)), initial=0))


def dp_parts(spec: ModelSpec, wl: Workload, gpu: GpuSpec,
             c: Columns) -> tuple[Any, Any, Any, Any]:
    """Seconds of data-parallel communication in one step: (the gradients' reduction once
    per step, their reduction in every micro-batch, the weights' all-gather after the
    optimizer step, ZeRO-3's gathers for every micro-batch's forward and backward).

    Without ZeRO and with ZeRO-1 gradients accumulate whole and are reduced once per step:
    all-reduced without ZeRO, reduce-scattered inside the shard group with it (the
    optimizer's updated shards then all-gathered back). ZeRO-2 and 3 keep only their shard
    of the gradients, so every micro-batch's backward reduce-scatters what it made
    (DeepSpeed ZeRO-2 reduces each backward's gradient buckets, runtime/zero/stage_1_and_2.py
    reduce_ipg_grads; FSDP2 reduce-scatters in every backward unless gradient sync is turned
    off). With HSDP (``dp_shard``) the shard group's reduce-scatter and all-gathers run
    over its own span of ranks, and each shard is all-reduced across the replicas, a
    ``1 / dp_shard`` share of the gradients over the whole data-parallel span (PyTorch FSDP2
    HSDP: reduce-scatter then all-reduce, _fsdp_collectives.py foreach_reduce). ZeRO-3
    gathers the weights in the dtype it computes in (fp32 under autocast) for every
    micro-batch, forward and backward; with FSDP2's float8 all-gather the decoder layers'
    converted linears travel in one byte an element (``float8_gathered_saving``)."""
    where = c.ops.where
    shard = c.shard * c.cp  # ranks of one shard group (CP folded in, as in memory)
    replicas = c.dp // c.shard
    grad_bytes = c.params_on_rank * wl.precision.policy.grad_bytes
    weight_bytes = c.params_on_rank * wl.precision.policy.unsharded.itemsize
    inside = _bandwidth(gpu, c, c.tp * shard)
    across = _bandwidth(gpu, c, c.tp * c.cp * c.dp)
    zero = c.zero >= ZeroStage.OPTIMIZER
    # without ZeRO: one all-reduce (2 ring passes) over all data-parallel ranks
    plain = 2 * _ring(c.dp * c.cp) * grad_bytes / across
    sharded = (_ring(shard) * grad_bytes / inside
               + 2 * _ring(replicas) * grad_bytes / shard / across)
    # one collective per unit (a layer's bucket or FSDP unit, the embedding's, the head's),
    # each paying the ring's latency (``_ring_latency``)
    units = c.layers + 2
    span_inside, span_all = c.tp * shard, c.tp * c.cp * c.dp
    lat_plain = units * _ring_latency(gpu, c.dp * c.cp, span_all, passes=2)
    lat_shard = units * _ring_latency(gpu, shard, span_inside)
    lat_replicas = units * _ring_latency(gpu, replicas, span_all, passes=2)
    plain = plain + lat_plain
    sharded = sharded + lat_shard + lat_replicas
    each = c.zero >= ZeroStage.GRADIENTS
    reduce = where(each, 0.0, where(zero, sharded, plain))
    reduce_each = where(each, sharded * c.m, 0.0)
    gather = where(zero, _ring(shard) * weight_bytes / inside + lat_shard, 0.0)
    gathered = weight_bytes - float8_gathered_saving(spec, wl, c)
    gathers = where(c.zero >= ZeroStage.PARAMETERS,
                    2 * c.m * (_ring(shard) * gathered / inside + lat_shard), 0.0)
    return reduce, reduce_each, gather, gathers


def float8_gathered_saving(spec: ModelSpec, wl: Workload, c: Columns) -> Any:
    """Bytes fewer each ZeRO-3 all-gather of the busiest rank moves when FSDP2 gathers the
    float8 linears' weights in float8 (``float8_all_gather``; torchao ``float8/fsdp_utils.py``
    ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` casts the shard and sends its
    float8 data): each of its decoder layers' converted linears one byte an element instead
    of the unsharded dtype's (``memplan.model.layer.float8_gather_saving``, the bytes the
    memory model gathers fewer), the embedding, head and norms as before. 0 without."""
    if not wl.float8_all_gather:
        return 0
    e = wl.precision.policy.unsharded.itemsize
    return c.ops.per_value(lambda t: float8_gather_saving(spec, int(t), e), c.tp) * c.layers


def cp_parts(spec: ModelSpec, gpu: GpuSpec, wl: Workload, c: Columns) -> tuple[Any, Any]:
    """Seconds of context parallelism's K/V exchange in one step: (the exchange beside the
    forward's attention, the exchange beside the backward's), each summed over the busiest
    rank's layers and micro-batches (``Workload.cp_exchange``).

    ring: each of the cp - 1 steps sends the rank's K/V chunk (mbs x seq / cp tokens, K and V
    of the rank's kv heads) to the next rank, forward and backward.
    allgather: the chunk all-gathered once, forward and again backward ((cp - 1) chunks
    arriving, a ring collective); the backward's K/V gradients, accumulated in fp32
    (``convert_to_f32``, its default), sent to the next rank after each of the cp blocks."""
    e = wl.compute_dtype.itemsize
    tokens = c.mbs * local_seq(wl.seq_len, c.cp)
    kv = 2 * tokens * spec.kv_size // c.tp * e
    span = c.tp * c.cp
    calls = c.layers * c.m
    bw = _bandwidth(gpu, c, span)
    if wl.cp_exchange is CpExchange.ALLGATHER:
        gather = ((c.cp - 1) * kv / bw + _ring_latency(gpu, c.cp, span)) * calls
        grads = c.cp * (kv * FP32_BYTES / e / bw + _step_latency(gpu, span)) * calls
        return gather, gather + c.ops.where(c.cp > 1, grads, 0.0)
    steps = (c.cp - 1) * calls
    one = steps * kv / bw + steps * _step_latency(gpu, span)
    return one, one


def comm_columns(spec: ModelSpec, gpu: GpuSpec, wl: Workload, c: Columns) -> dict[str, Any]:
    """Seconds each dimension spends communicating in one step of one GPU, before overlap, per
    candidate (``wl`` gives the sequence and precision; ``c`` the rest).

    Ranks are laid out tp innermost, then cp, dp, pp (Megatron-LM's order), so a group uses
    intra-node links when its span of consecutive ranks fits in a node.
    """
    e = wl.compute_dtype.itemsize
    m, layers, where = c.m, c.layers, c.ops.where
    tokens = c.mbs * local_seq(wl.seq_len, c.cp)
    act_bytes = tokens * spec.hidden_size * e
    out: dict[str, Any] = {}
    # TP: two all-reduces per layer forward and two backward (or all-gather + reduce-scatter
    # with SP, the same volume): 2 * ring factor per all-reduce.
    tp_bytes = 4 * 2 * _ring(c.tp) * act_bytes * layers * m
    if wl.float8 is Float8Recipe.TENSORWISE:
        # the forward's two sequence all-gathers move float8 (torchao Float8ColwiseParallel
        # casts before the gather), one byte an element: 2 of the 8 collectives at half
        tp_bytes = tp_bytes * where(c.sp, 1.0 - 2 * (1 - 1 / e) / 8, 1.0)
    # ... each a collective of its own: 8 ring passes per layer and micro-batch
    tp_latency = 8 * layers * m * _ring_latency(gpu, c.tp, c.tp)
    # full recompute reruns each recomputed layer's forward with its collectives
    # (torch.utils.checkpoint and Megatron-LM's CheckpointFunction re-execute the module's
    # forward, its tensor-parallel all-reduces or sequence all-gathers and reduce-scatters
    # included): the forward's two all-reduces (RowParallelLinear's output, attention's and
    # the MLP's), 2 ring passes each, or its two all-gather + reduce-scatter pairs, are 4 of
    # the layer's 8 units: 8 -> 12 per recomputed layer
    out["tp"] = (tp_bytes / _bandwidth(gpu, c, c.tp) + tp_latency) * (1.0 + 4.0 / 8.0 * c.rerun)
    out["dp"] = sum(dp_parts(spec, wl, gpu, c))
    # PP: each micro-batch's activations cross each boundary forward and their gradients back,
    # once per model chunk: interleaving multiplies the sends by vpp (Narayanan et al. 2021,
    # section 2.2.2: "the amount of communication also increases by v").
    pp_bytes = where(c.pp > 1, 2 * act_bytes // where(c.sp, c.tp, 1) * m * c.vpp, 0)
    sends = where(c.pp > 1, 2 * m * c.vpp, 0)
    out["pp"] = pp_bytes / _bandwidth(gpu, c, c.world_size) + sends * _step_latency(
        gpu, c.world_size)
    out["cp"] = sum(cp_parts(spec, gpu, wl, c))
    # EP: dispatch and combine all-to-alls of the routed tokens, forward and backward.
    ep_bytes: Any = 0.0
    if spec.moe is not None:
        moe_layers = c.ops.take(_moe_layers_before(spec), layers)
        routed = tokens * spec.moe.top_k * spec.hidden_size * e
        ep_bytes = where(c.ep > 1, 4 * _ring(c.ep) * routed * moe_layers * m, 0.0)
    out["ep"] = ep_bytes / _bandwidth(gpu, c, c.tp * c.cp * c.ep)
    out["host_grads"], out["host_step"] = _host_seconds(gpu, wl, c)
    out["host_params"] = _host_params_seconds(gpu, wl, c)
    return out


def recomputed_share(wl: Workload, num_layers: int, par: ParallelConfig) -> float:
    """Of the busiest pipeline rank's layers, the share full recompute reruns (``Columns.rerun``):
    all of them, the first ``recompute_layers`` of them, or every ``recompute_every``-th; 0
    without full recompute."""
    layers = _busiest_layers(num_layers, par)
    if wl.recompute is not Recompute.FULL or layers == 0:
        return 0.0
    if wl.recompute_every is not None:
        return (layers // wl.recompute_every) / layers
    if wl.recompute_layers is not None:
        return min(wl.recompute_layers, layers) / layers
    return 1.0


def _host_seconds(gpu: GpuSpec, wl: Workload, c: Columns) -> tuple[Any, Any]:
    """An offloaded optimizer's seconds per step: (the gradient shard's copy to the host,
    the CPU step plus the updated weights' copy back). The CPU step is taken as bound by host
    memory bandwidth, which the node's GPUs share: it reads the fp32 master weights, the fp32
    gradient and the states, writes the weights and states back and writes the compute-dtype
    copy sent to the GPU (Adam: 30 bytes per parameter in bf16). At peak bandwidth this is
    a lower bound on the step's time."""
    # the rank's optimizer partition (ZeRO >= 1); without ZeRO (torchao's CPUOffloadOptimizer)
    # every rank steps all its parameters
    shard = c.params_on_rank / c.ops.where(c.zero >= 1, c.dp * c.cp, 1)
    e = wl.compute_dtype.itemsize
    down = shard * wl.precision.policy.grad_bytes / gpu.host_link_bytes_per_s
    up = shard * e / gpu.host_link_bytes_per_s
    states = optimizer_policy(wl.optimizer).host_state_bytes_per_param()
    streamed = shard * (2 * (FP32_BYTES + states) + FP32_BYTES + e)
    cpu = streamed / (gpu.host_memory_bytes_per_s / gpu.gpus_per_node)
    return c.ops.where(c.offload, down, 0.0), c.ops.where(c.offload, up + cpu, 0.0)


def _host_params_seconds(gpu: GpuSpec, wl: Workload, c: Columns) -> Any:
    """Weights kept on the host (``Offload.PARAMS``): each rank's shard copied to the GPU
    before every gather of it, in each micro-batch's forward, backward and, under full
    recompute, the forward rerun."""
    shard = c.params_on_rank / c.ops.where(c.zero >= 1, c.dp * c.cp, 1)
    gathers = c.m * (3 if wl.recompute is Recompute.FULL else 2)
    seconds = gathers * shard * wl.compute_dtype.itemsize / gpu.host_link_bytes_per_s
    return c.ops.where(c.offload == 2, seconds, 0.0)


_BOUNDS = (Bound.COMPUTE, Bound.COMMUNICATION, Bound.BUBBLE)


class StepTimes(NamedTuple):
    """``StepTime`` of many candidates, one array per field (``step_times``) or one list of
    plain numbers (``step_times_rows``); ``bound``: index into compute, communication,
    bubble."""

    model_flops: np.ndarray
    hardware_flops: np.ndarray
    compute_s: np.ndarray
    comm_s: dict[str, np.ndarray]
    exposed_comm_s: np.ndarray
    bubble_s: np.ndarray
    step_s: np.ndarray
    tokens_per_s_per_gpu: np.ndarray
    mfu: np.ndarray
    bound: np.ndarray

    def at(self, i: int) -> StepTime:
        return StepTime(
            model_flops=float(self.model_flops[i]), hardware_flops=float(self.hardware_flops[i]),
            compute_s=float(self.compute_s[i]),
            comm_s={kind: float(v[i]) for kind, v in self.comm_s.items()},
            exposed_comm_s=float(self.exposed_comm_s[i]), bubble_s=float(self.bubble_s[i]),
            step_s=float(self.step_s[i]), tokens_per_s_per_gpu=float(self.tokens_per_s_per_gpu[i]),
            mfu=float(self.mfu[i]), bound=_BOUNDS[int(self.bound[i])])


def _step_fields(spec: ModelSpec, gpu: GpuSpec, wl: Workload, global_batch: int, c: Columns,
                 model_flops: Any, hardware_flops: Any, mfu: float,
                 measured: bool = False) -> dict[str, Any]:
    """``StepTimes``' fields for the candidates of ``c`` (arrays, or numbers for one);
    ``measured``: ``mfu`` was measured on the device (a calibration profile's), so it stands
    for the attention kernel too, not the published kernel tables."""
    world = c.world_size
    # the pipeline runs at its busiest rank's pace (``stage_balance``); with context
    # parallelism the attention runs on seq / cp tokens, at that length's kernel rate
    compute = hardware_flops / world / (gpu.bf16_flops * mfu) * c.balance
    matmul, attention, _ = forward_flops_per_token(spec, wl.seq_len, runs_every_expert(spec, wl))
    share = attention / (matmul + attention)
    slower = c.ops.per_value(lambda cp: _attention_time(gpu, wl, int(cp), mfu, measured,
                                                        spec.head_dim), c.cp)
    # the decoder's linears at the rate of their per-GPU GEMM shapes, float8 on FP8 tensor
    # cores (``memplan.planning.kernels``)
    linear = (matmul - head_flops_per_token(spec)) / (matmul + attention)
    float8 = wl.float8 is not Float8Recipe.NONE
    # ``StepModel.KERNELS`` (Megatron-LM's fused pointwise kernels) and ``KERNELS_TORCH`` (the
    # PyTorch modules' own) time the step kernel by kernel: the GEMMs alone at their measured
    # rates and the memory-bound per-token kernels by their bytes (``elementwise_seconds``),
    # whose time grows with h where the GEMMs' grows with h^2. ``StepModel.MFU`` keeps the flat
    # fraction: an end-to-end MFU (``DEFAULT_MFU``) that holds those kernels and more. Timed
    # kernel by kernel (docs/accuracy.md, "Kernel by kernel") the torchtitan runs of
    # benchmarks/data/throughput_runs.json on 500 W H100s come out 1.5-1.9x faster than
    # published (group medians), the H200 runs without tensor parallelism -5% to +24% and the
    # Llama 3 paper's H100 runs within 16%: what else the former's steps spend is not
    # modelled, so no preset but Megatron-LM's selects it. A measured MFU stands for every
    # kernel it timed.
    kernels = not measured and wl.step_model is not StepModel.MFU
    best = gemm_best_rate(gpu) if kernels else None
    if best is None:  # every FLOP at the flat fraction, the GEMMs' by shape where measured
        shaped = c.ops.per_value(
            lambda tp: linear_time_factor(spec, gpu, int(tp), float8, mfu), c.tp)
        factor = 1.0 - share - linear + share * slower + linear * shaped
        compute = compute * factor
    else:
        # the GEMMs alone at their measured rates (the head's and eager attention's batched
        # matmuls at the largest GEMM's), the memory-bound kernels by their bytes
        shaped = c.ops.per_value(
            lambda tp: gemm_time_factor(spec, gpu, int(tp), float8, mfu), c.tp)
        at_best = mfu * gpu.bf16_flops / best
        if wl.attention is not Attention.FLASH:
            slower = at_best
        factor = (1.0 - share - linear) * at_best + share * slower + linear * shaped
        compute = compute * factor + elementwise_seconds(spec, gpu, wl, c) + \
            optimizer_step_seconds(gpu, wl, c)
    if float8:
        compute = compute + _float8_casts(spec, gpu, wl, c)
    comm = comm_columns(spec, gpu, wl, c)
    exposed = sum(seconds * (1.0 - OVERLAP[kind]) for kind, seconds in comm.items()
                  if kind not in WINDOWED and kind != "tp")
    if wl.pipeline_p2p is PipelineP2p.BLOCKING:
        # one chunk per rank: each send and receive waited for, none of it hidden
        exposed = exposed + c.ops.where(c.vpp == 1, comm["pp"] * OVERLAP["pp"], 0.0)
    if wl.async_tp:
        # the forward's and the input gradients' matmuls, two of a linear's three GEMMs
        beside = (hardware_flops / world / (gpu.bf16_flops * mfu) * c.balance
                  * linear * shaped * 2.0 / 3.0)
        fused = comm["tp"] * async_tp_fused_share(wl)
        exposed = exposed + c.ops.where(c.sp, async_tp_exposed(fused, beside, c.tp,
                                                               c.ops.where)
                                        + comm["tp"] - fused, comm["tp"])
        compute = compute + c.ops.where(c.sp, async_tp_copy_seconds(spec, gpu, wl, c), 0.0)
    else:
        exposed = exposed + comm["tp"] * (1.0 - OVERLAP["tp"])
    exposed = exposed + _windowed(spec, gpu, wl, c, comm, compute, model_flops, hardware_flops)
    # (p - 1) / (v * m) of the ideal time (Narayanan et al. 2021, eq. 1-2)
    bubble = c.ops.where(c.pp > 1, (c.pp - 1) / (c.vpp * c.m) * (compute + exposed), 0.0)
    total = compute + exposed + bubble
    tokens = global_batch * wl.seq_len
    shape = getattr(total, "shape", None)
    return {
        "model_flops": c.ops.like(model_flops, shape),
        "hardware_flops": c.ops.like(hardware_flops, shape),
        "compute_s": compute, "comm_s": comm, "exposed_comm_s": exposed, "bubble_s": bubble,
        "step_s": total, "tokens_per_s_per_gpu": tokens / total / world,
        "mfu": model_flops / total / world / gpu.bf16_flops,
        "bound": c.ops.first_max(compute, exposed, bubble),
    }


def elementwise_seconds(spec: ModelSpec, gpu: GpuSpec, wl: Workload, c: Columns) -> Any:
    """Seconds of the memory-bound per-token kernels in one step of the busiest rank: each
    layer's forward and backward bytes per token (``memplan.planning.kernels.
    elementwise_bytes``: norms, residual adds and dropout, the MLP activation, RoPE, eager
    attention's softmax) for the mbs x seq / cp rows of each of its micro-batches and its
    layers, the forward again for the share of layers full recompute reruns, the attention
    core's again under Megatron-style selective recompute (which reruns the core: Korthikanti
    et al. 2022, section 5), and, without pipeline parallelism, the loss over the vocabulary
    (``loss_bytes_per_token``; with it, on the last stage, not counted). The kernels are
    those the step model names: ``StepModel.KERNELS`` Megatron-LM's fused ones,
    ``StepModel.KERNELS_TORCH`` the PyTorch modules' (eager, or Inductor's fused activation
    under compile). At the HBM's datasheet bandwidth times torchao's measured 92% for
    pointwise kernels (``ACHIEVABLE_HBM``)."""
    fused = wl.step_model is StepModel.KERNELS
    eager = wl.attention is not Attention.FLASH
    e = wl.compute_dtype.itemsize
    selective = (wl.recompute is Recompute.SELECTIVE
                 and wl.selective_impl is not SelectiveImpl.OP)

    def per_token(key: int) -> float:  # key: 2 tp + sp
        b = elementwise_bytes(spec, key // 2, bool(key % 2), wl.seq_len, e, fused,
                              wl.compile, eager)
        return b.forward + b.backward + (b.core if selective else 0.0)

    def forward(key: int) -> float:
        return elementwise_bytes(spec, key // 2, bool(key % 2), wl.seq_len, e, fused,
                                 wl.compile, eager).forward

    key = 2 * c.tp + c.ops.where(c.sp, 1, 0)
    layer = c.ops.per_value(lambda k: per_token(int(k)), key)
    rerun = c.ops.per_value(lambda k: forward(int(k)), key) * c.rerun
    loss = c.ops.per_value(lambda tp: loss_bytes_per_token(spec, int(tp), e), c.tp)
    rows = c.mbs * local_seq(wl.seq_len, c.cp) * c.m
    total = rows * ((layer + rerun) * c.layers + c.ops.where(c.pp == 1, loss, 0.0))
    return total / (gpu.hbm_bytes_per_s * ACHIEVABLE_HBM)


def optimizer_step_seconds(gpu: GpuSpec, wl: Workload, c: Columns) -> Any:
    """Seconds of the optimizer's step on the GPU in one step of the busiest rank, by the
    bytes its kernels move over the HBM (at ``ACHIEVABLE_HBM``), as the kernel step model
    times it (an end-to-end MFU holds it already). A fused step reads each updated element,
    its gradient and its states and writes the element and the states back, one pass
    (Megatron-LM's optimizer.step(): Transformer Engine's or Apex's FusedAdam,
    multi_tensor_apply); with a master copy the updated weights are then copied into the
    model's (megatron/core/optimizer/optimizer.py Float16OptimizerWithFloat16Params.
    _copy_main_params_to_model_params: read the fp32 main weight, write the model's). A
    foreach step's several passes move more, not counted. Over the rank's optimizer
    partition: its parameters over dp x cp with ZeRO >= 1 (the distributed optimizer), all
    of them without; none when the optimizer is on the host (``_host_seconds``)."""
    policy = wl.precision.policy
    updated = policy.updated.itemsize
    states = optimizer_policy(wl.optimizer).state_bytes_per_param(policy)
    per_param = 2 * (updated + states) + policy.grad_bytes + \
        (updated + policy.param_bytes if policy.master is not None else 0)
    shard = c.params_on_rank / c.ops.where(c.zero >= 1, c.dp * c.cp, 1)
    seconds = shard * per_param / (gpu.hbm_bytes_per_s * ACHIEVABLE_HBM)
    return c.ops.where(c.offload, 0.0, seconds)


def _float8_casts(spec: ModelSpec, gpu: GpuSpec, wl: Workload, c: Columns) -> Any:
    """Seconds of torchao's float8 casts in one step of the busiest rank
    (``memplan.planning.kernels.float8_cast_seconds``): per token of each micro-batch's
    mbs x seq / cp rows and per micro-batch, for its share of the layers. The weights' casts
    are not there when FSDP2 gathers them in float8 (``float8_all_gather``: cast on the shard
    before the gather). The forward's casts rerun under recompute are not counted."""
    recipe = wl.float8.value

    def casts(key: int) -> tuple[float, float]:  # key: 2 tp + sp
        return float8_cast_seconds(spec, gpu, key // 2, recipe, wl.compile, bool(key % 2))

    key = 2 * c.tp + c.ops.where(c.sp, 1, 0)
    per_token = c.ops.per_value(lambda k: casts(int(k))[0], key)
    per_mb = 0.0 if wl.float8_all_gather else c.ops.per_value(lambda k: casts(int(k))[1], key)
    rows = c.mbs * local_seq(wl.seq_len, c.cp)
    return (per_token * rows + per_mb) * c.m * c.layers / spec.num_layers


# Measured attention kernel throughput by sequence length (FlashAttention-3 forward on an H100,
# head dim 128, batch x seq = 16k tokens, TFLOP/s; pytorch/benchmark PR 2391, D60117034):
# short sequences run the kernel below its long-sequence rate. Context parallelism runs
# attention on seq / cp tokens per rank, so its attention runs at the rate of that length.
ATTENTION_TFLOPS_BY_SEQ = ((512, 430.32), (1024, 517.099), (2048, 565.544), (4096, 590.233),
                           (8192, 614.234), (16384, 620.73))
ATTENTION_RATE_SOURCE = ("FlashAttention-3 forward TFLOP/s by sequence length, H100, head dim "
                         "128 (pytorch/benchmark PR 2391)")


def attention_rate(seq_len: int) -> float:
    """The attention kernel's throughput at ``seq_len`` tokens relative to its longest measured
    (``ATTENTION_TFLOPS_BY_SEQ``; linear in log2 of the length between points, the ends held
    beyond them)."""
    points = ATTENTION_TFLOPS_BY_SEQ
    top = points[-1][1]
    if seq_len <= points[0][0]:
        return points[0][1] / top
    for (s0, r0), (s1, r1) in zip(points, points[1:]):
        if seq_len <= s1:
            f = (math.log2(seq_len) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
            return (r0 + f * (r1 - r0)) / top
    return 1.0


def _attention_time(gpu: GpuSpec, wl: Workload, cp: int, mfu: float,
                    measured: bool = False, head_dim: int = 128) -> float:
    """The attention's time over its time at the flat fraction ``mfu`` of peak: the fused
    kernel's measured forward and backward rates on the rank's seq / cp tokens and heads of
    ``head_dim`` where the GPU has them (``memplan.planning.kernels.attention_time_factor``),
    else the flat rate scaled
    by the kernel's rate at seq / cp tokens over its rate at seq (``_cp_attention_time``).
    Eager attention (materialised scores) keeps the latter, as does an ``mfu`` measured on
    the device (``measured``: the calibrated rate covers every kernel it timed)."""
    if wl.attention is Attention.FLASH and not measured:
        factor = attention_time_factor(gpu, max(1, wl.seq_len // cp), mfu, head_dim)
        if factor is not None:
            return factor
    return _cp_attention_time(wl.seq_len, cp)


def _cp_attention_time(seq_len: int, cp: int) -> float:
    """The attention's time with context parallelism over its time without: the kernel runs
    on seq / cp tokens per rank (``attention_rate``)."""
    return attention_rate(seq_len) / attention_rate(max(1, seq_len // cp)) if cp > 1 else 1.0


# Communication that can hide only behind the compute it runs beside (``_windowed``).
WINDOWED = frozenset({"dp", "cp"})


def _windowed(spec: ModelSpec, gpu: GpuSpec, wl: Workload, c: Columns, comm: dict[str, Any],
              compute: Any, model_flops: Any, hardware_flops: Any) -> Any:
    """Exposed seconds of data- and context-parallel communication, hidden at most by the
    compute it can run beside (``dp_exposed``, ``ring_exposed``).

    - A reduction once per step starts when the last micro-batch's backward makes the
      gradients: with gradient accumulation only that micro-batch's backward can hide it (Megatron-LM
      ``--overlap-grad-reduce`` issues the bucket reduce-scatters in the last micro-batch's
      backward, megatron/core/distributed/distributed_data_parallel.py; PyTorch DDP
      ``no_sync`` skips the earlier ones).
    - The weights' all-gather after the optimizer step hides behind the first micro-batch's
      forward (``--overlap-param-gather``).
    - ZeRO-2/3's reduction in every micro-batch hides behind every backward, ZeRO-3's gathers
      behind every micro-batch's compute.
    - The context-parallel ring sends each K/V block while the attention of the one before
      runs (Liu et al. 2023, Ring Attention, section 3: the transfer hides when a block's
      compute takes longer): only the attention's own compute can hide it.
    """
    where = c.ops.where
    backward_share = 2.0 / 3.0 * model_flops / hardware_flops  # of the step's compute
    per_mb = compute / c.m
    reduce, reduce_each, gather, gathers = dp_parts(spec, wl, gpu, c)
    units = c.layers + 2  # a collective per unit: each layer's, the embedding's, the head's
    dp = dp_exposed(reduce, reduce_each, gather, gathers, units=units, compute=compute,
                    per_mb=per_mb, backward_share=backward_share, where=where)
    matmul, attention, _ = forward_flops_per_token(spec, wl.seq_len, runs_every_expert(spec, wl))
    attention_share = attention / (matmul + attention)
    # the ring, step by step (PyTorch's context_parallel, torch/distributed/tensor/
    # experimental/_attention.py _templated_ring_attention, and Megatron-LM/Transformer
    # Engine's AttnFuncWithCPAndKVP2P: each of the cp steps sends the next K/V chunk while
    # the current block's attention runs): a step's send is exposed by what it exceeds the
    # block's attention, a 1/cp share of the layer's; backward passes K/V and their gradients
    # beside twice the forward's compute, the same ratio
    cp = comm["cp"]
    blocks = c.layers * c.m * c.cp  # attention blocks of the busiest rank in a step
    block = compute * attention_share / 3.0 / where(blocks > 0, blocks, 1)
    if wl.cp_exchange is CpExchange.ALLGATHER:
        return dp + gather_exposed(*cp_parts(spec, gpu, wl, c), calls=c.layers * c.m,
                                   cp=c.cp, block=block, where=where)
    steps = where(c.cp > 1, 2 * (c.cp - 1) * c.layers * c.m, 1)
    steps = where(steps > 0, steps, 1)  # a rank without layers sends nothing
    return dp + ring_exposed(cp, steps, block, where)


def gather_exposed(forward: Any, backward: Any, *, calls: Any, cp: Any, block: Any,
                   where: Any) -> Any:
    """Exposed seconds of context parallelism's all-gather exchange (``CpExchange.ALLGATHER``;
    ``cp_parts``: ``forward`` seconds of gathers, ``backward`` seconds of gathers and K/V
    gradient sends, over ``calls`` attention calls of ``cp`` blocks, each block ``block``
    seconds of forward attention and twice that of backward).

    PyTorch's _templated_ring_attention starts the all-gather before the first block and
    waits for it before the second: one block hides it, what exceeds that is exposed, forward
    and backward (beside a backward block, twice a forward one). In backward each block's K/V
    gradients go to the next rank while the next block runs (``ring_exposed`` of cp - 1 sends)
    and the last block's are waited for after the loop, with nothing beside them."""
    safe = where(calls > 0, calls, 1)
    gather = forward / safe  # one call's all-gather
    grads = (backward - forward) / safe / where(cp > 0, cp, 1)  # one gradient send

    def over(seconds: Any, window: Any) -> Any:
        return where(seconds > window, seconds - window, 0.0)

    per_call = (over(gather, block) + over(gather, 2.0 * block)
                + (cp - 1) * over(grads, 2.0 * block) + grads)
    return where(cp > 1, per_call * calls, 0.0)


def dp_exposed(reduce: Any, reduce_each: Any, gather: Any, gathers: Any, *, units: Any,
               compute: Any, per_mb: Any, backward_share: Any, where: Any) -> Any:
    """Exposed seconds of the data-parallel collectives (``dp_parts``) beside ``compute``
    seconds of compute.

    Each pass's collectives run one unit ahead of the compute (FSDP2 issues the next unit's
    all-gather while the current one computes, and reduce-scatters each unit's gradients as
    its backward ends: torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py
    ``pre_forward``, ``post_backward``; Megatron-LM's overlapped buckets the same), so one
    unit's share of each kind waits (the first gather, the last reduce-scatter). The rest
    hides behind the compute beside it: a once-per-step reduction behind the last micro-
    batch's backward, the gather after the optimizer step behind the first one's forward
    (what exceeds those is exposed), and all of it together behind the step's compute, which
    every collective shares (one compute cannot hide two transfers twice)."""
    def edge(seconds: Any) -> Any:
        return seconds / units

    def over(seconds: Any, window: Any) -> Any:
        return where(seconds > window, seconds - window, 0.0)

    r, g = reduce - edge(reduce), gather - edge(gather)
    r_over, g_over = over(r, per_mb * backward_share), over(g, per_mb * (1 - backward_share))
    pooled = (r - r_over) + (g - g_over) + (reduce_each - edge(reduce_each)) + \
        (gathers - edge(gathers))
    return (edge(reduce) + edge(reduce_each) + edge(gather) + edge(gathers) + r_over + g_over
            + over(pooled, compute))


def async_tp_fused_share(wl: Workload) -> float:
    """The share of tensor parallelism's collective bytes (``comm_columns``: per layer four
    sequence all-gathers and four reduce-scatters, forward and backward) that async TP fuses
    with a matmul. Inductor's micro-pipeline pass (torch/_inductor/fx_passes/
    micro_pipeline_tp.py) fuses an all-gather whose users are matmuls (``_find_consumer_
    matmuls``: ``mm`` or ``_scaled_mm``, through a reshape) and a reduce-scatter whose input a
    matmul makes (``_find_producer_matmul``). In bf16 all eight are. With torchao's float8:
    the backward's all-gathers of the output gradient feed its float8 cast, not a matmul;
    tensorwise gathers the forward's inputs already in float8 (half the bytes, straight into
    ``_scaled_mm``) and its gradient GEMMs feed their reduce-scatters, so 5 of 7 byte units
    fuse; rowwise gathers the forward's inputs in bf16 into its cast, and its gradient GEMMs'
    outputs are rescaled before the reduce-scatter (``POST_SCALE_BYTES``), so only the
    forward's two reduce-scatters fuse, 2 of 8."""
    if wl.float8 is Float8Recipe.TENSORWISE:
        return 5.0 / 7.0
    if wl.float8 is Float8Recipe.ROWWISE:
        return 2.0 / 8.0
    return 1.0


# The collectives async TP fuses per layer and micro-batch, by recipe (``async_tp_fused_share``):
# (reduce-scatters, all-gathers, bytes per element of the gathered input over the compute
# dtype's). bf16: all four of each; tensorwise float8: the four reduce-scatters and the
# forward's two all-gathers, in float8; rowwise: the forward's two reduce-scatters.
ASYNC_TP_FUSED = {Float8Recipe.NONE: (4, 4, 1.0), Float8Recipe.TENSORWISE: (4, 2, 0.5),
                  Float8Recipe.ROWWISE: (2, 0, 0.0)}


def async_tp_copy_seconds(spec: ModelSpec, gpu: GpuSpec, wl: Workload, c: Columns) -> Any:
    """Seconds of the memory-bound kernels async TP's fused ops run on the compute stream in
    one step of the busiest rank (torch/distributed/_symmetric_memory/__init__.py, which
    Inductor's micro-pipeline pass calls). ``fused_matmul_reduce_scatter`` writes the tp
    partial products of the whole micro-batch (M rows, the full sequence, x hidden) into a
    stacked buffer that peers pull by copy engine, then sums it on the GPU's SMs
    (``_fused_matmul_reduce_scatter_impl``: ``torch.sum`` over the tp chunks): M x h read,
    M / tp x h written, in the output's dtype, a reduction vanilla TP leaves inside NCCL's
    reduce-scatter. ``fused_all_gather_matmul`` copies the local shard twice, into the
    gathered output and into its symmetric-memory buffer (``_pipelined_all_gather_and_
    consume``; the remote shards arrive by copy engine): 2 x (read + write) of M / tp x h.
    At torchao's achievable 92% of the HBM's bandwidth (``memplan.planning.kernels``)."""
    from memplan.planning.kernels import ACHIEVABLE_HBM

    rs, ag, ag_itemsize = ASYNC_TP_FUSED[wl.float8]
    act = c.mbs * local_seq(wl.seq_len, c.cp) * spec.hidden_size * wl.compute_dtype.itemsize
    per_layer = rs * act * (1 + 1 / c.tp) + ag * act * ag_itemsize * 4 / c.tp
    return per_layer * c.layers * c.m / (gpu.hbm_bytes_per_s * ACHIEVABLE_HBM)


def async_tp_exposed(seconds: Any, beside: Any, tp: Any, where: Any) -> Any:
    """Exposed seconds of tensor parallelism's collectives, ``seconds`` in all, when each is
    micro-pipelined with the matmul it feeds or follows, ``beside`` seconds of matmuls in all
    (torchtitan's async TP: Inductor's _micro_pipeline_tp pass replaces an all-gather and
    its matmul with ``fused_all_gather_matmul``, a matmul and its reduce-scatter with
    ``fused_matmul_reduce_scatter``, torch/distributed/_symmetric_memory/__init__.py).
    The collective is cut into ``tp`` shards: the all-gather's matmul starts on the local
    shard while the next one arrives and each shard's matmul runs while the next is copied;
    the reduce-scatter sends each shard's partial product while the next is computed. One
    shard of each transfer has no matmul beside it (the last one reduced; a shard gathered
    ahead of the local matmul's end is the mirror case): ``seconds / tp`` waits. The other
    tp - 1 shards hide behind tp - 1 shards of the matmuls, what exceeds them is exposed."""
    rest = seconds * (tp - 1) / tp
    window = beside * (tp - 1) / tp
    return seconds / tp + where(rest > window, rest - window, 0.0)


def ring_exposed(seconds: Any, steps: Any, block: Any, where: Any) -> Any:
    """Exposed seconds of a ring of ``steps`` sends taking ``seconds`` in all, each beside
    ``block`` seconds of attention: a send is exposed by what it exceeds its block."""
    send = seconds / steps
    return where(send > block, seconds * (1.0 - block / where(send > 0, send, 1.0)), 0.0)


def step_times(spec: ModelSpec, gpu: GpuSpec, wl: Workload, global_batch: int, c: Columns,
               model_flops: np.ndarray, hardware_flops: np.ndarray, *,
               mfu: float = DEFAULT_MFU) -> StepTimes:
    """Estimated seconds of one step and what bounds it, per candidate; ``model_flops`` and
    ``hardware_flops`` of the whole job (``step_flops`` of each candidate's pp and vpp) per
    candidate."""
    return StepTimes(**_step_fields(spec, gpu, wl, global_batch, c, model_flops,
                                    hardware_flops, mfu))


def step_times_rows(spec: ModelSpec, gpu: GpuSpec, wl: Workload, global_batch: int,
                    rows: list[Columns], flops: list[tuple[float, float]], *,
                    mfu: float = DEFAULT_MFU) -> StepTimes:
    """``step_times`` of candidates given one by one (``Columns.one`` each, with its
    ``step_flops``): the same floats, a list per field, without numpy."""
    fields = [_step_fields(spec, gpu, wl, global_batch, c, model, hardware, mfu)
              for c, (model, hardware) in zip(rows, flops)]
    kinds = fields[0]["comm_s"] if fields else {}
    return StepTimes(
        **{name: [f[name] for f in fields] for name in StepTimes._fields if name != "comm_s"},
        comm_s={kind: [f["comm_s"][kind] for f in fields] for kind in kinds})


def comm_seconds(spec: ModelSpec, gpu: GpuSpec, par: ParallelConfig, wl: Workload,
                 num_microbatches: int, params_on_rank: int) -> dict[str, float]:
    """``comm_columns`` of one layout."""
    c = Columns.one(par, wl.micro_batch_size, num_microbatches, params_on_rank,
                    num_layers=spec.num_layers,
                    rerun=recomputed_share(wl, spec.num_layers, par))
    return {kind: float(v) for kind, v in comm_columns(spec, gpu, wl, c).items()}


def step_time(spec: ModelSpec, gpu: GpuSpec, par: ParallelConfig, wl: Workload,
              global_batch: int, num_microbatches: int, params_on_rank: int, *,
              mfu: float = DEFAULT_MFU, measured: bool = False) -> StepTime:
    """Estimated seconds of one step of one layout and what bounds it (``step_times`` on
    plain numbers: the same floats, without numpy)."""
    model, hardware = step_flops(spec, wl, global_batch, pp=par.pp, vpp=par.vpp,
                                 split=par.stage_layers)
    c = Columns.one(par, wl.micro_batch_size, num_microbatches, params_on_rank,
                    num_layers=spec.num_layers,
                    balance=stage_balance(spec, wl, par.pp, par.vpp, par.stage_layers),
                    rerun=recomputed_share(wl, spec.num_layers, par))
    f = _step_fields(spec, gpu, wl, global_batch, c, model, hardware, mfu, measured)
    return StepTime(
        model_flops=float(f["model_flops"]), hardware_flops=float(f["hardware_flops"]),
        compute_s=float(f["compute_s"]),
        comm_s={kind: float(v) for kind, v in f["comm_s"].items()},
        exposed_comm_s=float(f["exposed_comm_s"]), bubble_s=float(f["bubble_s"]),
        step_s=float(f["step_s"]), tokens_per_s_per_gpu=float(f["tokens_per_s_per_gpu"]),
        mfu=float(f["mfu"]), bound=_BOUNDS[f["bound"]])


def estimate_step_time(est: Estimate) -> StepTime:
    """The step-time model for an estimate's configuration: its layout, workload, global batch
    and micro-batches, the most loaded rank's parameters, and the measured MFU when a
    calibration profile gave one (else ``DEFAULT_MFU``)."""
    measured = est.calibration.mfu if est.calibration is not None else None
    return step_time(est.spec, est.gpu, est.parallel, est.workload, est.global_batch_size,
                     est.num_microbatches, est.worst.num_params,
                     mfu=measured or DEFAULT_MFU, measured=measured is not None)
