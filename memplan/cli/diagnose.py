"""``memplan diagnose``: why a configuration ran out of memory, and the fixes that fit."""

from __future__ import annotations

import dataclasses
import sys
from typing import Annotated

import typer

from memplan.cli.options import (
    ESTIMATE,
    AccelerateConfig,
    DeepspeedConfig,
    Html,
    Job,
    Json,
    defaults_of,
    uses,
    check_html,
    write_html,
)
from memplan.report.versioned import dumps

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


@uses(*ESTIMATE)
def diagnose(
    job: Job,
    oom: Oom = None,
    profile: Profile = None,
    monitor: Monitor = None,
    snapshot: Snapshot = None,
    trust_pickle: TrustPickle = False,
    no_fixes: NoFixes = False,
    deepspeed_config: DeepspeedConfig = None,
    accelerate_config: AccelerateConfig = None,
    json_out: Json = False,
    html: Html = None,
) -> None:
    """Explain an out-of-memory failure of a configuration and rank fixes that fit.

    Takes the configuration (the options of `memplan estimate`) and, optionally, the error
    PyTorch printed (1.x to current formats) with the traceback around it (the phase and
    operation it died in: the optimizer step, the gradient reduction, loading, a checkpoint
    save), a `memplan profile` directory, MemoryMonitor records or a memory snapshot (the
    frames of its out-of-memory event). Names the failing phase and
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

      memplan diagnose -m llama-7b -n 8 --gpu v100-sxm2-32gb --deepspeed-config ds_z2.json

      memplan diagnose -m llama-2-7b -n 8 --zero 1 --mbs 4 --oom err.txt --html why.html
    """
    html = check_html(html)
    from memplan.diagnose import diagnose as run_diagnose
    from memplan.diagnose.oom import read_oom, read_oom_text
    from memplan.diagnose.snapshot import load_snapshot, snapshot_died_in, snapshot_report
    from memplan.inputs import LOG_BYTES, read_stream
    from memplan.report.diagnose import render_text, to_json

    stdin = read_stream(sys.stdin, "--oom", LOG_BYTES) if oom == "-" else None
    text = read_oom_text(oom, stdin) if oom else None
    report = read_oom(oom, text=text) if oom else None

    died = None
    if snapshot:
        data = load_snapshot(snapshot, trust_pickle=trust_pickle)
        snap = snapshot_report(data)
        died = snapshot_died_in(data)
        report = snap if report is None else dataclasses.replace(
            report, largest_free_block_bytes=snap.largest_free_block_bytes,
            num_segments=snap.num_segments)
    model, kwargs, imported = job.model, job.kwargs(), None
    if deepspeed_config is not None or accelerate_config is not None:
        from memplan.config_import.apply import configure

        model, kwargs, imported = configure(model, kwargs, defaults_of(job, diagnose),
                                            deepspeed=deepspeed_config,
                                            accelerate=accelerate_config)
        if not json_out:
            typer.echo("\n".join(imported.lines()))
    result = run_diagnose(model, oom=report, profile=profile, monitor=monitor or None,
                          fixes=not no_fixes,
                          traceback=text if text is not None and died is None else died,
                          snapshot=data if snapshot else None, **kwargs)
    from memplan.cli import warn

    for note in result.monitor.partial if result.monitor is not None else ():
        warn(f"partial monitor evidence: {note}")

    if html is not None:
        out = {**to_json(result), "html": str(html)}
        write_html(html, "diagnose", out, "\n".join(
            [*(imported.lines() if imported is not None else ()), render_text(result)]))
    if json_out:
        typer.echo(dumps("diagnose", out if html is not None else to_json(result)))
        return
    typer.echo(render_text(result))
    if html is not None:
        typer.echo(f"wrote {html}")
