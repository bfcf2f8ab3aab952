"""``memplan plan``: the largest micro-batch, cheapest recompute and fastest layout that fit."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from memplan.cli.options import Job, Json, RecomputeChoice, uses

Top = Annotated[int, typer.Option("--top", help="Candidates to show.")]
MaxTp = Annotated[int | None, typer.Option("--max-tp", help="Largest TP (default: GPUs per node).")]
Safety = Annotated[float, typer.Option(
    "--safety", help="Fraction of capacity kept free (default 0.05).")]
FixedRecompute = Annotated[RecomputeChoice | None, typer.Option(
    "--recompute", help="Fix the recompute policy (default: search all).")]


# Layout options given are fixed, the others searched: no layout default but the GPU count.
@uses("model", "gpus", "gpu", "gpu_memory", "tp", "pp", "vpp", "cp", "ep", "sp", "zero", "gbs",
      "seq", "precision", "optimizer", "optimizer_impl", "attention", "norm", "logits_fp32",
      "loss_chunks", "calibration",
      gpus=8, tp=None, pp=None, vpp=None, cp=None, ep=None, zero=None)
def plan(
    job: Job,
    recompute: FixedRecompute = None,
    max_tp: MaxTp = None,
    safety: Safety = 0.05,
    top: Top = 10,
    json_out: Json = False,
) -> None:
    """Find the layouts, micro-batch and recompute that fit, fastest first.

    Searches tp, pp (with virtual stages), cp, ep, dp, ZeRO, sequence parallelism and recompute
    policies, finds the largest micro-batch that fits each, and ranks them by estimated step
    time. Layout options given are fixed; the others are searched.

    Examples:

      memplan plan --model llama-2-7b --gpus 8

      memplan plan -m llama-3-70b -n 512 --seq 8192 --gbs 512 --tp 8 --json
    """
    from memplan.api import plan as run_plan

    result = run_plan(job.model, safety=safety, max_tp=max_tp,
                      recompute=None if recompute is None else [recompute.value], **job.kwargs())
    if json_out:
        typer.echo(json.dumps(_plan_json(result, top), indent=2))
        return
    from memplan.spec import load_model

    spec = load_model(job.model)
    _print(result, spec.name, spec.num_layers, job.gpus, job.gpu, top)


def _plan_json(result, top: int) -> dict[str, Any]:
    return {
        "global_batch_size": result.global_batch_size,
        "evaluated": result.evaluated,
        "searched": result.searched,
        "candidates": [{
            "layout": {"tp": c.layout.tp, "pp": c.layout.pp, "vpp": c.layout.vpp,
                       "dp": c.layout.dp, "cp": c.layout.cp, "ep": c.layout.ep,
                       "zero": int(c.layout.zero), "sp": c.layout.sequence_parallel},
            "mbs": c.micro_batch_size, "recompute": c.recompute.label,
            "recompute_layers": c.recompute_layers,
            "peak_bytes": c.peak_bytes, "capacity_bytes": c.capacity_bytes,
            "step_time_s": c.time.step_s, "tokens_per_s_per_gpu": c.time.tokens_per_s_per_gpu,
            "mfu": c.time.mfu, "bound": c.time.bound.value, "fits": True,
        } for c in result.candidates[:top]],
        "rejected": dict(result.rejected),
        "oom_excess_bytes": result.oom_excess_bytes,
    }


_BOUND = {"compute": "compute", "communication": "comm", "pipeline bubble": "bubble"}


def _layout(p) -> str:
    parts = [f"tp{p.tp}" + ("+sp" if p.sequence_parallel else ""), f"pp{p.pp}"]
    parts += [f"v{p.vpp}"] if p.vpp > 1 else []
    parts += [f"cp{p.cp}"] if p.cp > 1 else []
    parts += [f"ep{p.ep}"] if p.ep > 1 else []
    return " ".join([*parts, f"dp{p.dp}", f"z{int(p.zero)}"])


def _print(result, model: str, num_layers: int, gpus: int, gpu: str, top: int) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from memplan.units import GiB

    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False,
                  title=f"{model} on {gpus} x {gpu}, global batch {result.global_batch_size}: "
                        f"{len(result.candidates)} fit ({result.evaluated} estimates; GiB = 2^30 B)")
    table.add_column("layout", no_wrap=True)
    for col in ("mbs", "recompute", "GiB", "step s", "tok/s/GPU", "MFU", "bound"):
        table.add_column(col, justify="right", no_wrap=True)
    for c in result.candidates[:top]:
        # full recompute of k of the stage's layers: "full 2 of 8"
        label = c.recompute.label + (f" {c.recompute_layers} of {num_layers // c.layout.pp}"
                                     if c.recompute_layers else "")
        table.add_row(_layout(c.layout), str(c.micro_batch_size), label,
                      f"{c.peak_bytes / GiB:.1f}", f"{c.time.step_s:.2f}",
                      f"{c.time.tokens_per_s_per_gpu:,.0f}", f"{c.time.mfu:.2f}",
                      _BOUND[c.time.bound.value])
    console = Console()
    console.print(table)
    if result.rejected:
        console.print("rejected: " + "; ".join(f"{n} x {reason}"
                                                for reason, n in result.rejected.most_common()))
    if result.oom_excess_bytes is not None:
        console.print(f"closest configuration that did not fit: "
                      f"{result.oom_excess_bytes / GiB:.2f} GiB over the usable capacity")
