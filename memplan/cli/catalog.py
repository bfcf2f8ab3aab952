"""``memplan models`` and ``memplan gpus``: list the catalogs."""

from __future__ import annotations

import json

import typer

from memplan.cli.options import Json
from memplan.hardware import gpu_catalog
from memplan.spec import catalog_names, load_model


def models(json_out: Json = False) -> None:
    """List the catalog models with their exact parameter counts.

    Example: memplan models --json
    """
    specs = [load_model(name) for name in catalog_names()]
    if json_out:
        typer.echo(json.dumps([{**s.model_dump(mode="json"), "num_params": s.num_params}
                               for s in specs], indent=2))
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
        typer.echo(json.dumps([g.model_dump(mode="json") for g in catalog.values()], indent=2))
        return
    from rich.console import Console

    from memplan.report.catalog import render_gpus

    Console().print(render_gpus(list(catalog.values())))
