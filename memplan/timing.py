"""Step-time model: FLOPs, communication per parallel dimension, pipeline bubble.

Torch-free, for ranking layouts (``memplan plan``), not for promising a wall-clock number: the
achievable FLOP/s is the catalog peak times a stated MFU assumption until calibration measures
it, and each kind of communication has a stated overlap with compute.

FLOPs per token (forward, one model replica) count every matmul: 2 FLOPs per multiply-add of the
projection weights (MoE: the top-k experts a token visits) and the output head, plus causal
attention's two batched matmuls, 2 * 2 * (s/2) * a * d on average per token per layer
(Narayanan et al. 2021, arXiv 2104.04473, section 5.1, without the causal halving there).
Backward costs twice the forward. Full recompute reruns each recomputed layer's forward;
selective recompute reruns the attention core's matmuls.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from memplan.hardware import GpuSpec
from memplan.parallel import ParallelConfig, ZeroStage
from memplan.spec import ModelSpec, param_counts
from memplan.workload import Recompute, Workload

# Llama 3 405B pre-training reached 38-43% BF16 MFU on 16k H100s (Dubey et al. 2024, arXiv
# 2407.21783, Table 4); the midpoint is the assumption until calibration measures it.
DEFAULT_MFU = 0.40
MFU_SOURCE = "assumption: 40% of peak (Llama 3 paper, Table 4: 38-43% on H100) until calibrated"

# Fraction of each communication hidden behind compute, stated assumptions: tensor-parallel
# collectives sit between dependent matmuls (exposed, Megatron-LM without TP comm overlap);
# data-parallel gradient reduction and ZeRO gathers overlap backward and forward except the
# last bucket; pipeline sends of one micro-batch overlap the next one's compute; context-
# parallel ring KV exchange overlaps the attention blocks; expert all-to-all is exposed.
OVERLAP = {"tp": 0.0, "dp": 0.8, "pp": 0.5, "cp": 0.5, "ep": 0.0}


class Bound(str, enum.Enum):
    COMPUTE = "compute"
    COMMUNICATION = "communication"
    BUBBLE = "pipeline bubble"


@dataclass(frozen=True)
class StepTime:
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


def forward_flops_per_token(spec: ModelSpec, seq_len: int) -> tuple[float, float, float]:
    """(projection and head matmuls, attention score matmuls, per layer attention) FLOPs of one
    token's forward through the whole model."""
    counts = param_counts(spec)
    dense = 0
    for i, layer in enumerate(counts.layers):
        dense += layer.tp_sharded + layer.replicated
        if spec.is_moe_layer(i) and spec.moe is not None:
            dense += layer.expert * spec.moe.top_k // spec.moe.num_experts
    head = spec.vocab_size * spec.hidden_size
    attn_per_layer = 2.0 * seq_len * spec.q_size  # QK^T and PV, causal average context s/2
    return 2.0 * (dense + head), attn_per_layer * spec.num_layers, attn_per_layer


def step_flops(spec: ModelSpec, wl: Workload, global_batch: int) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step of the whole job."""
    tokens = global_batch * wl.seq_len
    matmul, attention, attn_layer = forward_flops_per_token(spec, wl.seq_len)
    forward = matmul + attention
    model = 3.0 * forward * tokens
    extra = 0.0
    if wl.recompute is Recompute.FULL:
        layers = spec.num_layers if wl.recompute_layers is None else wl.recompute_layers
        head = 2.0 * spec.vocab_size * spec.hidden_size
        per_layer = (forward - head) / spec.num_layers
        extra = per_layer * min(layers * 1.0, spec.num_layers) * tokens
    elif wl.recompute is Recompute.SELECTIVE:
        extra = attn_layer * spec.num_layers * tokens
    return model, model + extra


def _bandwidth(gpu: GpuSpec, span: int) -> float:
    """Intra-node links when a group's ranks fit in one node, else the network."""
    return gpu.intra_node_bytes_per_s if span <= gpu.gpus_per_node else gpu.inter_node_bytes_per_s


def _ring(size: int) -> float:
    """Bytes each rank sends per byte of a ring all-gather or reduce-scatter."""
    return (size - 1) / size if size > 1 else 0.0


