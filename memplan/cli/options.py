"""Options shared by several commands, declared once as ``Annotated`` aliases."""

from __future__ import annotations

import enum
from typing import Annotated, Optional

import typer

from memplan.parallel import GradBuffers, Offload, TpStyle
from memplan.model.pipeline import Schedule
from memplan.workload import Attention, NormImpl, Optimizer, OptimizerImpl, Precision


class RecomputeChoice(str, enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class ZeroChoice(str, enum.Enum):
    Z0 = "0"
    Z1 = "1"
    Z2 = "2"
    Z3 = "3"


_LAYOUT = "Layout"
_WORKLOAD = "Workload"
_KERNELS = "Implementation"

Model = Annotated[str, typer.Option("--model", "-m", help="Catalog name (`memplan models`), a "
                                    "model TOML, or a Hugging Face config.json (or its folder).")]
Gpus = Annotated[int, typer.Option("--gpus", "-n", help="Total GPUs in the job.")]
Gpu = Annotated[str, typer.Option("--gpu", help="GPU name or alias (`memplan gpus`).")]
GpuMemory = Annotated[Optional[str], typer.Option(
    "--gpu-memory", help="Override capacity: 80GiB (2^30) or 80GB (10^9).")]
Tp = Annotated[int, typer.Option("--tp", help="Tensor-parallel degree.", rich_help_panel=_LAYOUT)]
Pp = Annotated[int, typer.Option("--pp", help="Pipeline-parallel degree.", rich_help_panel=_LAYOUT)]
Vpp = Annotated[int, typer.Option("--vpp", help="Model chunks per pipeline rank (interleaved).",
                                  rich_help_panel=_LAYOUT)]
Dp = Annotated[Optional[int], typer.Option(
    "--dp", help="Data-parallel degree (default: gpus / (tp*pp*cp)).", rich_help_panel=_LAYOUT)]
Cp = Annotated[int, typer.Option("--cp", help="Context-parallel degree.", rich_help_panel=_LAYOUT)]
Ep = Annotated[int, typer.Option("--ep", help="Expert-parallel degree (MoE).",
                                 rich_help_panel=_LAYOUT)]
Sp = Annotated[Optional[bool], typer.Option(
    "--sp/--no-sp", help="Sequence parallelism (default: on when tp > 1).",
    rich_help_panel=_LAYOUT)]
VocabParallel = Annotated[bool, typer.Option(
    "--vocab-parallel/--no-vocab-parallel",
    help="Embedding, head and loss split over the vocabulary by TP (Megatron-LM, torchtitan "
    "with loss_parallel), or replicated.", rich_help_panel=_LAYOUT)]
TpStyleOpt = Annotated[TpStyle, typer.Option(
    "--tp-style", help="With SP, what column-parallel linears save: megatron (sequence "
    "shard) or dtensor (gathered full sequence).", rich_help_panel=_LAYOUT)]
GradBuffersOpt = Annotated[GradBuffers, typer.Option(
    "--grad-buffers", help="ZeRO 0/1 data parallel: gradients as views of persistent buffers "
    "(Megatron-LM) or DDP's default copy into buckets.", rich_help_panel=_LAYOUT)]
OffloadOpt = Annotated[Offload, typer.Option(
    "--offload", help="optimizer: fp32 master weights, states and the step in host memory "
    "(ZeRO-Offload; needs --zero 1-3).", rich_help_panel=_LAYOUT)]
Zero = Annotated[ZeroChoice, typer.Option(
    "--zero", help="ZeRO stage: 1 optimizer states, 2 + gradients, 3 (FSDP) + parameters.",
    rich_help_panel=_LAYOUT)]
Mbs = Annotated[int, typer.Option("--mbs", help="Micro-batch size (sequences).",
                                  rich_help_panel=_WORKLOAD)]
Gbs = Annotated[Optional[int], typer.Option(
    "--gbs", help="Global batch size (default: mbs*dp*pp, filling the pipeline).",
    rich_help_panel=_WORKLOAD)]
Seq = Annotated[Optional[int], typer.Option(
    "--seq", help="Sequence length (default: 4096, capped at the model's maximum).",
    rich_help_panel=_WORKLOAD)]
RecomputeOpt = Annotated[RecomputeChoice, typer.Option(
    "--recompute", help="none; selective (attention core); full (layer inputs only).",
    rich_help_panel=_WORKLOAD)]
RecomputeLayers = Annotated[Optional[int], typer.Option(
    "--recompute-layers", help="With --recompute full: recompute only this many layers per stage.",
    rich_help_panel=_WORKLOAD)]
PrecisionOpt = Annotated[Precision, typer.Option(
    "--precision", help="Precision recipe (weights / grads / master copy).",
    rich_help_panel=_WORKLOAD)]
OptimizerOpt = Annotated[Optimizer, typer.Option("--optimizer", rich_help_panel=_WORKLOAD)]
OptimizerImplOpt = Annotated[OptimizerImpl, typer.Option(
    "--optimizer-impl", help="torch.optim implementation: step temporaries differ.",
    rich_help_panel=_KERNELS)]
AttentionOpt = Annotated[Attention, typer.Option(
    "--attention", help="flash (no score matrix) or eager (saves the s^2 softmax).",
    rich_help_panel=_KERNELS)]
NormOpt = Annotated[NormImpl, typer.Option(
    "--norm", help="upcast (HF-style fp32 norm) or fused kernel.", rich_help_panel=_KERNELS)]
LogitsFp32 = Annotated[bool, typer.Option(
    "--logits-fp32/--no-logits-fp32", help="Loss on fp32 logits.", rich_help_panel=_KERNELS)]
LossChunks = Annotated[int, typer.Option(
    "--loss-chunks", help="Run the head and cross-entropy on N chunks of the tokens, each "
    "checkpointed (1: all tokens at once).", rich_help_panel=_KERNELS)]
ScheduleOpt = Annotated[Schedule, typer.Option(
    "--schedule", help="Pipeline schedule (1f1b is interleaved when --vpp > 1).",
    rich_help_panel=_KERNELS)]
Json = Annotated[bool, typer.Option("--json", help="Machine output: one JSON object, int bytes.")]
Calibration = Annotated[Optional[list[str]], typer.Option(
    "--calibration", help="A profile from `memplan calibrate` (JSON file), a folder to search "
    "for the GPU's profile, or `auto` for the committed one; its correction is its own line. "
    "Give it twice for a device and a model profile.")]


def workload_fields(*, mbs: int, gbs: int | None, seq: int | None, recompute: RecomputeChoice,
                    recompute_layers: int | None, precision: Precision, optimizer: Optimizer,
                    optimizer_impl: OptimizerImpl, attention: Attention, norm: NormImpl,
                    logits_fp32: bool, loss_chunks: int = 1) -> dict[str, object]:
    """The ``Workload`` fields of the options every command shares."""
    return dict(micro_batch_size=mbs, global_batch_size=gbs, seq_len=seq,
                recompute=recompute.value, recompute_layers=recompute_layers,
                precision=precision, optimizer=optimizer, optimizer_impl=optimizer_impl,
                attention=attention, norm_impl=norm, logits_fp32=logits_fp32,
                loss_chunks=loss_chunks)
