"""``memplan estimate``: per-GPU memory of one configuration."""

from __future__ import annotations

import json

import typer

from memplan.api import estimate as run_estimate
from memplan.cli import _app as app
from memplan.cli.options import (
    AttentionOpt,
    Calibration,
    Cp,
    Dp,
    Ep,
    Gbs,
    Gpu,
    GpuMemory,
    Gpus,
    GradBuffersOpt,
    Json,
    LogitsFp32,
    LossChunks,
    Mbs,
    Model,
    NormOpt,
    OffloadOpt,
    OptimizerImplOpt,
    OptimizerOpt,
    Pp,
    PrecisionOpt,
    RecomputeChoice,
    RecomputeLayers,
    RecomputeOpt,
    ScheduleOpt,
    Seq,
    Sp,
    Tp,
    TpStyleOpt,
    VocabParallel,
    Vpp,
    Zero,
    ZeroChoice,
    workload_fields,
)
from memplan.parallel import GradBuffers, Offload, TpStyle
from memplan.model.pipeline import Schedule
from memplan.workload import Attention, NormImpl, Optimizer, OptimizerImpl, Precision


@app.command()
def estimate(
    model: Model,
    gpus: Gpus = 1,
    gpu: Gpu = "h100-sxm",
    gpu_memory: GpuMemory = None,
    tp: Tp = 1, pp: Pp = 1, vpp: Vpp = 1, dp: Dp = None, cp: Cp = 1, ep: Ep = 1,
    sp: Sp = None,
    vocab_parallel: VocabParallel = True,
    tp_style: TpStyleOpt = TpStyle.MEGATRON,
    grad_buffers: GradBuffersOpt = GradBuffers.VIEW,
    offload: OffloadOpt = Offload.NONE,
    zero: Zero = ZeroChoice.Z0,
    mbs: Mbs = 1, gbs: Gbs = None, seq: Seq = None,
    recompute: RecomputeOpt = RecomputeChoice.NONE,
    recompute_layers: RecomputeLayers = None,
    precision: PrecisionOpt = Precision.BF16_MIXED,
    optimizer: OptimizerOpt = Optimizer.ADAMW,
    optimizer_impl: OptimizerImplOpt = OptimizerImpl.FOREACH,
    attention: AttentionOpt = Attention.FLASH,
    norm: NormOpt = NormImpl.UPCAST,
    logits_fp32: LogitsFp32 = True,
    loss_chunks: LossChunks = 1,
    schedule: ScheduleOpt = Schedule.ONE_F_ONE_B,
    calibration: Calibration = None,
    json_out: Json = False,
) -> None:
    """Per-GPU memory of every pipeline stage and the most loaded rank.

    Parameters, gradients, optimizer states, saved activations, transients and fixed
    overheads, with the forward, backward and optimizer-step peaks of the first step and of
    the steady state.

    Examples:

      memplan estimate --model llama-7b --gpus 64

      memplan estimate -m llama-3-70b -n 512 --tp 8 --pp 4 --vpp 5 --zero 1 --mbs 1 --seq 8192

      memplan estimate -m ./config.json -n 8 --zero 3 --recompute full --json

      memplan estimate -m llama-3-8b -n 8 --gpu h200 --calibration auto
    """
    est = run_estimate(
        model, gpus=gpus, gpu=gpu, gpu_memory=gpu_memory, tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp,
        ep=ep, zero=int(zero.value), sequence_parallel=sp, vocab_parallel=vocab_parallel,
        tp_style=tp_style.value, grad_buffers=grad_buffers.value, offload=offload.value,
        schedule=schedule,
        calibration=calibration,
        **workload_fields(mbs=mbs, gbs=gbs, seq=seq, recompute=recompute,
                          recompute_layers=recompute_layers, precision=precision,
                          optimizer=optimizer, optimizer_impl=optimizer_impl,
                          attention=attention, norm=norm, logits_fp32=logits_fp32,
                          loss_chunks=loss_chunks))
    from memplan.report import estimate_json, render_estimate

    if json_out:
        typer.echo(json.dumps(estimate_json(est), indent=2))
        return
    from rich.console import Console

    Console().print(render_estimate(est))
