"""GPU catalog: usable memory, peak dense bf16 FLOP/s, bandwidths, node size, each with a source.

An unknown GPU is an error with the nearest names, never a guess. ``memory_bytes`` is what the
device reports to the framework (``torch.cuda.get_device_properties(i).total_memory``), not the
marketing number: an "80GB" H100 reports 79.19 GiB.
"""

from __future__ import annotations

import tomllib
from functools import lru_cache

from memplan.catalog import data_dir, suggest
from memplan.choices import Field, Record
from memplan.errors import MemplanError, ValidationError

# The GPU an estimate or a plan assumes when none is named (``memplan gpus`` lists the others).
DEFAULT_GPU = "h100-sxm"


class GpuSpec(Record):
    """One accelerator model. Bandwidths are bytes/s in one direction, per GPU."""

    name: str
    aliases: tuple[str, ...] = ()
    vendor: str
    compute_capability: str = Field(description='CUDA compute capability "9.0", or ROCm gfx target')
    memory_bytes: int = Field(gt=0, description="total memory the device reports to the framework")
    memory_source: str
    bf16_flops: float = Field(gt=0, description="peak dense bf16 tensor FLOP/s")
    hbm_bytes_per_s: float = Field(gt=0)
    intra_node_bytes_per_s: float = Field(gt=0, description="GPU-to-GPU link, one direction")
    inter_node_bytes_per_s: float = Field(gt=0, description="default network per GPU, one direction")
    gpus_per_node: int = Field(gt=0)
    host_link_bytes_per_s: float = Field(gt=0, description="GPU-to-host link (PCIe or "
                                         "chip-to-chip), one direction")
    host_memory_bytes_per_s: float = Field(gt=0, description="peak DRAM bandwidth of the "
                                           "node's host CPUs, all sockets, shared by its GPUs")
    host_source: str
    source: str


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, GpuSpec]:
    """All catalog GPUs by canonical lower-case name."""
    path = data_dir() / "gpus.toml"
    raw = tomllib.loads(path.read_text())
    out: dict[str, GpuSpec] = {}
    for key, entry in raw.items():
        try:
            out[key] = GpuSpec.model_validate({"name": key, **entry})
        except ValidationError as err:  # a broken catalog is our bug, but say where
            raise MemplanError(f"{path}: [{key}]: {err.errors()[0]['msg']}") from err
    return out


@lru_cache(maxsize=1)
def _alias_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for key, gpu in gpu_catalog().items():
        for alias in (key, *gpu.aliases):
            index[_normal(alias)] = key
    return index


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "-")


def load_gpu(name: str) -> GpuSpec:
    """A catalog GPU by name or alias (case-insensitive); unknown names list the nearest."""
    if not isinstance(name, str):
        raise MemplanError(f"gpu must be a GPU name (`memplan gpus`), got {name!r} "
                           f"({type(name).__name__})")
    key = _alias_index().get(_normal(name))

    if key is None:
        raise MemplanError(
            f"unknown GPU {name!r}" + suggest(_normal(name), list(_alias_index()))
            + " (`memplan gpus` lists the catalog)"
        )
    return gpu_catalog()[key]
