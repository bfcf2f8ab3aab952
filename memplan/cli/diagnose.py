"""``memplan diagnose``: why a configuration ran out of memory, and the fixes that fit."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Annotated

import typer

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

_INPUT = "Evidence"
Oom = Annotated[str | None, typer.Option(
    "--oom", help="File with PyTorch's out-of-memory error (a log or traceback is fine), or - "
    "for stdin.", rich_help_panel=_INPUT)]
Profile = Annotated[str | None, typer.Option(
    "--profile", help="A `memplan profile` output directory (its summary.json): measured phase "
    "peaks against the estimate.", rich_help_panel=_INPUT)]
Monitor = Annotated[list[str] | None, typer.Option(
    "--monitor", help="MemoryMonitor JSONL files (memory_rank<R>.jsonl) or a directory of them; "
    "repeat for more: the worst rank's measured memory against the estimate.",
    rich_help_panel=_INPUT)]
Snapshot = Annotated[str | None, typer.Option(
    "--snapshot", help="A torch.cuda.memory._dump_snapshot pickle (needs --trust-pickle).",
    rich_help_panel=_INPUT)]
TrustPickle = Annotated[bool, typer.Option(
    "--trust-pickle", help="Load --snapshot: a pickle can run code, so only for your own file.",
    rich_help_panel=_INPUT)]
NoFixes = Annotated[bool, typer.Option("--no-fixes", help="Explain only; skip the fixes.")]


@app.command()
def diagnose(
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
    oom: Oom = None,
    profile: Profile = None,
    monitor: Monitor = None,
    snapshot: Snapshot = None,
    trust_pickle: TrustPickle = False,
    no_fixes: NoFixes = False,
    json_out: Json = False,
) -> None:
    """Explain an out-of-memory failure of a configuration and rank fixes that fit.

    Takes the configuration (the options of `memplan estimate`) and, optionally, the error
    PyTorch printed (1.x to current formats), a `memplan profile` directory, MemoryMonitor
    records or a memory snapshot. Names the failing phase and
    its largest component, fragmentation, memory outside PyTorch, first-step and loss spikes,
    pipeline imbalance; compares the estimate with the error's numbers; re-estimates each fix
    (recompute, ZeRO, TP/PP/CP, micro-batch, fused optimizer, expandable segments, the
    planner's best layout) with its peak, fit and step time; says what bounds the job.

    Examples:

      memplan diagnose -m llama-2-7b -n 8 --zero 1 --mbs 4 --oom err.txt

      grep -A3 OutOfMemoryError train.log | memplan diagnose -m llama-3-8b -n 8 --oom -

      memplan diagnose -m tiny --profile runs/tiny --no-fixes

      memplan diagnose -m llama-3-8b -n 8 --zero 1 --monitor runs/mem

      memplan diagnose -m llama-3-8b -n 8 --snapshot snap.pickle --trust-pickle --json
    """
    from memplan.diagnose import diagnose as run_diagnose
    from memplan.diagnose.oom import read_oom
    from memplan.diagnose.render import render_text, to_json
    from memplan.diagnose.snapshot import load_snapshot, snapshot_report

    report = read_oom(oom, sys.stdin.read() if oom == "-" else None) if oom else None
    if snapshot:
        snap = snapshot_report(load_snapshot(snapshot, trust_pickle=trust_pickle))
        report = snap if report is None else dataclasses.replace(
            report, largest_free_block_bytes=snap.largest_free_block_bytes,
            num_segments=snap.num_segments)
    result = run_diagnose(
        model, oom=report, profile=profile, monitor=monitor or None, fixes=not no_fixes,
        gpus=gpus, gpu=gpu,
        gpu_memory=gpu_memory, tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, ep=ep, zero=int(zero.value),
        sequence_parallel=sp, vocab_parallel=vocab_parallel, tp_style=tp_style.value,
        grad_buffers=grad_buffers.value, offload=offload.value, schedule=schedule,
        calibration=calibration,
        **workload_fields(mbs=mbs, gbs=gbs, seq=seq, recompute=recompute,
                          recompute_layers=recompute_layers, precision=precision,
                          optimizer=optimizer, optimizer_impl=optimizer_impl,
                          attention=attention, norm=norm, logits_fp32=logits_fp32,
                          loss_chunks=loss_chunks))
    if json_out:
        typer.echo(json.dumps(to_json(result), indent=2))
        return
    typer.echo(render_text(result))
