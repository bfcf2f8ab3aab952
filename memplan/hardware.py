"""GPU catalog: usable memory, peak dense bf16 FLOP/s, bandwidths, node size, each with a source.

An unknown GPU is an error with the nearest names, never a guess. ``memory_bytes`` is what the
device reports to the framework (``torch.cuda.get_device_properties(i).total_memory``), not the
marketing number: an "80GB" H100 reports 79.19 GiB.
"""

from __future__ import annotations

import re
import tomllib
from functools import lru_cache
from typing import TYPE_CHECKING

from memplan.catalog import data_dir, suggest
from memplan.choices import Field, Record
from memplan.errors import MemplanError, ValidationError

if TYPE_CHECKING:
    from pathlib import Path

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
    return {key: _validated(path, key, entry) for key, entry in raw.items()}


def _validated(path: Path, key: str, entry: dict) -> GpuSpec:
    try:
        return GpuSpec.model_validate({"name": key, **entry})
    except ValidationError as err:  # a broken catalog is our bug, but say where
        raise MemplanError(f"{path}: [{key}]: {err.errors()[0]['msg']}") from err


@lru_cache(maxsize=1)
def _alias_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for key, gpu in gpu_catalog().items():
        for alias in (key, *gpu.aliases):
            index[_normal(alias)] = key
    return index


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "-")


# A command names one GPU: parsing the whole catalog (tomllib is pure Python) took 15.8M of
# a cold ``estimate``'s 615M instructions (callgrind, CPython 3.11). Where the file keeps the
# flat form it is written in (a ``[name]`` line per GPU, its ``aliases`` on one line, no
# multi-line string), one GPU is read from its own table's lines; any other form is read
# whole (``gpu_catalog``). tests/unit/test_hardware.py checks that both give the same GPU for
# every name and alias.
_HEADER = r"\[([a-z0-9][a-z0-9.-]*)\][ \t]*(?:#.*)?"
_ALIASES = r"aliases[ \t]*=[ \t]*(\[[^\]\n]*\])[ \t]*(?:#.*)?"
_PLAIN_LIST = r'\[[ \t]*(?:"[^"\\]*"[ \t]*,[ \t]*)*(?:"[^"\\]*"[ \t]*,?[ \t]*)?\]'


@lru_cache(maxsize=1)
def _sections() -> tuple[dict[str, str], dict[str, str]] | None:
    """(each GPU's table as text, by name; the alias index) read line by line, or None where
    the file is not in that flat form."""
    text = (data_dir() / "gpus.toml").read_text()
    if '"""' in text or "'''" in text:  # a multi-line string could hold any line
        return None
    tables: dict[str, list[str]] = {}
    index: dict[str, str] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            head = re.fullmatch(_HEADER, line)
            if head is None or head.group(1) in tables:
                return None
            key = head.group(1)
            current = tables[key] = []
            index[_normal(key)] = key
            continue
        if current is None:
            if line and not line.startswith("#"):
                return None  # a key before the first table
            continue
        current.append(line)
        if line.startswith("aliases"):
            found = re.fullmatch(_ALIASES, line)
            if found is None:
                return None
            items = found.group(1)
            # plain strings (no escapes) are what they read as; anything else via tomllib
            plain = re.fullmatch(_PLAIN_LIST, items) is not None
            for alias in (re.findall(r'"([^"]*)"', items) if plain
                          else tomllib.loads(f"a = {items}")["a"]):
                index[_normal(alias)] = key
    return {k: "\n".join(v) for k, v in tables.items()}, index


@lru_cache(maxsize=64)
def _one(key: str) -> GpuSpec:
    """One GPU read from its own table's lines (``_sections``)."""
    tables, _ = _sections()  # type: ignore[misc]  (only called where they were read)
    return _validated(data_dir() / "gpus.toml", key, tomllib.loads(tables[key]))


def load_gpu(name: str) -> GpuSpec:
    """A catalog GPU by name or alias (case-insensitive); unknown names list the nearest."""
    if not isinstance(name, str):
        raise MemplanError(f"gpu must be a GPU name (`memplan gpus`), got {name!r} "
                           f"({type(name).__name__})")
    flat = _sections()
    key = (flat[1] if flat is not None else _alias_index()).get(_normal(name))

    if key is None:
        raise MemplanError(
            f"unknown GPU {name!r}" + suggest(_normal(name), list(_alias_index()))
            + " (`memplan gpus` lists the catalog)"
        )
    return _one(key) if flat is not None else gpu_catalog()[key]