def comm_seconds(spec: ModelSpec, gpu: GpuSpec, par: ParallelConfig, wl: Workload,
                 num_microbatches: int, params_on_rank: int) -> dict[str, float]:
    """Seconds each dimension spends communicating in one step of one GPU, before overlap.

    Ranks are laid out tp innermost, then cp, dp, pp (Megatron-LM's order), so a group uses
    intra-node links when its span of consecutive ranks fits in a node.
    """
    e = wl.compute_dtype.itemsize
    m, layers = num_microbatches, spec.num_layers // par.pp
    tokens = wl.micro_batch_size * wl.seq_len // par.cp
    act_bytes = tokens * spec.hidden_size * e
    out: dict[str, float] = {}
    # TP: two all-reduces per layer forward and two backward (or all-gather + reduce-scatter
    # with SP, the same volume): 2 * ring factor per all-reduce.
    tp_bytes = 4 * 2 * _ring(par.tp) * act_bytes * layers * m
    out["tp"] = tp_bytes / _bandwidth(gpu, par.tp)
    # DP: gradients reduced once per step (ZeRO: reduce-scatter + all-gather of the weights,
    # the same volume); ZeRO-3 also gathers the weights for forward and backward.
    dp = par.dp * par.cp
    grad_bytes = params_on_rank * wl.precision.recipe.grad_bytes
    dp_bytes = 2 * _ring(dp) * grad_bytes
    if par.zero >= ZeroStage.PARAMETERS:
        dp_bytes += 2 * _ring(dp) * params_on_rank * e * m
    out["dp"] = dp_bytes / _bandwidth(gpu, par.tp * par.cp * par.dp)
    # PP: each micro-batch's activations cross each boundary forward and their gradients back.
    pp_bytes = 2 * act_bytes // (par.tp if par.sequence_parallel else 1) * m if par.pp > 1 else 0
    out["pp"] = pp_bytes / _bandwidth(gpu, par.world_size)
    # CP: a ring passes every other rank's K and V chunk through, forward and backward.
    kv = 2 * tokens * spec.kv_size // par.tp * e
    out["cp"] = 2 * (par.cp - 1) * kv * layers * m / _bandwidth(gpu, par.tp * par.cp)
    # EP: dispatch and combine all-to-alls of the routed tokens, forward and backward.
    ep_bytes = 0.0
    if spec.moe is not None and par.ep > 1:
        moe_layers = sum(spec.is_moe_layer(i) for i in range(layers))
        routed = tokens * spec.moe.top_k * spec.hidden_size * e
        ep_bytes = 4 * _ring(par.ep) * routed * moe_layers * m
    out["ep"] = ep_bytes / _bandwidth(gpu, par.tp * par.cp * par.ep)
    return out


def step_time(spec: ModelSpec, gpu: GpuSpec, par: ParallelConfig, wl: Workload,
              global_batch: int, num_microbatches: int, params_on_rank: int, *,
              mfu: float = DEFAULT_MFU) -> StepTime:
    """Estimated seconds of one step and what bounds it."""
    model, hardware = step_flops(spec, wl, global_batch)
    compute = hardware / par.world_size / (gpu.bf16_flops * mfu)
    comm = comm_seconds(spec, gpu, par, wl, num_microbatches, params_on_rank)
    exposed = sum(seconds * (1.0 - OVERLAP[kind]) for kind, seconds in comm.items())
    bubble = 0.0
    if par.pp > 1:  # (p - 1) / (v * m) of the ideal time (Narayanan et al. 2021, eq. 1-2)
        bubble = (par.pp - 1) / (par.vpp * num_microbatches) * (compute + exposed)
    total = compute + exposed + bubble
    tokens = global_batch * wl.seq_len
    bound = max(((compute, Bound.COMPUTE), (exposed, Bound.COMMUNICATION),
                 (bubble, Bound.BUBBLE)), key=lambda pair: pair[0])[1]
    return StepTime(
        model_flops=model, hardware_flops=hardware, compute_s=compute, comm_s=comm,
        exposed_comm_s=exposed, bubble_s=bubble, step_s=total,
        tokens_per_s_per_gpu=tokens / total / par.world_size,
        mfu=model / total / par.world_size / gpu.bf16_flops, bound=bound,
    )
