"""``memplan estimate``: per-GPU memory of one configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from memplan.api import estimate as run_estimate
from memplan.cli.options import (
    AccelerateConfig,
    ESTIMATE,
    DeepspeedConfig,
    Html,
    Job,
    Json,
    MegatronArgs,
    TorchtitanConfig,
    defaults_of,
    uses,
    check_html,
    rich_text,
    write_html,
)
from memplan.report.versioned import dumps

Quiet = Annotated[bool, typer.Option(
    "--quiet", "-q", help="Print only the verdict line (fits or not, peak, stage, headroom); "
    "the exit code is 0 either way, as without it.")]
EmitPolicy = Annotated[str | None, typer.Option(
    "--emit-policy", help="With --recompute ops or auto: print the save set as torch (a "
    "policy_fn module for create_selective_checkpoint_contexts), torchtitan (its per-op SAC "
    "config) or megatron (--recompute-modules), with what the framework cannot express.")]
ReservedOpt = Annotated[bool, typer.Option(
    "--reserved", help="Also replay each stage's allocations through PyTorch's caching "
    "allocator (memplan/model/reserved.py) and say what it would reserve: a line after the "
    "table, and reserved_peak_bytes, fragmentation_bytes, reserved_by_step in --json. "
    "Costs 0.1-1 s of CPU; on with --alloc-conf.")]
AllocConf = Annotated[str, typer.Option(
    "--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF as the job sets it (e.g. "
    "'expandable_segments:True' or 'max_split_size_mb:512'): the caching allocator's options "
    "the reserved-memory replay follows (max_split_size_mb, max_non_split_rounding_mb, "
    "large_segment_size_mb, roundup_power2_divisions, expandable_segments).")]
PlotPath = Annotated[Path | None, typer.Option(
    "--plot", help="Also draw each pipeline stage's peak as a stacked bar against the GPU's "
    "capacity, to this .png or .svg file (needs matplotlib).")]


@uses(*ESTIMATE, model=None)
def estimate(job: Job, plot: PlotPath = None, torchtitan_config: TorchtitanConfig = None,
             megatron_args: MegatronArgs = None,
             deepspeed_config: DeepspeedConfig = None,
             accelerate_config: AccelerateConfig = None, json_out: Json = False,
             quiet: Quiet = False, html: Html = None,
             emit_policy: EmitPolicy = None, alloc_conf: AllocConf = "",
             reserved_opt: ReservedOpt = False) -> None:
    """Per-GPU memory of every pipeline stage and the most loaded rank.

    Parameters, gradients, optimizer states, saved activations, transients and fixed
    overheads, with the forward, backward and optimizer-step peaks of the first step and of
    the steady state.

    Examples:

      memplan estimate --model llama-7b --gpus 64

      memplan estimate -m llama-3-70b -n 512 --tp 8 --pp 4 --vpp 5 --zero 1 --mbs 1 --seq 8192

      memplan estimate -m ./config.json -n 8 --zero 3 --recompute full --json

      memplan estimate -m llama-3-8b -n 8 --gpu h200 --calibration auto

      memplan estimate -m llama-7b -n 8 --tp 2 --pp 4 --plot stages.png

      memplan estimate -m llama-7b -n 8 --tp 2 --pp 4 --html report.html

      memplan estimate -n 64 --torchtitan-config llama3_8b.toml

      memplan estimate -m llama-7b -n 8 --deepspeed-config ds_config_zero2.json

      memplan estimate -n 8 --megatron-args "--num-layers 32 --hidden-size 4096 ..."

      memplan estimate -m llama-3-8b -n 8 --zero 3 --recompute auto --emit-policy torch

      memplan estimate -m llama-3-8b -n 8 --zero 3 --reserved --alloc-conf expandable_segments:True
    """
    if plot is not None:
        from memplan.report.plot import check_path

        check_path(plot)
    html = check_html(html)
    from memplan.config_import.apply import configure

    model, kwargs, imported = configure(job.model, job.kwargs(), defaults_of(job, estimate),
                                        torchtitan=torchtitan_config,
                                        megatron=megatron_args,
                                        deepspeed=deepspeed_config,
                                        accelerate=accelerate_config)
    # the caching allocator's reserved memory (memplan.model.reserved), asked for with
    # --reserved or --alloc-conf: its replay costs 0.1-1 s of CPU, more than the estimate, and
    # the peak per GPU does not count it yet; its module loads only then
    wanted = reserved_opt or bool(alloc_conf)
    if wanted:
        from memplan.model.reserved import config_of, estimate_reserved

        config_of(alloc_conf, None)  # an option the model does not follow: refused first
    if wanted and kwargs.get("recompute") == "auto":  # the set chosen against the replay
        kwargs = {**kwargs, "fit_reserved": alloc_conf or ""}
    est = run_estimate(model, **kwargs)
    if emit_policy is not None:
        from memplan.report.sac_policy import emit_for

        typer.echo(emit_for(emit_policy, est), nl=False)
        return
    from memplan.report import estimate_json, render_estimate

    reserved = (estimate_reserved(est, alloc_conf)
                if wanted and not (quiet and not (json_out or html)) else ())

    drawn = None
    if plot is not None:
        from memplan.report.plot_estimate import plot_estimate

        drawn = plot_estimate(est, plot)
    if json_out or html is not None:
        out = estimate_json(est, reserved, alloc_conf)
        if plot is not None:
            out["plot"] = None if drawn is None else str(drawn)
        if html is not None:
            out["html"] = str(html)
        if imported is not None:
            out["config"] = imported.as_json()
    if html is not None:
        write_html(html, "estimate", out, rich_text(
            *(imported.lines() if imported is not None else ()),
            render_estimate(est, reserved, alloc_conf)))
    if json_out:
        typer.echo(dumps("estimate", out))
        return
    if quiet:
        from memplan.report.estimate import verdict_line

        typer.echo(verdict_line(est))
        return
    if imported is not None:
        typer.echo("\n".join(imported.lines()))
    # the text rich prints, to a pipe or a terminal, laid out without loading rich
    from memplan.report.estimate import estimate_parts
    from memplan.report.text import print_parts

    print_parts(estimate_parts(est, reserved, alloc_conf))
    if drawn is not None:
        typer.echo(f"wrote {drawn}")
    if html is not None:
        typer.echo(f"wrote {html}")
