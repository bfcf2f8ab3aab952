"""Parallel layout (TP, SP, PP with virtual stages, DP, CP, EP, ZeRO) and every layout and
workload rule.

Every check that depends on the layout, the workload or the batch split lives here
(``validate``, ``resolve_batch``, ``layout_for_gpus``) and raises ``LayoutError`` naming the
numbers, e.g. ``tp (16) must divide num_kv_heads (8)``; its ``rule`` is the same sentence
without them, which a search counts its rejections by.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from memplan.choices import Field, Record, field_validator
from memplan.choices import PlainEnum, PlainIntEnum
from memplan import presets
from memplan.errors import LayoutError
from memplan.spec import ModelSpec, PositionKind
from memplan.units import ceil_div
from memplan.workload import (
    ALL_LINEAR,
    Attention,
    ChunkBackward,
    Framework,
    GradSync,
    LogitsHeld,
    LossImpl,
    MoeImpl,
    PipelineSplit,
    Precision,
    Recompute,
    Workload,
)


class ZeroStage(PlainIntEnum):
    """ZeRO stage (Rajbhandari et al. 2020). FSDP full sharding is stage 3."""

    NONE = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3


class TpStyle(PlainEnum):
    """What a column-parallel linear saves under sequence parallelism.

    megatron  the sequence shard of its input, all-gathered again in backward (Megatron-LM;
              Korthikanti et al. 2022, section 4.2.2)
    dtensor   the all-gathered full-sequence input (PyTorch DTensor's ColwiseParallel after
              SequenceParallel, as torchtitan runs it; traced)
    """

    MEGATRON = "megatron"
    DTENSOR = "dtensor"


class GradBuffers(PlainEnum):
    """Where data-parallel gradients live (ZeRO 0/1 with more than one replica).

    view  persistent communication buffers that the gradients are views of, allocated once:
          Megatron-LM's contiguous grad buffer, DDP(gradient_as_bucket_view=True)
    copy  PyTorch DDP's default: .grad tensors freed by zero_grad, plus a persistent gradient-
          sized set of flat buckets they are copied into for the all-reduce
    """

    VIEW = "view"
    COPY = "copy"


class Offload(PlainEnum):
    """What lives in host memory instead of on the GPU; a layout holds a set of them (empty:
    nothing). Each is a mechanism of its own in ``memplan.model.offload``.

    optimizer    the optimizer's states and its step, on the CPU. With ZeRO stages 1-3 (and no
                 ``params``): ZeRO-Offload (Ren et al. 2021; DeepSpeed ``offload_optimizer:
                 {device: cpu}``): fp32 master weights, states, an fp32 copy of the rank's
                 gradient shard; the GPU keeps the weights and gradients its stage leaves it.
                 Without ZeRO: torchao's ``CPUOffloadOptimizer`` (torchao/optim/cpu_offload.py):
                 a pinned host copy of every trained weight of 4,096 elements or more and of
                 its gradient, their states and step on the host (smaller ones stepped on the
                 device); the GPU keeps the weights and gradients.
    activations  every tensor autograd saves is packed to host memory in forward and unpacked
                 to the GPU in backward (``torch.autograd.graph.save_on_cpu``)
    params       FSDP2's ``CPUOffloadPolicy`` (ZeRO stage 3 only): sharded weights, their
                 gradients and the optimizer step on the host; the GPU holds the gathered
                 units and the reduce-scatter buffers. Implies ``optimizer``.
    """

    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"
    PARAMS = "params"


def offload_names(offload: frozenset[Offload]) -> str:
    """The set as the CLI writes it: "none", or its names in ``Offload``'s order, comma
    separated."""
    return ",".join(kind.value for kind in Offload if kind in offload) or "none"


def zero_offload(par: "ParallelConfig") -> bool:
    """The optimizer offloaded as ZeRO-Offload: ``optimizer`` with ZeRO stage 1-3, no
    ``params``."""
    return (Offload.OPTIMIZER in par.offload and Offload.PARAMS not in par.offload
            and par.zero >= ZeroStage.OPTIMIZER)


def _activations_rule(spec: ModelSpec, wl: Workload) -> LayoutError | None:
    """Activations on the host (``memplan.model.offload.saved_on_host``) are modelled for what
    the traces cover: gated MLPs, flash/SDPA attention, no autocast (traced: eager attention,
    GPT-2's MLP and autocast's cached casts held 3-20% more than the rule counts)."""
    what = ("precision " + wl.precision.value if wl.precision.policy.autocast
            else "eager attention" if wl.attention is Attention.EAGER
            else "MoE layers" if spec.moe is not None else "MLA" if spec.mla is not None
            else f"a non-gated MLP ({spec.name})" if not spec.mlp.gated else None)
    if what is None:
        return None
    return LayoutError(f"offload activations is not modelled with {what.split(' (')[0]}",
                       f"offload activations with {what}: not modelled yet (traced for gated "
                       "MLPs, flash attention, fp32 or bf16 weights)")


def optimizer_on_host(par: "ParallelConfig") -> bool:
    """Whether the optimizer step runs on the CPU (any of ``Offload``'s optimizer mechanisms,
    FSDP2's ``CPUOffloadPolicy`` included)."""
    return bool(par.offload & {Offload.OPTIMIZER, Offload.PARAMS})


def host_optimizer(par: "ParallelConfig") -> bool:
    """The optimizer offloaded as torchao's ``CPUOffloadOptimizer``: ``optimizer`` without
    ZeRO."""
    return Offload.OPTIMIZER in par.offload and par.zero == ZeroStage.NONE


def fsdp1_rule(spec: ModelSpec, par: "ParallelConfig", wl: Workload) -> LayoutError | None:
    """What FSDP1 (``fsdp_version`` 1 at zero 3 with data parallelism) is traced with but not
    modelled: ``forward_prefetch`` (its backward gathers a third block) and SHARD_GRAD_OP
    under ``no_sync()`` accumulation (memplan.model.fsdp1)."""
    if wl.fsdp_version != 1 or par.zero < ZeroStage.PARAMETERS or par.dense_shard_degree == 1:
        return None
    if wl.forward_prefetch:
        return LayoutError("fsdp_version 1 is not modelled with forward_prefetch",
                           "fsdp_version 1 with forward_prefetch: FSDP1's forward prefetch is "
                           "not modelled (its backward gathers a third block); use "
                           "forward_prefetch false")
    accumulating = (wl.global_batch_size or 0) > wl.micro_batch_size * par.dp
    if not wl.reshard_after_forward and wl.grad_sync is GradSync.LAST and accumulating:
        return LayoutError("SHARD_GRAD_OP is not modelled with grad_sync last",
                           "fsdp_version 1 with reshard_after_forward false (SHARD_GRAD_OP) "
                           "and grad_sync last: under no_sync() its units stay gathered across "
                           "micro-batches (_should_free_in_backward), not modelled; use "
                           "grad_sync every")
    return None


def offload_rule(spec: ModelSpec, par: "ParallelConfig", wl: Workload) -> LayoutError | None:
    """Where each offload mechanism (``Offload``) cannot combine with the model, layout or
    recipe."""
    precision = wl.precision  # (a StrEnum: formatted as its value)
    if Offload.ACTIVATIONS in par.offload and (err := _activations_rule(spec, wl)) is not None:
        return err
    if Offload.PARAMS in par.offload and wl.flat_partition:  # DeepSpeed's offload_param
        if par.zero < ZeroStage.PARAMETERS or Offload.OPTIMIZER not in par.offload:
            return LayoutError("offload params under DeepSpeed needs zero 3 and offload "
                               "optimizer", "offload params with DeepSpeed (offload_param) is "
                               "modelled at zero 3 with the optimizer offloaded too "
                               f"(ZeRO-Infinity on the CPU), got zero {int(par.zero)}, offload "
                               f"{offload_names(par.offload)}")
        return None
    if Offload.PARAMS in par.offload:
        if par.zero < ZeroStage.PARAMETERS:
            return LayoutError("offload params needs zero 3", "offload params needs zero 3 "
                               "(FSDP2's CPUOffloadPolicy offloads sharded weights), got zero "
                               f"{int(par.zero)}")
        if par.pp > 1:
            return LayoutError("offload params is not modelled with pp > 1",
                               f"offload params with pp ({par.pp}) > 1: FSDP2 kept gathered "
                               "under pipeline parallelism is not modelled with CPU offload")
        if wl.precision.policy.master is not None or wl.precision.policy.autocast:
            return LayoutError(f"offload params does not combine with precision {precision}",
                               f"offload params with precision {precision}: FSDP2 updates its "
                               "own sharded weights (use fp32, fsdp-bf16 or bf16-pure)")
        return None
    if host_optimizer(par) and wl.precision.policy.master is not None:
        return LayoutError(
            f"offload optimizer without ZeRO does not combine with precision {precision}",
            f"offload optimizer with zero 0 (torchao CPUOffloadOptimizer) and precision "
            f"{precision}: it updates the model's own weights, with no master copy (use fp32, "
            "bf16-pure or amp-*, or zero 1-3)")
    if not zero_offload(par):
        return None
    if wl.precision is Precision.FSDP_BF16:
        return LayoutError(
            "offload optimizer does not combine with precision fsdp-bf16",
            "offload optimizer models DeepSpeed's ZeRO-Offload (optimizer only); precision "
            "fsdp-bf16 is FSDP2, whose CPUOffloadPolicy offloads the weights too (--offload "
            "params)")
    if wl.precision is Precision.BF16_PURE:
        return LayoutError(
            "offload optimizer does not combine with precision bf16-pure",
            "offload optimizer with precision bf16-pure: ZeRO-Offload keeps an fp32 master copy "
            "and fp32 states on the host, which is bf16-mixed with the optimizer offloaded "
            "(use --precision bf16-mixed)")
    if wl.precision.policy.autocast:
        return LayoutError(
            f"offload optimizer does not combine with precision {precision}",
            f"offload optimizer with precision {precision}: ZeRO-Offload trains "
            "low-precision weights against an fp32 master copy on the host, not fp32 weights "
            "under autocast (use --precision bf16-mixed or fp16-mixed)")
    return None


class ExpertSplit(NamedTuple):
    """How one rank holds the routed experts: ``ep`` ranks split the experts, ``etp`` ranks
    split each expert's weights (column-parallel in, row-parallel out, as TP)."""

    ep: int
    etp: int


class ParallelConfig(Record):
    """Degrees of each parallel dimension. World size = tp * pp * cp * dp.

    ``vpp`` is the number of model chunks per pipeline rank (interleaved 1F1B when > 1). ``ep``
    splits routed experts across ranks of the data- and context-parallel group; ``etp`` splits
    each expert's weights (Megatron-LM's --expert-tensor-parallel-size; None: by tp, its
    default). With ``etp`` the experts' groups are carved from tp x dp x cp ranks: ep x etp
    ranks hold one copy of the experts, tp * dp * cp / (ep * etp) copies exist
    (megatron/core/parallel_state.py initialize_model_parallel: the expert-data-parallel
    group is world / (etp * ep * pp)).
    """

    tp: int = Field(default=1, gt=0)
    pp: int = Field(default=1, gt=0)
    vpp: int = Field(default=1, gt=0)
    vpp_group: int | None = Field(default=None, gt=0, description=(
        "micro-batches per group of the interleaved schedule, each run through every model "
        "chunk in turn (Megatron-LM's --microbatch-group-size-per-virtual-pipeline-stage); "
        "None: pp"))
    dp: int = Field(default=1, gt=0)
    cp: int = Field(default=1, gt=0)
    ep: int = Field(default=1, gt=0)
    etp: int | None = Field(default=None, gt=0, description=(
        "TP degree of the routed experts' weights; None: tp (Megatron-LM's default)"))
    zero: ZeroStage = ZeroStage.NONE
    sequence_parallel: bool = False
    vocab_parallel: bool = Field(default=True, description="embedding, head and loss split "
                                 "over the vocabulary by TP; False: replicated on each TP rank")
    tp_style: TpStyle = TpStyle.MEGATRON
    grad_buffers: GradBuffers = GradBuffers.VIEW
    offload: frozenset[Offload] = frozenset()
    stage_layers: tuple[int, ...] | None = Field(default=None, description=(
        "decoder layers of each virtual pipeline stage in order (pp*vpp entries; virtual "
        "stage c*pp + r is model chunk c of pipeline rank r); None: pp*vpp equal parts"))
    dp_shard: int | None = Field(default=None, gt=0, description=(
        "ranks of one ZeRO/FSDP shard group within the data-parallel group (HSDP: dp = "
        "replicas x dp_shard); None: shard over all of dp"))

    @field_validator("stage_layers", mode="before")
    @classmethod
    def _split_as_tuple(cls, value: object) -> object:
        return tuple(value) if isinstance(value, list) else value

    @property
    def data_parallel_buffers(self) -> bool:
        """Whether gradients go through DDP-style buffers (ZeRO 0/1 with several replicas)."""
        return self.zero < ZeroStage.GRADIENTS and self.data_parallel_degree > 1

    @property
    def vocab_divisor(self) -> int:
        return self.tp if self.vocab_parallel else 1

    def vocab_shard(self, vocab_size: int) -> int:
        """Vocabulary rows on the most loaded TP rank (``vocab_shard``)."""
        return vocab_shard(vocab_size, self.vocab_divisor)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def dense_shard_degree(self) -> int:
        """Ranks one dense parameter is sharded over: ZeRO shards across DP x CP
        (Megatron-LM's distributed optimizer uses the data-parallel group with CP folded in;
        torchtitan's FSDP mesh is dp_shard x cp), or across the shard group x CP with HSDP."""
        return self.shard_group * self.cp

    @property
    def shard_group(self) -> int:
        """Data-parallel ranks of one shard group: ``dp_shard``, else all of dp."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def replicas(self) -> int:
        """Shard groups that hold the same shards (HSDP's replicate degree; 1 without)."""
        return self.dp // self.shard_group

    @property
    def data_parallel_degree(self) -> int:
        """Ranks whose gradients are averaged: dp x cp (shard groups and their replicas)."""
        return self.dp * self.cp

    @property
    def expert_tp(self) -> int:
        """TP degree of the routed experts' weights: ``etp``, else tp."""
        return self.tp if self.etp is None else self.etp

    @property
    def experts(self) -> ExpertSplit:
        """How the routed experts are split: (ep, expert_tp)."""
        return ExpertSplit(self.ep, self.expert_tp)

    @property
    def expert_data_parallel(self) -> int:
        """Ranks holding the same expert shard: the expert-data-parallel group, dp * cp / ep,
        or tp * dp * cp / (ep * etp) with ``etp``."""
        if self.etp is None:
            return self.dp * self.cp // self.ep
        return self.tp * self.dp * self.cp // (self.ep * self.etp)

    @property
    def expert_shard_degree(self) -> int:
        """Ranks one expert shard's states are sharded over: the expert-data-parallel group
        over the ``replicas`` (Megatron-LM's distributed optimizer instances shard expert
        states over expert_data_parallel_size / num_distributed_optimizer_instances ranks:
        parallel_state.py initialize_model_parallel intra_partial_expert_data_parallel_size,
        optimizer/__init__.py intra_expt_dp_group; torchtitan's HSDP replicates its efsdp
        shards over dp_replicate: distributed/parallel_dims.py sparse mesh)."""
        return self.expert_data_parallel // self.replicas

    @property
    def sp_divisor(self) -> int:
        """Divisor of the residual-stream activations: tp with sequence parallelism, else 1."""
        return self.tp if self.sequence_parallel else 1


def vocab_shard(vocab_size: int, divisor: int) -> int:
    """Vocabulary rows on the most loaded rank when ``divisor`` ranks split the vocabulary:
    the ceiling (Megatron-LM pads the vocabulary to a multiple of the TP degree)."""
    return ceil_div(vocab_size, divisor)


def local_seq(seq_len, cp):  # ints, or numpy arrays of them (the step-time model's columns)
    """Tokens of one sequence on one context-parallel rank: seq / cp (``validate`` makes 2*cp
    divide seq)."""
    return seq_len // cp


def virtual_stage_layers(num_layers: int, par: ParallelConfig) -> tuple[int, ...]:
    """Decoder layers of each virtual stage in order (``ParallelConfig.stage_layers``, else
    pp*vpp equal parts): virtual stage c*pp + r is model chunk c of pipeline rank r, as
    Megatron-LM's interleaving and torchtitan's looped schedules place them."""
    if par.stage_layers is not None:
        return par.stage_layers
    parts = par.pp * par.vpp
    return (num_layers // parts,) * parts


def pipeline_only(pp: int, vpp: int = 1, stage_layers: tuple[int, ...] | None = None,
                  vpp_group: int | None = None) -> ParallelConfig:
    """A layout of these pipeline fields alone, the rest their defaults, for the functions
    that read only them (``stage_layers``, ``chunks_in_flight``, ``rank_layers``): made
    without the checks (``model_construct``), as its values are those of a layout checked
    before (its ``pp``, ``vpp``, ``stage_layers`` and ``vpp_group``)."""
    return ParallelConfig.model_construct(pp=pp, vpp=vpp, stage_layers=stage_layers,
                                          vpp_group=vpp_group)


@lru_cache(maxsize=16384)
def rank_layers(num_layers: int, par: ParallelConfig) -> tuple[int, ...]:
    """Decoder layers on each pipeline rank, all its model chunks together (kept per layout:
    the step-time model reads it for every candidate)."""
    counts = virtual_stage_layers(num_layers, par)
    if par.vpp == 1:  # one chunk per rank: its own count
        return counts
    return tuple(sum(counts[c * par.pp + r] for c in range(par.vpp)) for r in range(par.pp))


def weighted_split(num_layers: int, parts: int, input_weight: int = 1,
                   output_weight: int = 1) -> tuple[int, ...]:
    """torchtitan's automatic split (distributed/pipeline_parallel.py
    _generate_llm_fqn_per_model_part, torchtitan 0.3.0): the embedding counts as
    ``input_weight`` layers on the first virtual stage and the final norm and head as
    ``output_weight`` on the last (``pipeline_parallel_first/last_stage_less_layers``, 1 by
    default); the ``num_layers + weights`` effective layers are split evenly, the first
    stages taking one more where they do not divide. ``()`` where it leaves a stage
    without a layer (torchtitan refuses such a split)."""
    if parts == 1:
        return (num_layers,)
    effective = num_layers + input_weight + output_weight
    per, extra = divmod(effective, parts)
    if per == 0 or input_weight > per or output_weight > per:
        return ()
    counts = [per + (i < extra) for i in range(parts)]
    counts[0] -= input_weight
    counts[-1] -= output_weight
    return tuple(counts) if min(counts) > 0 else ()


def pipeline_stage(par: ParallelConfig, rank: int) -> int:
    """The pipeline stage of global rank ``rank``: ranks are ordered tp, cp, dp, pp from the
    innermost (Megatron-LM's order), so a stage holds tp * cp * dp consecutive ranks."""
    return rank // (par.tp * par.cp * par.dp)


def layout_for_gpus(num_gpus: int, *, tp: int = 1, pp: int = 1, cp: int = 1,
                    dp: int | None = None, **rest: object) -> ParallelConfig:
    """A layout for ``num_gpus`` GPUs; dp is derived as num_gpus / (tp*pp*cp) unless given."""
    if num_gpus <= 0:
        raise LayoutError("gpus must be positive", f"gpus must be positive, got {num_gpus}")
    model_par = tp * pp * cp
    if dp is None:
        if (err := gpus_rule(num_gpus, tp, pp, cp)) is not None:
            raise err
        dp = num_gpus // model_par
    elif dp * model_par != num_gpus:
        raise LayoutError(
            "tp*pp*cp*dp must equal gpus",
            f"tp*pp*cp*dp ({tp}*{pp}*{cp}*{dp} = {model_par * dp}) must equal gpus ({num_gpus})")
    return ParallelConfig(tp=tp, pp=pp, cp=cp, dp=dp, **rest)  # type: ignore[arg-type]


# The rules of one degree, for a search that builds layouts degree by degree (the planner): each
# returns the ``LayoutError`` ``validate`` raises for the first rule broken, or None. Plain
# integer checks, cheap enough for every candidate degree.

def gpus_rule(num_gpus: int, tp: int, pp: int, cp: int) -> LayoutError | None:
    """tp*pp*cp must divide the GPUs (dp is the rest)."""
    if num_gpus % (tp * pp * cp):
        return LayoutError("gpus must be divisible by tp*pp*cp",
                           f"gpus ({num_gpus}) must be divisible by tp*pp*cp ({tp}*{pp}*{cp} "
                           f"= {tp * pp * cp})")
    return None


def tp_rule(spec: ModelSpec, tp: int) -> LayoutError | None:
    """tp must divide the attention heads, the KV heads and the FFN width (column-parallel
    linears split their output features), and an MoE's expert FFN width."""
    # one test per rule, no table built: validate runs this for every layout a plan searches
    if spec.num_attention_heads % tp:
        return _divides_error("tp", tp, "num_attention_heads", spec.num_attention_heads)
    if spec.num_kv_heads % tp:
        return _divides_error("tp", tp, "num_kv_heads", spec.num_kv_heads)
    if spec.ffn_hidden_size % tp:
        return _divides_error("tp", tp, "ffn_hidden_size", spec.ffn_hidden_size)
    if spec.moe is not None and spec.moe.expert_ffn_hidden_size % tp:
        return _divides_error("tp", tp, "expert_ffn_hidden_size", spec.moe.expert_ffn_hidden_size)
    if spec.mamba is not None and spec.mamba.num_heads % tp:
        return _divides_error("tp", tp, "mamba.num_heads", spec.mamba.num_heads)
    return None


def cp_rule(seq_len: int, cp: int) -> LayoutError | None:
    """Load-balanced causal CP splits the sequence into 2*cp chunks (Megatron-LM context
    parallelism docs: seq length must be divisible by 2 * cp)."""
    if cp > 1 and seq_len % (2 * cp):
        return _divides_error("2*cp", 2 * cp, "seq", seq_len)
    return None


def ep_rule(num_experts: int, ep: int, dp_cp: int) -> LayoutError | None:
    """ep must divide the routed experts and the data- and context-parallel ranks
    (``dp_cp`` = dp*cp) it splits them across."""
    if num_experts % ep:
        return _divides_error("ep", ep, "num_experts", num_experts)
    if dp_cp % ep:
        return _divides_error("ep", ep, "dp*cp", dp_cp)
    return None


def etp_rule(spec: ModelSpec, par: ParallelConfig) -> LayoutError | None:
    """etp needs routed experts, must divide the experts' FFN width, and ep * etp must divide
    tp * dp * cp (Megatron-LM initialize_model_parallel: world size divisible by
    etp * ep * pp)."""
    if par.etp is None:
        return None
    if spec.moe is None:
        return LayoutError("etp needs a mixture-of-experts model",
                           f"etp ({par.etp}) needs a mixture-of-experts model; {spec.name} "
                           "has no routed experts")
    return expert_rule(spec.moe.num_experts, spec.moe.expert_ffn_hidden_size, par.ep,
                       par.etp, par.tp * par.dp * par.cp)


def expert_rule(num_experts: int, expert_ffn: int, ep: int, etp: int,
                tp_dp_cp: int) -> LayoutError | None:
    """``etp_rule`` on plain degrees (the planner's): etp divides the experts' FFN width, ep
    the experts, ep * etp the tp * dp * cp ranks."""
    if expert_ffn % etp:
        return _divides_error("etp", etp, "expert_ffn_hidden_size", expert_ffn)
    if num_experts % ep:
        return _divides_error("ep", ep, "num_experts", num_experts)
    if tp_dp_cp % (ep * etp):
        return _divides_error("ep*etp", ep * etp, "tp*dp*cp", tp_dp_cp)
    return None


def float8_rule(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> LayoutError | None:
    """What torchao's float8 linears are modelled for (``memplan.model.linear``): dense
    layers, eager or compiled (a gated MLP: ``memplan.model.compiled.float8_recomputed``
    traced), recompute none, full or torchtitan's per-op SAC (its save list keeps the
    Float8Linear's mm outputs and the casts' ``aten.max``: traced). Tensor parallelism as
    torchtitan runs it (DTensor style, every block linear converted): with tensorwise
    scaling its llama3 ``apply_tp`` takes torchao's float8 styles
    (``float8/float8_tensor_parallel.py``: ``PrepareFloat8ModuleInput`` casts a block's input
    to float8 before its all-gather, ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``:
    ``memplan.model.linear.float8_tp_input_bytes``), which refuse a plain linear; with
    rowwise plain TP (0.3.0's sharding configs, dtype-agnostic), the Float8Linear casting
    the gathered bf16 input itself (``linear._gathered_grad``); both traced at tp 2 and 4,
    with and without sequence parallelism. Compiled with tp: under full recompute (each
    block saves its input alone; the recomputed block's casts are taken as traced eagerly) or
    torchtitan's per-op SAC (``memplan.model.compiled.sac_tp_terms``, traced) or, tensorwise
    with separate q/k/v, no recompute (``memplan.model.compiled.float8_tp_weights``, traced);
    refused: tp with compile and no recompute otherwise, LoRA,
    selective recompute other than per-op SAC. MoE layers with grouped experts
    (``moe_impl grouped``): torchtitan's ``Float8GroupedExpertsConverter`` runs their grouped
    matmuls as torchao's float8 grouped GEMM, rowwise whatever the linears' recipe
    (``memplan.model.float8_grouped``); refused there: a loop of expert linears or
    every-token bmm experts (torchao's ``Float8TrainingWeightWrapperTensor`` converts
    ``_grouped_mm`` with offsets alone), tp > 1, and FSDP2's float8 all-gather (the experts
    gather in the parameters' dtype, which the float8 all-gather saving does not separate)."""
    why = _float8_moe_refusal(par, wl) if spec.moe is not None else None
    if why is not None:
        pass
    elif wl.compile and not spec.mlp.gated:
        why = "compile and an ungated MLP"
    elif par.tp > 1 and (reason := _float8_tp_refusal(spec, par, wl)) is not None:
        why = reason
    elif wl.lora_rank:
        # torchtitan 0.3.0 composes them (components/lora.py _get_lora_cls: LoRAConverter
        # after Float8LinearConverter makes a LoRAFloat8Linear); torchao's
        # matmul_with_hp_or_float8_args saves the input and computes grad_weight whether or not
        # the weight trains (traced: tests/traced/test_torchao_float8.py), and the adapters
        # are plain Linears in the compute dtype, not the fp32 adapters peft builds, which is
        # the LoRA memplan models (memplan.model.adapters)
        why = (f"lora_rank {wl.lora_rank} (a frozen Float8Linear saves its input and makes a "
               "weight gradient it drops; torchtitan's adapters run in the compute dtype, "
               "memplan's LoRA is peft's fp32 adapters)")
    elif wl.recompute is Recompute.SELECTIVE and wl.selective_impl.value != "op":
        why = "recompute selective"
    if why is None:
        return None
    return LayoutError(f"float8 is not modelled with {why}",
                       f"float8 {wl.float8.value} with {why}: not modelled yet (float8 is "
                       "modelled for dense layers, eager or compiled with a gated MLP, tp 1 "
                       "or DTensor TP (compiled: full recompute, per-op SAC, or tensorwise without "
                       "recompute), and grouped "
                       "MoE experts at tp 1; no LoRA, recompute none, full or per-op SAC)")


def _float8_moe_refusal(par: ParallelConfig, wl: Workload) -> str | None:
    """Why float8 with MoE layers is not modelled for this run, or None (``float8_rule``)."""
    if not wl.moe_impl.grouped:
        return f"MoE layers and moe_impl {wl.moe_impl.value} (it needs grouped experts)"
    if par.tp > 1:
        return f"MoE layers and tp {par.tp}"
    if wl.compile:  # (the compiled MoE block is traced for transformers' bf16 experts only)
        return "MoE layers and compile"
    if wl.float8_all_gather:
        return "MoE layers and float8_all_gather"
    return None


def _float8_tp_refusal(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> str | None:
    """Why float8 with tp > 1 is not modelled for this run, or None (``float8_rule``)."""
    if wl.compile and wl.recompute is Recompute.NONE and (
            wl.float8.value != "tensorwise" or wl.fused_qkv or spec.fused_qkv):
        # under full recompute a compiled block saves its input alone, as an eager one does;
        # under per-op SAC its tags decide (memplan.model.compiled.sac_tp_terms); without
        # recompute, tensorwise, the float8 casts of the weight shards and of the gathered
        # inputs (compiled.float8_tp_weights, traced). Rowwise: the partitioner saves the
        # float8 casts of some sharded weights (w1, w2, w3, wo, wq in the traced block) and
        # only the scales of others (wk, wv), by its min cut: traced, not modelled. A fused
        # wqkv under torchao's tensorwise TP styles is not traced
        if wl.float8.value == "tensorwise":
            return (f"tp {par.tp}, compile, recompute none and a fused wqkv (torchao's float8 "
                    "TP styles have no plan entry for it: not traced)")
        return (f"tp {par.tp}, compile, recompute none and {wl.float8.value} scaling (the "
                "partitioner saves the float8 casts of some sharded weights and only the "
                "scales of others)")
    if par.tp_style is not TpStyle.DTENSOR:
        return f"tp {par.tp} in the {par.tp_style.value} style"
    # the block linears' widths (memplan.model.linear.convertible: multiples of 16)
    widths = (spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_hidden_size)
    if any(w % 16 for w in widths):
        return f"tp {par.tp} and a block linear whose widths are not multiples of 16"
    return None


def float8_gather_rule(par: ParallelConfig, wl: Workload) -> LayoutError | None:
    """FSDP2's float8 all-gather (torchao's ``enable_fsdp_float8_all_gather``) needs float8
    linears with tensorwise scaling (``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``
    casts each shard with one scale for the whole weight; torchtitan refuses it with a
    rowwise recipe) and FSDP2 sharding the weights (zero 3)."""
    if wl.float8.value != "tensorwise":
        why = f"float8 {wl.float8.value} (it needs tensorwise)"
    elif par.zero < ZeroStage.PARAMETERS or wl.fsdp_version == 1:
        why = "no FSDP2 weight sharding (it needs zero 3, FSDP2)"
    else:
        return None
    return LayoutError(f"float8_all_gather needs tensorwise float8 and FSDP2",
                       f"float8_all_gather with {why}")


def compile_loss_rule(spec: ModelSpec, par: ParallelConfig,
                      wl: Workload) -> LayoutError | None:
    """What a compiled loss is modelled for: torchtune's chunked cross-entropy
    (``memplan.model.chunked_output``), and torchtitan's ``cross_entropy_loss`` under
    ``torch.compile`` (``build_cross_entropy_loss`` wraps it when the job compiles; 0.3's
    ``compile.components`` "loss", ``BaseLoss._maybe_compile``), without autocast: unchunked
    (``memplan.model.head``) and as the inner loss of the ``ChunkedLossWrapper``
    (``loss_chunk_backward in-loss``, ``memplan.model.loss_in_call``), on whole logits or on
    logits split over the vocabulary (loss parallel). torchtune's ``compile_loss``
    compiles the chunked loss's ``compute_cross_entropy`` in place; another loss it wraps in a
    new ``torch.compile`` that the recipe does not keep (recipes/full_finetune_single_device.py),
    so that loss runs eagerly."""
    if wl.loss_impl is LossImpl.TORCHTUNE_CHUNKED:
        return None
    why = None
    if wl.loss_impl is not LossImpl.TORCHTITAN:
        why = f"loss_impl {wl.loss_impl.value}"
    elif wl.loss_checkpointed and wl.loss_chunk_backward is not ChunkBackward.IN_LOSS:
        why = (f"loss_chunks {wl.loss_chunks} and loss_chunk_backward "
               f"{wl.loss_chunk_backward.value}")
    elif wl.precision.policy.autocast:
        why = f"precision {wl.precision.value}"
    if why is None:
        return None
    return LayoutError(f"compile_loss is not modelled with {why}",
                       f"compile_loss with {why}: a compiled loss is modelled for torchtune's "
                       "chunked cross-entropy (loss_impl torchtune-chunked) and torchtitan's, "
                       "unchunked or in chunks run in the loss call (loss_chunk_backward "
                       "in-loss), without autocast")


def te_fp8_rule(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> LayoutError | None:
    """What Transformer Engine's fp8 linears are modelled for (``memplan.model.te_fp8``):
    dense decoder layers of attention and MLP projections with 16-bit weights, as Megatron-LM
    builds them with TE's modules. Refused: MoE experts (TE's grouped GEMMs), multi-latent
    attention and multi-token prediction layers (modules memplan's blocks do not declare as
    TE's), torchao float8 or compile beside it, LoRA, fp32 or fp16 weights, and fp8
    parameters under ZeRO-3 (sharded fp8 weights)."""
    why = None
    if spec.moe is not None:
        why = "MoE layers"
    elif spec.mla is not None:
        why = "multi-latent attention"
    elif wl.mtp_layers:
        why = f"mtp_layers {wl.mtp_layers}"
    elif wl.float8.value != "none" or wl.compile:
        why = "float8" if wl.float8.value != "none" else "compile"
    elif wl.lora_rank:
        why = f"lora_rank {wl.lora_rank}"
    elif wl.compute_dtype.itemsize != 2 or wl.precision.policy.autocast is not None:
        why = f"precision {wl.precision.value}"
    elif wl.te_fp8_param_gather and par.zero >= ZeroStage.PARAMETERS:
        why = f"te_fp8_param_gather and zero {int(par.zero)}"
    if why is None:
        return None
    return LayoutError(f"te_fp8 is not modelled with {why}",
                       f"te_fp8 {wl.te_fp8.value} with {why}: not modelled yet (Transformer "
                       "Engine fp8 is modelled for dense attention and MLP layers with bf16 "
                       "weights, no LoRA)")


def optimizer_in_backward_rule(par: ParallelConfig, wl: Workload) -> LayoutError | None:
    """What the optimizer stepped in backward is modelled for (``memplan.model.
    step_in_backward``): one device, no pipeline, no weights or states on the host, no LoRA,
    optimizers whose states are per element or per tensor, no master copy or grad scaler
    (gradient accumulation, which torchtune refuses, is the batch split's: ``memplan.model.
    estimate``)."""
    policy = wl.precision.policy
    why = None
    if par.dp > 1 or par.zero:
        why = f"dp {par.dp} (zero {int(par.zero)})"
    elif par.pp > 1:
        why = f"pp {par.pp}"
    elif par.offload - {Offload.ACTIVATIONS}:  # saved activations on the host: orthogonal
        why = "offload " + ",".join(sorted(o.value for o in par.offload))
    elif wl.lora_rank:
        why = f"lora_rank {wl.lora_rank}"
    elif wl.optimizer.value in ("adafactor", "muon"):
        why = f"optimizer {wl.optimizer.value}"
    elif policy.master_bytes or policy.grad_scaler:
        why = f"precision {wl.precision.value}"
    if why is None:
        return None
    return LayoutError(f"optimizer_in_backward is not modelled with {why}",
                       f"optimizer_in_backward with {why}: not modelled (it is modelled on one "
                       "device, no pipeline, no host offload of weights or states, no LoRA, "
                       "per-element or per-tensor optimizer states, no master copy or grad "
                       "scaler)")


def _compile_autocast_refusal(spec: ModelSpec, wl: Workload) -> str | None:
    """Why a compiled layer under autocast (fp32 weights, ``amp-*``) is not modelled, or
    None: traced (``memplan.model.compiled``: ``norm_input_e``, ``autocast_end_bytes``,
    ``autocast_checkpointed_forward_bytes``; tests/traced/test_compile_trace.py) on
    transformers' ``LlamaDecoderLayer`` under CPU autocast to bf16 and fp16 (accelerate's
    ``torch.autocast`` around the compiled forward): RMSNorm, RoPE, separate q/k/v without
    biases, SDPA, SwiGLU with separate gate and up projections, recompute none or full (the
    checkpoint inside the compiled graph), no adapters, no float8, one TP and CP rank
    (``validate``); and torchtitan 0.3.0's Llama3 block (fp32 weights, its complex RoPE,
    wqkv fused or not) under CPU autocast to bf16, compiled whole with the checkpoint inside
    (models/llama3/parallelize.py: AC applied, then ``apply_compile``), at 2 x 256 and
    2 x 1,024 tokens: recompute none with separate q/k/v, and full with either, saved set and
    backward peak exact, forward peak 5,056 B under (the CPU generator's state); and
    torchtitan's per-op SAC with wqkv fused or not (``compiled.autocast_sac_deferred``),
    exact. torchtitan's fused wqkv without recompute is refused: traced, not modelled (its
    backward peaks at the attention's backward at 2 x 256). Other transformers layers traced
    the same way (benchmarks/compiled_backward.py's "hf:" cases under ``amp-bf16``, 2 x 256
    tokens, tests/traced/test_compile_trace.py), forward and backward peaks exact: Qwen2.5's
    (q/k/v biases), Qwen3's (per-head q/k RMSNorms before the transpose), Gemma's (GeGLU),
    Mistral's (a sliding window longer than the sequence: no mask), Phi-3's (fused qkv
    and fused gate/up, real RoPE: ``compiled.autocast_checkpointed_forward_bytes``, the
    rebuilt SwiGLU kernels of ``compiled.swiglu_backward``) and Phi-4-mini's (the same, RoPE
    on 3/4 of each head), recompute none or full, Phi-3's also at 2 x 1,024, and Granite's
    (scaled residual branches: ``compiled.scaled_residual_grad``). Command R's RoPE layer
    (parallel block, Cohere's LayerNorm, RoPE in the input's dtype: ``compiled_order.
    with_parallel_attention_first``, ``layer._first_output_grad``) traced: its peak 1.2% over
    without recompute, 5,056 B under with full (the CPU generator's state); its layers
    without RoPE are not traced: refused."""
    odd = [(spec.norm.value != "rmsnorm" and not spec.norm_centres_twice,
            "a LayerNorm other than Cohere's"),
           (spec.nope_layer_interval > 0, "layers without RoPE (NoPE)"),
           (spec.position.value != "rope" or spec.rope_complex
            or spec.rope_interleaved or spec.rope_half_tables,
            "a position encoding other than transformers' full fp32 RoPE"),
           (spec.attn_out_bias or spec.mlp_bias or spec.norm_bias,
            "biases other than the q/k/v projections'"),
           # torchtitan's fused wqkv at 2 x 256 without recompute: the backward peaks at
           # the q RoPE's complex multiply, its fp32 input gradient and output beside the
           # k and v gradients the fused projection's grad-input matmul waits for (traced
           # 7,313,408 B against separate q/k/v's 7,032,832 B at the MLP), not modelled;
           # transformers' fused qkv (Phi-3's, real RoPE) is exact there
           (wl.fused_qkv and wl.recompute is Recompute.NONE,
            "torchtitan's fused wqkv without recompute"),
           (spec.qk_norm.value not in ("none", "head")
            or (spec.qk_norm.value == "head" and not spec.qk_norm_token_major
                and spec.norm_placement.value != "sandwich"),
            "q/k norms other than per-head norms before the transpose (Qwen3's) or in a "
            "sandwich layer (Gemma 3's)"),
           (spec.mla is not None, "MLA"),
           # transformers skips SDPA's mask below the window (masking_utils.py
           # ``_ignore_causal_mask_sdpa``); traced there only
           (spec.sliding_window is not None and wl.seq_len >= spec.sliding_window,
            "sliding-window attention over a sequence as long as the window"),
           (spec.dropout > 0, "dropout"),
           (spec.mlp.value not in ("swiglu", "geglu")
            or spec.activation_impl.value != "kernel",
            "an MLP other than SwiGLU or GeGLU"),
           (spec.fused_gate_up and wl.recompute is Recompute.SELECTIVE,
            "fused gate and up projections with selective recompute"),
           (wl.recompute is Recompute.FULL and wl.compile_in_checkpoint,
            "the activation checkpoint around the compiled layer (compile_in_checkpoint)"),
           (bool(wl.lora_rank), "LoRA adapters"),
           (wl.float8.value != "none" or wl.te_fp8.value != "none", "float8 linears")]
    why = next((w for bad, w in odd if bad), None)
    return None if why is None else f"precision {wl.precision.value} and {why}"


def _compile_post_norm_refusal(spec: ModelSpec, wl: Workload) -> str | None:
    """Why a compiled layer with norms after its mixers is not modelled, or None: traced
    (``memplan.model.compiled``: ``post_norm_backward_bytes``, ``with_post_norm_schedule``,
    ``rerun_whole_mlp``, ``qk_norm_stats_bytes``, ``norm_input_e``,
    ``sandwich_rerun_norm_bytes``, ``sandwich_sum_stats_bytes``; tests/traced/
    test_compile_trace.py, benchmarks/compiled_backward.py) in one compute dtype, one TP
    and CP rank (``validate``), no adapters, no float8, on transformers'
    ``Olmo2DecoderLayer`` (post norms, full-width q/k norms, SwiGLU), recompute none or full
    with the checkpoint inside the compiled graph (transformers' gradient checkpointing
    under the Trainer's ``torch_compile``), and ``Gemma2DecoderLayer`` (sandwich norms,
    Gemma's ``1 + weight``, no q/k norms, GeGLU with ``gelu_pytorch_tanh``), recompute none
    or full with the checkpoint inside the graph (its rerun keeps the pre-feedforward norm's
    fp32 normalised input; traced with Inductor's GPU realization rules, which drop the CPU
    rerun's fp32 GELU ``tanh``), a sandwich layer with SwiGLU under full recompute refused
    (untraced): RMSNorm,
    RoPE, separate q/k/v without biases, SDPA, separate gate and up. A sliding window as
    long as the sequence or shorter is refused: transformers skips SDPA's mask only below it
    (masking_utils.py ``_ignore_causal_mask_sdpa``: ``kv_length < local_attention_size``),
    and the layers were traced without a mask. Gemma 3's layer (sandwich norms, q/k norms
    per head on the transposed q and k) traced the same way, recompute none and full: exact
    (tests/traced/test_compile_trace.py ``test_compiled_sandwich_qk_norm_layer``). GLM-4 (a
    fused gate/up projection) is not traced. Under autocast (fp32 weights, bf16 compute)
    Gemma 2's and Gemma 3's sandwich layers, recompute none and full, traced exact but the
    CPU generator's state (``compiled.norm_input_e``, ``with_post_norm_schedule``,
    ``swiglu_moments``, ``autocast_checkpointed_forward_bytes``; tests/traced/
    test_compile_trace.py ``test_compiled_autocast_sandwich_layers``); OLMo 2's post-norm
    layer refused (traced: its forward 15% over, its backward 2.2% and 3.2% under). The
    checkpoint around the compiled layer (``compile_in_checkpoint``: transformers' gradient
    checkpointing around ``layer.compile``, torchtune's compile after its activation
    checkpointing), bf16: OLMo 2's, Gemma 2's and Gemma 3's whole steps traced within 0.02%
    at 2 x 384 tokens (tests/traced/test_frameworks.py; OLMo 2's with its fp32 RoPE tables,
    which the checkpoint keeps: ``ModelSpec.rope_tables_fp32``)."""
    sandwich = spec.norm_placement.value == "sandwich"
    qk = ("none", "head") if sandwich else ("full",)
    odd = [(spec.moe is not None, "post norms around MoE blocks"),
           (spec.norm.value != "rmsnorm", "post LayerNorms"),
           (spec.qk_norm.value not in qk or spec.qk_norm_token_major,
            f"{spec.norm_placement.value} norms and q/k norms {spec.qk_norm.value}"
            f"{' before the transpose' if spec.qk_norm_token_major else ''} "
            f"(traced: {', '.join(qk)}{'' if len(qk) == 1 else ' on the transposed q, k'})"),
           (sandwich and wl.recompute is Recompute.FULL and spec.mlp.value != "geglu",
            "sandwich norms, recompute full and an MLP other than GeGLU"),
           (spec.position.value != "rope" or spec.rope_complex or spec.rope_interleaved
            or spec.rotary_dim is not None or spec.nope_layer_interval > 0,
            "post norms and a position encoding other than transformers' full RoPE"),
           (spec.qkv_bias or spec.attn_out_bias or spec.mlp_bias or spec.norm_bias,
            "post norms and biases"),
           (spec.fused_qkv or wl.fused_qkv, "post norms and a fused qkv projection"),
           (spec.sliding_window is not None and wl.seq_len >= spec.sliding_window,
            "post norms and sliding-window attention over a sequence as long as the window"),
           (spec.parallel_block or spec.scaled_residual or spec.dropout > 0,
            "post norms and a parallel, scaled or dropout layer"),
           (spec.mlp.value not in ("swiglu", "geglu") or spec.fused_gate_up
            or spec.activation_impl.value != "kernel"
            or (spec.mlp.value == "geglu" and wl.recompute is Recompute.FULL
                and not sandwich),
            "post norms and an MLP other than SwiGLU or GeGLU (rebuilt: with sandwich norms) "
            "with separate "
            "gate and up projections"),
           (wl.precision.policy.autocast and not sandwich,
            f"post norms and precision {wl.precision.value}"),
           (wl.recompute is Recompute.SELECTIVE, "post norms and recompute selective"),
           (bool(wl.lora_rank), "post norms and LoRA adapters"),
           (wl.float8.value != "none" or wl.te_fp8.value != "none",
            "post norms and float8 linears")]
    return next((w for bad, w in odd if bad), None)


def _titan_moe_rule(spec: ModelSpec, wl: Workload) -> None:
    """torchtitan's MoE block (``moe_impl titan``, ``memplan.model.moe_titan``): what it
    cannot run of the spec's MoE (``titan_moe_refusal``), and op-level checkpointing or a
    selective AC other than torchtitan's per-op SAC over it (``moe_titan.sac_terms`` models
    the latter alone)."""
    why = presets.titan_moe_refusal(spec)
    if why is None and (wl.recompute is Recompute.OPS or (
            wl.recompute is Recompute.SELECTIVE and wl.selective_impl.value != "op")):
        why = (f"moe_impl titan with recompute {wl.recompute.value} (torchtitan's MoE "
               "block is modelled under recompute none, full and torchtitan's per-op SAC)")
    if why is not None:
        raise LayoutError("moe_impl titan runs torchtitan's MoE block", why)


def _compile_titan_moe_refusal(spec: ModelSpec, wl: Workload) -> str | None:
    """Why torchtitan's compiled MoE block (``moe_impl titan``: ``memplan.model.compiled.
    titan_moe_terms``) is not modelled, or None: traced in bf16 (FSDP2's bf16 parameters),
    routed experts alone and with a shared expert, without recompute or inside full AC.
    Under full AC the backward is traced exact (``moe_titan_compiled.full_ac_backward``);
    the forward inside the checkpoint is counted as the block's no-recompute working set,
    over the traced forward peak (+73% to +88% with a shared expert, +125% to +145% routed
    alone, 2 x 64 to 2 x 256 tokens: tests/traced/test_compile_trace.py
    ``test_compiled_titan_moe_block_under_full_ac``), which the output says
    (``memplan.model.estimate.TITAN_MOE_FULL_AC_LINE``). That count is below memplan's
    backward moments, which hold the same rebuilt set and the gradients, so a step's peak
    stays the backward's."""
    assert spec.moe is not None
    if wl.compute_dtype.value != "bf16" or wl.precision.policy.autocast:
        return (f"MoE layers under moe_impl titan in {wl.precision.value} (traced compiled in "
                "bf16: the experts' bf16 casts of fp32 weights are not)")
    if wl.recompute is Recompute.SELECTIVE:
        return "MoE layers under moe_impl titan and recompute selective"
    return None


def _compile_moe_refusal(spec: ModelSpec, wl: Workload) -> str | None:
    """Why a compiled MoE layer is not modelled, or None: transformers' grouped experts
    (``memplan.model.compiled.moe_terms``), traced on Qwen3-MoE's and Mixtral's layers in
    bf16, routed experts alone behind a softmax router in the block's dtype (5.23's Qwen3-MoE
    router casting its top-k weights to it: moe_impl grouped)."""
    moe = spec.moe
    assert moe is not None
    if wl.moe_impl is MoeImpl.TITAN:
        return _compile_titan_moe_refusal(spec, wl)
    if wl.framework is Framework.TORCHTITAN or not wl.moe_impl.grouped:
        return (f"MoE layers under {wl.framework.value}, moe_impl {wl.moe_impl.value} "
                "(traced: transformers' grouped experts)")
    if wl.compute_dtype.value != "bf16":
        # integrations/moe.py _can_use_grouped_mm: compiled, a weight not in bf16 takes the
        # grouped_mm_fallback custom op, whose backward loops over the offsets' values
        # (``if start == end``): Inductor fails on that data-dependent guard (traced, fp32,
        # torch 2.13, transformers 5.3)
        return (f"MoE layers in {wl.precision.value} (transformers' grouped experts compile "
                "in bf16 only: their fallback's backward does not)")
    if wl.recompute is Recompute.SELECTIVE:
        return "MoE layers and recompute selective"
    if moe.num_shared_experts:
        return "MoE layers with shared experts"
    if moe.router_fp32 or moe.router_topk_softmax:
        return "MoE layers whose router is not a softmax over every expert in the block's dtype"
    if moe.router_weights_cast and wl.moe_impl is MoeImpl.GROUPED_TOKEN:
        # traced with the cast on 5.23's experts alone (Qwen3-MoE's router): there the sorted
        # weights are recomputed, where 5.3's grouped-token experts save them
        return ("MoE layers whose router casts its top-k weights, moe_impl grouped-token "
                "(traced: moe_impl grouped)")
    if moe.clamped_swiglu:
        return "MoE layers with the clamped SwiGLU experts"
    return None


def _compiled_mlp_lora_traced(spec: ModelSpec, wl: Workload) -> bool:
    """LoRA on a compiled MLP inside the activation checkpoint as traced
    (``memplan.model.compiled.lora_mlp_backward``): a gated MLP, gate and up apart, every
    one of its projections adapted, no adapter dropout."""
    targets = set(wl.lora_targets or ())
    return (spec.mlp.gated and not spec.fused_gate_up and wl.lora_dropout == 0
            and (ALL_LINEAR in targets or {"gate", "up", "down"} <= targets))


def compile_rule(spec: ModelSpec, wl: Workload) -> LayoutError | None:
    """What a compiled layer's saved set is derived for (``memplan.model.compiled``): a
    pre-norm layer (dense, or MoE with transformers' grouped experts in bf16:
    ``_compile_moe_refusal``) with SDPA attention in one compute dtype, OLMo 2's post-norm
    layer or Gemma 2's and Gemma 3's sandwich-norm layers (``_compile_post_norm_refusal``),
    or under autocast the dense layers ``_compile_autocast_refusal`` lists, no recompute or a fully
    checkpointed layer, or torchtitan's per-op SAC. The rest is not modelled yet: a
    refusal, not an eager estimate."""
    why = None
    if spec.moe is not None:
        why = _compile_moe_refusal(spec, wl)
    if why is not None:
        pass
    elif (spec.norm_placement.value != "pre"
          and (why := _compile_post_norm_refusal(spec, wl)) is not None):
        pass
    elif wl.attention.value != "flash":
        why = f"attention {wl.attention.value}"
    elif wl.precision.policy.autocast and (why := _compile_autocast_refusal(spec, wl)):
        pass
    elif wl.lora_rank and wl.base_quant.value not in ("none", "nf4-torchao-0.1",
                                                      "nf4-torchao"):
        # torchao's NF4Tensor is traced (memplan.model.linear.compiled_dequant_terms);
        # bitsandbytes' Linear4bit / Linear8bitLt under Dynamo are not
        why = f"base_quant {wl.base_quant.value} (bitsandbytes' quantized linears)"
    elif wl.lora_rank and wl.recompute is Recompute.FULL and not wl.compile_in_checkpoint:
        why = f"lora_rank {wl.lora_rank} and the checkpoint inside the compiled graph"
    elif (wl.lora_rank and wl.recompute is Recompute.FULL
          and set(wl.lora_targets or ()) & {"gate", "up", "down", "gate_up", ALL_LINEAR}
          and not _compiled_mlp_lora_traced(spec, wl)):
        # inside the checkpoint the compiled forward's own buffers peak in an adapted MLP
        # (memplan.model.compiled.lora_mlp_forward), traced for a gated MLP with gate and
        # up apart, all three adapted, no adapter dropout
        why = ("LoRA on the MLP inside the activation checkpoint other than on all of a "
               "gated MLP's gate, up and down projections without adapter dropout")
    elif wl.recompute is Recompute.SELECTIVE and wl.selective_impl.value != "op":
        why = f"recompute selective ({wl.selective_impl.value})"
    elif spec.activation_impl.value == "xielu":  # its formula's saved set is eager's only
        why = "the xIELU activation"
    elif spec.short_conv is not None:  # (memplan.model.short_conv: eager's saved set)
        why = "short-convolution layers"
    elif spec.mamba is not None:  # (memplan.model.mamba: eager's saved set)
        why = "Mamba layers"
    if why is None:
        return None
    return LayoutError(f"compile is not modelled with {why}",
                       f"compile with {why}: what the partitioner saves there is not "
                       "modelled yet (compile is modelled for pre-norm layers, dense or "
                       "with transformers' bf16 grouped experts, SDPA attention; OLMo 2's "
                       "post-norm layer in one dtype, recompute none or full, Gemma 2's "
                       "and Gemma 3's sandwich-norm layers, recompute none or full; under "
                       "autocast a dense pre-norm layer (RMSNorm, RoPE, q/k/v biases or "
                       "none, Qwen3's q/k norms, scaled residuals, SwiGLU or GeGLU, fused "
                       "gate/up, transformers' fused qkv) or Gemma 2's and 3's sandwich "
                       "layers, without adapters or float8 on one TP rank, recompute none "
                       "or full, torchtitan's fused wqkv with full recompute or per-op SAC; "
                       "LoRA on unquantized or torchao NF4 base weights (with full "
                       "recompute: compile_in_checkpoint; on the MLP, all of a gated MLP's "
                       "gate, up and down, no adapter dropout), recompute none, full or "
                       "per-op SAC)")


def validate(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> None:
    """Raise ``LayoutError`` for a layout or workload the model cannot be split into or
    estimated with (the batch split aside: ``resolve_batch`` checks it)."""
    if (err := tp_rule(spec, par.tp)) is not None:
        raise err
    if par.etp is not None:  # the experts' groups carved from tp x dp x cp
        if (err := etp_rule(spec, par)) is not None:
            raise err
    elif spec.moe is not None:
        if (err := ep_rule(spec.moe.num_experts, par.ep, par.dp * par.cp)) is not None:
            raise err
    elif par.ep > 1:
        raise LayoutError("ep > 1 needs a mixture-of-experts model",
                          f"ep ({par.ep}) > 1 needs a mixture-of-experts model; {spec.name} "
                          "is dense")
    _validate_split(spec, par)
    _validate_shard_group(spec, par)
    if par.vpp > 1 and par.pp == 1:
        raise LayoutError("vpp > 1 needs pp > 1",
                          f"vpp ({par.vpp}) > 1 needs pp > 1 (interleaved pipeline)")
    if par.vpp_group is not None and par.vpp == 1:
        raise LayoutError("vpp_group needs vpp > 1",
                          f"vpp_group ({par.vpp_group}) groups the micro-batches of an "
                          "interleaved pipeline: it needs vpp > 1")
    if par.sequence_parallel:
        _require_divides("tp", par.tp, "seq/cp" if par.cp > 1 else "seq",
                         local_seq(wl.seq_len, par.cp))
    if wl.seq_len > spec.max_seq_len and spec.position is PositionKind.LEARNED:
        raise LayoutError(
            "seq exceeds the model's learned positions",
            f"seq ({wl.seq_len}) exceeds {spec.name}'s learned positions ({spec.max_seq_len})")
    if (err := cp_rule(wl.seq_len, par.cp)) is not None:
        raise err
    if wl.attention_global_buffer and (par.cp > 1 or wl.attention.value != "eager"):
        # megatron/core/transformer/dot_product_attention.py DotProductAttention.__init__
        # asserts context_parallel_size == 1; it always materialises the scores
        raise LayoutError(
            "attention_global_buffer needs cp 1 and attention eager",
            f"attention_global_buffer (Megatron's own core attention) with cp {par.cp} and "
            f"attention {wl.attention.value}: that attention materialises the scores "
            "(attention eager) and runs without context parallelism (cp 1)")
    if optimizer_on_host(par) and wl.optimizer.value not in ("adamw", "sgd"):
        raise LayoutError(f"offload optimizer does not combine with {wl.optimizer.value}",
                          f"offload optimizer runs its step on the host (CPU Adam); optimizer "
                          f"{wl.optimizer.value} runs on the GPU (choose one)")
    if wl.optimizer == "muon" and par.zero >= ZeroStage.OPTIMIZER:
        raise LayoutError("optimizer muon does not combine with ZeRO",
                          f"optimizer muon with zero {int(par.zero)}: torch.optim.Muon "
                          "orthogonalizes whole matrices; a sharded Muon step is not modelled")
    if wl.lora_rank and wl.optimizer.value in ("adafactor", "muon"):
        raise LayoutError(f"optimizer {wl.optimizer.value} does not combine with LoRA",
                          f"optimizer {wl.optimizer.value} with lora_rank {wl.lora_rank}: its "
                          "states follow each matrix's rows and columns, which memplan does "
                          "not track for the adapters (use adamw, sgd or the 8-bit ones)")
    if wl.lora_rank and set(wl.lora_targets or ()) & {"output", "lm_head"}:
        _validate_head_adapter(spec, wl)
    if (err := offload_rule(spec, par, wl)) is not None:
        raise err
    if wl.compile and (err := compile_rule(spec, wl)) is not None:
        raise err
    if wl.compile and spec.norm_placement.value != "pre" and (par.tp > 1 or par.cp > 1):
        # (``_compile_post_norm_refusal``: traced on one rank)
        raise LayoutError(
            "compile is not modelled with post norms and tp or cp > 1",
            f"compile with {spec.norm_placement.value} norms, tp {par.tp}, cp {par.cp}: what "
            "the partitioner saves with post norms is traced on one rank (tp 1, cp 1)")
    if wl.compile and wl.precision.policy.autocast and (par.tp > 1 or par.cp > 1):
        # (``_compile_autocast_refusal``: traced on one rank)
        raise LayoutError(
            f"compile is not modelled with precision {wl.precision.value} and tp or cp > 1",
            f"compile with precision {wl.precision.value}, tp {par.tp}, cp {par.cp}: what the "
            "partitioner saves under autocast is traced on one rank (tp 1, cp 1)")
    if wl.compile_loss and (err := compile_loss_rule(spec, par, wl)) is not None:
        raise err
    if wl.optimizer_in_backward and (err := optimizer_in_backward_rule(par, wl)) is not None:
        raise err
    if wl.float8 != "none" and (err := float8_rule(spec, par, wl)) is not None:
        raise err
    if wl.te_fp8 != "none" and (err := te_fp8_rule(spec, par, wl)) is not None:
        raise err
    if wl.te_fp8 == "none" and wl.te_fp8_param_gather:
        raise LayoutError("te_fp8_param_gather needs te_fp8",
                          "te_fp8_param_gather with te_fp8 none: fp8 parameters need an fp8 "
                          "recipe (Megatron-LM's --fp8-param-gather needs --fp8-format)")
    if wl.float8_all_gather and (err := float8_gather_rule(par, wl)) is not None:
        raise err
    if wl.async_tp and not wl.compile:
        # torchtitan parallelize_llama: "Async TP requires torch.compile" (the micro-pipelining
        # is an Inductor pass)
        raise LayoutError("async_tp needs compile",
                          "async_tp without compile: torchtitan's async tensor parallelism is "
                          "an Inductor pass and refuses to run eagerly")
    if wl.base_quant == "nf4-torchao-0.1" and par.zero >= ZeroStage.PARAMETERS:
        # torchao 0.1's NF4Tensor implements no chunk/split/view ops for FSDP to shard it
        # (added after 0.1: torchao commit ac53d7fb, "[FSDP2][NF4Tensor][2/n] implement
        # torch.chunk and other ops"); torchtune's sharded QLoRA came with them
        raise LayoutError("base_quant nf4-torchao-0.1 does not combine with zero 3",
                          f"base_quant nf4-torchao-0.1 with zero {int(par.zero)}: torchao "
                          "0.1's NF4Tensor cannot be sharded (nf4-torchao, torchao's since "
                          "0.3, describes a sharded QLoRA)")
    if (err := fsdp1_rule(spec, par, wl)) is not None:
        raise err
    if spec.moe is not None and wl.moe_impl is MoeImpl.TITAN:
        _titan_moe_rule(spec, wl)
    if spec.moe is not None and wl.precision.policy.autocast:
        raise LayoutError(
            f"precision {wl.precision.value} is not modelled for MoE layers",
            f"precision {wl.precision.value} with MoE layers ({spec.moe.num_experts} experts): "
            "what autocast saves around routing and the experts is not modelled yet (use "
            "bf16-pure, bf16-mixed or fp32)")
    # hf's Trainer and Lightning's Fabric never turn the sync off under DeepSpeed (trainer.py
    # _inner_training_loop; lightning_fabric/strategies/deepspeed.py: no backward sync
    # control): their "last" (the presets') is "every" there, which is what the model holds
    # for ZeRO-2 (memplan.model.grad_sync changes FSDP2 units only)
    if (wl.grad_sync is GradSync.LAST and par.zero == ZeroStage.GRADIENTS
            and par.dense_shard_degree > 1
            and wl.framework not in (Framework.HF, Framework.LIGHTNING)):
        raise LayoutError(
            "grad_sync last does not combine with ZeRO stage 2",
            "grad_sync last with zero 2: DeepSpeed reduces partitioned gradients in every "
            "micro-batch's backward, and its engine's no_sync() asserts that gradients are not "
            "partitioned (deepspeed/runtime/engine.py DeepSpeedEngine.no_sync); use zero 1, or "
            "zero 3 (FSDP2's set_requires_gradient_sync(False))")
    if wl.head_wgrad_deferral is not None and (par.pp == 1 or wl.loss_chunks > 1
                                               or par.zero >= ZeroStage.PARAMETERS):
        # megatron-core model_parallel_config.py ModelParallelConfig.__post_init__ raises
        # without pipeline parallelism; a chunked loss runs the head once per chunk; with
        # sharded parameters the drain's main gradient is not modelled
        raise LayoutError(
            "head_wgrad_deferral needs pp > 1, an unchunked loss and zero < 3",
            f"head_wgrad_deferral ({wl.head_wgrad_deferral}) needs pp > 1 (got {par.pp}: "
            "Megatron-core refuses to defer the output layer's weight gradient without "
            f"pipeline parallelism), loss_chunks 1 (got {wl.loss_chunks}) and zero < 3 (got "
            f"{int(par.zero)}: the drain into sharded parameters' gradients is not modelled)")
    if wl.logits_held is LogitsHeld.OUTPUT and (par.pp > 1 or wl.kv_cache and (
            wl.precision.policy.autocast or spec.mla is not None
            or wl.attention.value != "flash")):
        # the held output's key/value cache is modelled as what SDPA saved, one stage
        raise LayoutError(
            "logits_held output is modelled on one stage, its cache as SDPA saves it",
            f"logits_held output (the loop keeps the model's output and its key/value cache) "
            f"is modelled with pp 1 (got {par.pp}) and, with kv_cache, SDPA attention without "
            f"autocast or MLA (got precision {wl.precision.value}, attention "
            f"{wl.attention.value}): the cache's own copies are not modelled")
    if wl.loss_impl is LossImpl.TORCHTUNE_CHUNKED and (
            wl.precision.policy.autocast or wl.loss_chunk_backward is ChunkBackward.IN_LOSS
            or wl.logits_held in (LogitsHeld.STEP, LogitsHeld.OUTPUT) or wl.mtp_layers):
        # torchtune runs its models in one dtype, its recipe drops the logits after the loss
        raise LayoutError(
            "loss_impl torchtune-chunked runs without autocast, in-loss chunks, held logits "
            "or multi-token prediction",
            f"loss_impl torchtune-chunked (torchtune's chunked output) is modelled in one "
            f"dtype without autocast (got precision {wl.precision.value}), with its chunks' "
            "backward in the model's, no logits held by the loop and no multi-token "
            "prediction")
    _validate_recompute(spec, par, wl)
    presets.validate(par, wl)  # options the workload's framework does not offer


def _validate_recompute(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> None:
    if wl.recompute_every is not None:
        if wl.recompute is not Recompute.FULL:
            raise LayoutError("recompute_every applies only to recompute full",
                              f"recompute_every ({wl.recompute_every}) applies only to "
                              f"recompute full, got recompute {wl.recompute.label}")
        if wl.recompute_layers is not None:
            raise LayoutError("recompute_every and recompute_layers exclude each other",
                              f"recompute_every ({wl.recompute_every}) and recompute_layers "
                              f"({wl.recompute_layers}) choose the recomputed layers two ways: "
                              "give one")
    if wl.recompute_layers is None:
        return
    if wl.recompute is not Recompute.FULL:
        raise LayoutError("recompute_layers applies only to recompute full",
                          f"recompute_layers ({wl.recompute_layers}) applies only to recompute "
                          f"full, got recompute {wl.recompute.label}")
    per_stage = max(rank_layers(spec.num_layers, par))
    if wl.recompute_layers > per_stage:
        raise LayoutError("recompute_layers must be at most the layers per pipeline stage",
                          f"recompute_layers ({wl.recompute_layers}) must be at most the layers "
                          f"per pipeline stage ({per_stage})")


def _validate_split(spec: ModelSpec, par: ParallelConfig) -> None:
    split = par.stage_layers
    if split is None:
        _require_divides("pp*vpp", par.pp * par.vpp, "num_layers", spec.num_layers)
        return
    shown = ",".join(map(str, split))
    if len(split) != par.pp * par.vpp:
        what = f"pp*vpp ({par.pp}*{par.vpp})" if par.vpp > 1 else f"pp ({par.pp})"
        raise LayoutError("stage_layers needs one entry per virtual pipeline stage",
                          f"stage_layers ({shown}) has {len(split)} entries; {what} = "
                          f"{par.pp * par.vpp} virtual stages need one each")
    if min(split) < 0:
        stage = split.index(min(split))
        raise LayoutError("stage_layers entries must not be negative",
                          f"stage_layers ({shown}): stage {stage} has {split[stage]} layers; "
                          "layer counts must not be negative")
    # A virtual stage without a decoder layer is the first holding only the embedding or the
    # last holding only the head (Llama 3 405B: Dubey et al. 2024, section 3.3.2; Megatron-LM
    # --account-for-embedding/loss-in-pipeline-split); every pipeline rank needs a layer.
    empty = [i for i, n in enumerate(split)
             if n == 0 and (par.vpp == 1 or i not in (0, len(split) - 1))]
    if empty:
        what = "pipeline stage" if par.vpp == 1 else "virtual stage"
        raise LayoutError("stage_layers entries must be at least 1",
                          f"stage_layers ({shown}): {what} {empty[0]} has 0 layers; only the "
                          "first and the last virtual stage (--vpp > 1) may hold none")
    if sum(split) != spec.num_layers:
        raise LayoutError("stage_layers must sum to num_layers",
                          f"stage_layers ({shown}) sum to {sum(split)}, but {spec.name} has "
                          f"{spec.num_layers} layers")


def _validate_shard_group(spec: ModelSpec, par: ParallelConfig) -> None:
    if par.dp_shard is None:
        return
    if par.dp % par.dp_shard:
        raise LayoutError("dp_shard must divide dp",
                          f"dp_shard ({par.dp_shard}) must divide dp ({par.dp}): dp = "
                          "replicas x dp_shard")
    if par.zero == ZeroStage.NONE and par.dp_shard < par.dp:
        raise LayoutError("dp_shard needs ZeRO stage 1, 2 or 3",
                          f"dp_shard ({par.dp_shard}) shards states within groups of the data-"
                          "parallel ranks; with zero 0 nothing is sharded (use --zero 1-3)")
    if par.expert_data_parallel % par.replicas:
        # Megatron-LM asserts the same (parallel_state.py initialize_model_parallel: "Expert
        # data parallel size should be divisible by partial DistOpt shard factor")
        raise LayoutError("the replicas must divide the expert-data-parallel group",
                          f"dp / dp_shard ({par.replicas} replicas) must divide the expert-"
                          f"data-parallel group ({par.expert_data_parallel} ranks: "
                          + ("dp*cp/ep" if par.etp is None else "tp*dp*cp/(ep*etp)")
                          + "), over which the expert states are sharded")


def resolve_split(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> ParallelConfig:
    """``par`` with the framework's default pipeline split filled in where it is uneven
    (``Workload.pipeline_split``); an even split stays ``stage_layers=None``. A given
    ``stage_layers`` is kept as it is (``validate`` checks it)."""
    if par.pp == 1 or par.stage_layers is not None:
        return par
    parts = par.pp * par.vpp
    if wl.pipeline_split is PipelineSplit.WEIGHTED:
        counts = weighted_split(spec.num_layers, parts)
        if not counts:
            raise LayoutError(
                "pipeline split leaves a stage without a layer",
                f"{wl.framework.value}'s split of {spec.num_layers} layers with the embedding "
                f"and the head counted as one layer each over {parts} virtual stages leaves a "
                "stage without a decoder layer (give --stage-layers)")
        return par if len(set(counts)) == 1 else par.model_copy(update={"stage_layers": counts})
    if spec.num_layers % parts:
        who = ("Megatron-LM asserts it (transformer_block.py get_num_layers_to_build); give "
               "its split as --stage-layers (--decoder-first/last-pipeline-num-layers or "
               "--pipeline-model-parallel-layout)" if wl.framework.value == "megatron" else
               "give the split with --stage-layers")
        raise LayoutError("pp*vpp must divide num_layers",
                          f"pp*vpp ({parts}) must divide num_layers ({spec.num_layers}) for "
                          f"an even split; {who}")
    return par


def resolve_batch(par: ParallelConfig, wl: Workload) -> tuple[int, int]:
    """(global batch, micro-batches per step). The default global batch fills the pipeline:
    mbs * dp * pp, i.e. m = p micro-batches."""
    per_step = wl.micro_batch_size * par.dp
    gbs = wl.global_batch_size or per_step * par.pp
    if gbs % per_step:
        raise LayoutError(
            "gbs must be divisible by mbs*dp",
            f"gbs ({gbs}) must be divisible by mbs*dp ({wl.micro_batch_size}*{par.dp} = "
            f"{per_step})")
    m = gbs // per_step
    rule = interleaved_rule(par, m)
    if rule == INTERLEAVED_MICROBATCHES:
        raise LayoutError(
            rule,
            f"interleaved pipeline needs micro-batches per step ({m}) divisible by pp ({par.pp})")
    if rule is not None:
        group = par.vpp_group
        raise LayoutError(
            rule,
            f"interleaved pipeline with groups of {group} micro-batches needs pp ({par.pp}) <= "
            f"{group} <= micro-batches per step ({m}), the last group empty or at least pp")
    return gbs, m


def interleaved_rule(par: ParallelConfig, m: int) -> str | None:
    """The rule ``m`` micro-batches per step break under ``par``'s interleaved schedule, or
    None (see ``INTERLEAVED_GROUPS``)."""
    if par.vpp == 1:
        return None
    group = par.vpp_group or par.pp
    if group == par.pp:
        return INTERLEAVED_MICROBATCHES if m % par.pp else None
    if not par.pp <= group <= m or 0 < m % group < par.pp:
        return INTERLEAVED_GROUPS
    return None


# The rules an interleaved schedule puts on the batch split: micro-batches run in groups of
# microbatch_group_size_per_vp_stage (default pp), between pp and m, the last group empty or
# at least pp (Megatron-LM's forward_backward_pipelining_with_interleaving raises otherwise;
# with the default group: m divisible by pp).
INTERLEAVED_MICROBATCHES = "interleaved pipeline needs micro-batches per step divisible by pp"
INTERLEAVED_GROUPS = ("interleaved pipeline needs micro-batch groups between pp and the "
                      "micro-batches per step, the last empty or at least pp")


def gbs_rule(gbs: int, dp: int) -> LayoutError | None:
    """dp must divide the global batch (``replica_batch``), as the error or None."""
    if gbs % dp:
        return LayoutError("gbs must be divisible by dp",
                           f"gbs ({gbs}) must be divisible by dp ({dp})")
    return None


def replica_batch(par: ParallelConfig, gbs: int) -> int:
    """Samples per data-parallel replica per step: ``gbs / dp``."""
    if (err := gbs_rule(gbs, par.dp)) is not None:
        raise err
    return gbs // par.dp


def _require_divides(name: str, value: int, target_name: str, target: int) -> None:
    if target % value:
        raise _divides_error(name, value, target_name, target)


def _divides_error(name: str, value: int, target_name: str, target: int) -> LayoutError:
    return LayoutError(f"{name} must divide {target_name}",
                       f"{name} ({value}) must divide {target_name} ({target})")


def _validate_head_adapter(spec: ModelSpec, wl: Workload) -> None:
    """LoRA on the output projection (``--lora-targets output``) is modelled on an untied
    head over an unquantized base: a tied head's adapter would sit on the embedding's shared
    weight, and what torchtune's ``quantize_base`` output projection dequantizes is not
    modelled."""
    if spec.tied_embeddings:
        raise LayoutError("lora target output needs an untied head",
                          f"lora_targets output on {spec.name}: its head is tied to the "
                          "embedding, which memplan does not model an adapter on")
    if wl.base_quant.value != "none":
        raise LayoutError("lora target output does not combine with base_quant",
                          f"lora_targets output with base_quant {wl.base_quant.value}: a "
                          "quantized output projection is not modelled")
