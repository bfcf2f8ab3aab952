"""``memplan plan``: the largest micro-batch, cheapest recompute and fastest layout that fit."""

from __future__ import annotations

from typing import Annotated

import typer

from memplan.cli.options import (
    AccelerateConfig,
    DeepspeedConfig,
    Html,
    Job,
    Json,
    MegatronArgs,
    RecomputeChoice,
    TorchtitanConfig,
    defaults_of,
    uses,
    check_html,
    rich_text,
    write_html,
)
from memplan.errors import MemplanError
from memplan.report.versioned import dumps

Top = Annotated[int, typer.Option("--top", min=1, help="Candidates to show; recompute policies "
                                  "that cannot reach them are not searched.")]
MaxTp = Annotated[int | None, typer.Option("--max-tp", min=1,
                                           help="Largest TP (default: GPUs per node).")]
Safety = Annotated[float, typer.Option(
    "--safety", min=0.0, max=1.0, help="Fraction of capacity kept free, in [0, 1) "
    "(default 0.05).")]

Quiet = Annotated[bool, typer.Option(
    "--quiet", "-q", help="Print only the fastest configuration that fits, in one line (none "
    "fits: the reason, exit 1).")]

FixedRecompute = Annotated[RecomputeChoice | None, typer.Option(
    "--recompute", help="Fix the recompute policy (default: search all).")]


# Layout options given are fixed, the others searched: no layout default but the GPU count.
@uses("model", "gpus", "gpu", "gpu_memory", "tp", "pp", "vpp", "cp", "ep", "sp", "zero",
      "stage_layers", "dp_shard", "etp", "vpp_group", "gbs", "offload",
      "seq", "precision", "optimizer", "optimizer_impl", "attention", "norm", "logits_fp32",
      "loss_chunks", "framework", "keep_grads", "use_cache", "grad_sync", "fsdp_version",
      "fsdp_backward_prefetch", "fsdp_use_orig_params", "fsdp_reshard_after_forward",
      "mtp_layers", "compile", "optimizer_in_backward", "compile_loss",
      "compile_in_checkpoint",
      "loss_impl", "moe_impl", "logits_held", "calibration", "lora_rank", "lora_targets", "lora_dropout", "base_quant",
      "deltanet_kernel", "mamba_kernel", "mla_cache", "async_tp",
      model=None, gpus=8, tp=None, pp=None, vpp=None, cp=None, ep=None, zero=None,
      offload=None)
def plan(
    job: Job,
    recompute: FixedRecompute = None,
    max_tp: MaxTp = None,
    safety: Safety = 0.05,
    top: Top = 10,
    torchtitan_config: TorchtitanConfig = None,
    megatron_args: MegatronArgs = None,
    deepspeed_config: DeepspeedConfig = None,
    accelerate_config: AccelerateConfig = None,
    json_out: Json = False,
    quiet: Quiet = False,
    html: Html = None,
) -> None:
    """Find the layouts, micro-batch and recompute that fit, fastest first.

    Searches tp, pp (with virtual stages), cp, ep, dp, ZeRO, sequence parallelism and recompute
    policies, finds the largest micro-batch that fits each, and ranks them by estimated step
    time. Layout options given are fixed; the others are searched.

    Examples:

      memplan plan --model llama-2-7b --gpus 8

      memplan plan -m llama-3-70b -n 512 --seq 8192 --gbs 512 --tp 8 --json

      memplan plan -n 64 --torchtitan-config llama3_8b.toml

      memplan plan -m llama-7b -n 8 --deepspeed-config ds_config_zero2.json

      memplan plan -m llama-2-7b -n 8 --top 5 --html plan.html
    """
    html = check_html(html)
    from memplan.api import plan as run_plan
    from memplan.config_import.apply import configure

    model, kwargs, imported = configure(job.model, job.kwargs(), defaults_of(job, plan),
                                        torchtitan=torchtitan_config,
                                        megatron=megatron_args,
                                        deepspeed=deepspeed_config,
                                        accelerate=accelerate_config)
    policy = None if recompute is None else recompute.value
    fixed = kwargs.pop("recompute", None)
    if policy is not None and fixed is not None and fixed != policy:
        raise MemplanError(f"--recompute {policy} and the config's recompute ({fixed}) "
                           "disagree: give one of them")
    policy = policy or fixed
    result = run_plan(model, safety=safety, max_tp=max_tp, top=top,
                      recompute=None if policy is None else [policy], **kwargs)
    from memplan.report.plan import no_fit_reason, plan_json, savers_json

    found = None
    if (not result.candidates and result.closest_miss is not None
            and (json_out or html is not None or not quiet)):
        from memplan.diagnose.fixes import savers

        found = savers(model, kwargs, result.closest_miss, result.budget_bytes,
                       result.global_batch_size)
    out = None
    if json_out or html is not None:
        out = plan_json(result, top)
        if found is not None:
            out["savers"] = savers_json(found)
        if html is not None:
            out["html"] = str(html)
        if imported is not None:
            out["config"] = imported.as_json()
    if html is not None:
        write_html(html, "plan", out, _text(result, model, job, top, imported, found))
    if quiet and not json_out:
        for note in result.notes:  # stdout keeps its one line
            typer.echo(f"memplan: note: {note}", err=True)
        if result.candidates:
            from memplan.report.plan import best_line
            from memplan.spec import ModelSpec, load_model

            spec = model if isinstance(model, ModelSpec) else load_model(model)
            typer.echo(best_line(result, spec.num_layers))
            return
        typer.echo(f"memplan: {no_fit_reason(result)}", err=True)
        raise typer.Exit(1)
    if json_out:
        typer.echo(dumps("plan", out))
    else:
        from memplan.report.plan import plan_parts
        from memplan.report.text import print_parts
        from memplan.spec import ModelSpec, load_model

        if imported is not None:
            typer.echo("\n".join(imported.lines()))
        spec = model if isinstance(model, ModelSpec) else load_model(model)
        print_parts(plan_parts(result, spec.name, spec.num_layers, job.gpus, job.gpu, top))
        if found is not None:
            from memplan.report.plan import savers_text

            typer.echo(savers_text(found))
        if html is not None:
            typer.echo(f"wrote {html}")
    if not result.candidates:  # never an empty table with success
        typer.echo(f"memplan: {no_fit_reason(result)}", err=True)
        raise typer.Exit(1)


def _text(result, model, job: Job, top: int, imported, found) -> str:
    """The text ``plan`` prints, for the HTML page."""
    from memplan.report.plan import no_fit_reason, render_plan, savers_text
    from memplan.spec import ModelSpec, load_model

    spec = model if isinstance(model, ModelSpec) else load_model(model)
    return rich_text(*(imported.lines() if imported is not None else ()),
                     render_plan(result, spec.name, spec.num_layers, job.gpus, job.gpu, top),
                     *((savers_text(found),) if found is not None else ()),
                     *(() if result.candidates else (f"memplan: {no_fit_reason(result)}",)))
