"""``memplan models`` and ``memplan gpus``: the catalogs as rich tables (memory in GiB)."""

from __future__ import annotations

from typing import Any

from memplan.hardware import GpuSpec
from memplan.report.sizes import gib
from memplan.spec import ModelSpec


def render_catalog(title: str, columns: list[str], rows: list[list[str]]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, no_wrap=i < len(columns) - 1, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def render_models(specs: list[ModelSpec]) -> Any:
    """The model catalog: exact parameter counts (as billions), shape, MLP kind."""
    rows = [[s.name, f"{s.num_params / 1e9:.3f}B", str(s.num_layers), str(s.hidden_size),
             f"{s.num_attention_heads}/{s.num_kv_heads}", str(s.vocab_size),
             s.mlp.value + (f" {s.moe.num_experts}x{s.moe.top_k}" if s.moe else "")]
            for s in specs]
    return render_catalog(
        "memplan model catalog (exact counts and sources: memplan models --json)",
        ["name", "params", "layers", "hidden", "heads/kv", "vocab", "mlp"], rows)


def render_gpus(gpus: list[GpuSpec]) -> Any:
    """The GPU catalog: memory as the device reports it (GiB), peak FLOP/s, bandwidths."""
    rows = [[g.name, gib(g.memory_bytes), f"{g.bf16_flops / 1e12:,.0f}",
             f"{g.hbm_bytes_per_s / 1e12:.2f}", f"{g.intra_node_bytes_per_s / 1e9:,.0f}",
             f"{g.inter_node_bytes_per_s / 1e9:,.1f}", str(g.gpus_per_node)]
            for g in gpus]
    return render_catalog(
        "memplan GPU catalog (aliases and sources: memplan gpus --json)",
        ["name", "GiB", "bf16 TFLOP/s", "HBM TB/s", "link GB/s", "net GB/s", "per node"], rows)
