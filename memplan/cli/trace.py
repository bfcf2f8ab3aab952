"""``memplan trace``: run real training steps of the reference model, measured next to estimate."""

from __future__ import annotations

from typing import Annotated

import typer

from memplan.api import resolve
from memplan.cli.options import FRAMEWORK_ONLY, WORKLOAD, Job, Json, uses
from memplan.errors import MemplanError, deferred_interrupts
from memplan.report.versioned import dumps

Steps = Annotated[int, typer.Option("--steps", help="Training steps (>= 2: first and steady).")]
Fake = Annotated[bool, typer.Option(
    "--fake/--real", help="Fake tensors (no memory, any size) or real CPU tensors.")]
Layers = Annotated[int | None, typer.Option(
    "--layers", help="Trace only this many layers of the model (a shorter copy of the spec).")]


# the layout options of the ranks the fake process group traces (no chunks, experts, offload)
@uses("model", "gpus", "tp", "pp", "dp", "cp", "sp", "zero",
      *(n for n in WORKLOAD if n not in FRAMEWORK_ONLY))
def trace(
    job: Job,
    layers: Layers = None,
    steps: Steps = 2,
    fake: Fake = True,
    json_out: Json = False,
) -> None:
    """Trace real training steps and print measured bytes next to the estimate.

    The reference model runs under the exact tensor tracker (tensors only: no CUDA context or
    allocator). FSDP2 (--zero 3) and TP ranks are traced through PyTorch's fake process group;
    the traced TP plan keeps embedding and head replicated and uses DTensor sequence
    parallelism, and the estimate is made for that layout. Needs torch (the torch extra).

    Examples:

      memplan trace --model llama-7b --layers 2 --seq 2048 --mbs 2

      memplan trace -m tiny --gpus 4 --zero 3 --precision fsdp-bf16 --json
    """
    spec, par, wl = resolve(job.model, **job.kwargs(resolve_only=True))
    if layers is not None:
        if not 0 < layers <= spec.num_layers:
            raise MemplanError(f"layers ({layers}) must be between 1 and {spec.num_layers}")
        spec = spec.model_copy(update={"num_layers": layers, "name": f"{spec.name}[:{layers}]"})
    if job.pp > 1 or job.cp > 1:
        raise MemplanError("trace: pipeline and context parallel layouts are not traced yet; "
                           "use tp, dp and zero")
    if steps < 2:
        raise MemplanError(f"steps ({steps}) must be at least 2: the first step and the steady state")
    try:
        from memplan.profile.compare import compare, comparison_json
    except ImportError as err:  # torch missing
        raise MemplanError(f"trace needs torch: pip install 'memplan[torch]' ({err})") from err
    with deferred_interrupts():  # Ctrl-C taken between torch operators, never inside one
        result = compare(spec, par, wl, steps=steps, fake=fake)
    if json_out:
        typer.echo(dumps("trace", comparison_json(result)))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{spec.name}: traced rank 0 vs estimate (bytes; tensors only)")
    for col in ("quantity", "measured", "estimated", "diff", "diff %"):
        table.add_column(col, justify="left" if col == "quantity" else "right", no_wrap=True)
    for r in result.rows:
        table.add_row(r.name.removesuffix("_bytes"), f"{r.measured_bytes:,}",
                      f"{r.estimated_bytes:,}", f"{r.diff_bytes:+,}", f"{r.diff_pct:+.3f}")
    Console().print(table)
