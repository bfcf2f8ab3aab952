"""``memplan models`` and ``memplan gpus``: list the catalogs."""

from __future__ import annotations

import typer

from memplan.cli.options import Json
from memplan.hardware import gpu_catalog
from memplan.report.versioned import dumps
from memplan.spec import catalog_names, load_model


def models(json_out: Json = False) -> None:
    """List the catalog models with their exact parameter counts.

    Example: memplan models --json
    """
    specs = [load_model(name) for name in catalog_names()]
    if json_out:
        typer.echo(dumps("models", [{**s.model_dump(mode="json"), "num_params": s.num_params}
                                     for s in specs], "models"))
        return
    from rich.console import Console

    from memplan.report.catalog import render_models

    Console().print(render_models(specs))


def gpus(json_out: Json = False) -> None:
    """List the catalog GPUs: reported memory, dense bf16 peak, bandwidths.

    Example: memplan gpus
    """
    catalog = gpu_catalog()
    if json_out:
        typer.echo(dumps("gpus", [g.model_dump(mode="json") for g in catalog.values()], "gpus"))
        return
    from rich.console import Console

    from memplan.report.catalog import render_gpus

    Console().print(render_gpus(list(catalog.values())))
