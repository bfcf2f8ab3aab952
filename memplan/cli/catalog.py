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

    from memplan.report import render_catalog

    rows = [[s.name, f"{s.num_params / 1e9:.3f}B", str(s.num_layers), str(s.hidden_size),
             f"{s.num_attention_heads}/{s.num_kv_heads}", str(s.vocab_size),
             s.mlp.value + (f" {s.moe.num_experts}x{s.moe.top_k}" if s.moe else "")]
            for s in specs]
    Console().print(render_catalog(
        "memplan model catalog (exact counts and sources: memplan models --json)",
        ["name", "params", "layers", "hidden", "heads/kv", "vocab", "mlp"], rows))


def gpus(json_out: Json = False) -> None:
    """List the catalog GPUs: reported memory, dense bf16 peak, bandwidths.

    Example: memplan gpus
    """
    catalog = gpu_catalog()
    if json_out:
        typer.echo(json.dumps([g.model_dump(mode="json") for g in catalog.values()], indent=2))
        return
    from rich.console import Console

    from memplan.report import render_catalog
    from memplan.units import GiB

    rows = [[g.name, f"{g.memory_bytes / GiB:.2f}", f"{g.bf16_flops / 1e12:,.0f}",
             f"{g.hbm_bytes_per_s / 1e12:.2f}", f"{g.intra_node_bytes_per_s / 1e9:,.0f}",
             f"{g.inter_node_bytes_per_s / 1e9:,.1f}", str(g.gpus_per_node)]
            for g in catalog.values()]
    Console().print(render_catalog(
        "memplan GPU catalog (aliases and sources: memplan gpus --json)",
        ["name", "GiB", "bf16 TFLOP/s", "HBM TB/s", "link GB/s", "net GB/s", "per node"], rows))
