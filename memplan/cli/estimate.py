"""``memplan estimate``: per-GPU memory of one configuration."""

from __future__ import annotations

import json

import typer

from memplan.api import estimate as run_estimate
from memplan.cli.options import ESTIMATE, Job, Json, uses


@uses(*ESTIMATE)
def estimate(job: Job, json_out: Json = False) -> None:
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
    est = run_estimate(job.model, **job.kwargs())
    from memplan.report import estimate_json, render_estimate

    if json_out:
        typer.echo(json.dumps(estimate_json(est), indent=2))
        return
    from rich.console import Console

    Console().print(render_estimate(est))
