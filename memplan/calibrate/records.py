"""Calibration records: one JSON file per measured grid point, written atomically.

A record holds the inputs of one short training run (the full model spec, the layout, the
workload) and what was measured on each rank, per step and phase. Records are data: they are
committed under ``calibration/records/<name>/`` and every profile is re-fitted from them.

Measured per step and phase (``PhaseMeasure``):

- ``allocated_bytes``: the phase's peak of live tensor bytes: ``torch.cuda.max_memory_allocated``
  since the phase began on CUDA; the exact tracker's peak on CPU.
- ``reserved_bytes``: ``torch.cuda.max_memory_reserved`` over the phase (CUDA only).
- ``device_used_bytes``: total minus free (``torch.cuda.mem_get_info``) at the phase's end: what
  the device holds for every process, context and NCCL buffers included (CUDA only).
- ``alloc_retries``, ``inactive_split_bytes``: the caching allocator's ``num_alloc_retries`` and
  ``inactive_split_bytes.all.current`` at the phase's end (CUDA only).

Writes go to a temporary file in the same folder followed by ``os.replace``, so a crash loses at
most the point in progress and never leaves a half-written record under its final name.
"""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from memplan.errors import MemplanError
from memplan.inputs import PROFILE_BYTES, read_text
from memplan.outputs import write_atomic
from memplan.parallel import ParallelConfig
from memplan.spec import ModelSpec
from memplan.units import PHASES
from memplan.workload import Workload

SCHEMA_VERSION = 1
# a JSON list of numbers only, written on one line (op-by-op byte series stay readable)
_NUMBER_LIST = re.compile(r"\[\s*((?:-?[0-9.eE+]+,\s*)*-?[0-9.eE+]+)\s*\]")
_FROZEN = ConfigDict(frozen=True, extra="forbid")



def cpu_name() -> str:
    """The host CPU's model name (Linux ``/proc/cpuinfo``), else what ``platform`` reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"

class Meta(BaseModel):
    """Where and how records were measured (the same for every record of one run)."""

    model_config = _FROZEN

    device: Literal["cuda", "cpu"]
    device_name: str = Field(description="torch.cuda.get_device_name(), or the CPU's name")
    gpu: str | None = Field(default=None, description="catalog name of the GPU (memplan gpus)")
    total_bytes: int | None = Field(default=None, description="device memory the runtime reports")
    num_devices: int = 1
    driver: str | None = None
    cuda: str | None = None
    torch: str
    python: str
    attention_backend: str = Field(description="the kernels behind attention=flash / eager")
    date: str = Field(description="UTC date of the measurement, YYYY-MM-DD")
    command: str


class PhaseMeasure(BaseModel):
    """One phase of one step on one rank; see the module docstring for each field."""

    model_config = _FROZEN

    allocated_bytes: int
    reserved_bytes: int | None = None
    device_used_bytes: int | None = None
    alloc_retries: int | None = None
    inactive_split_bytes: int | None = None


class StepMeasure(BaseModel):
    """One training step on one rank."""

    model_config = _FROZEN

    step: int = Field(ge=1)
    time_s: float = Field(ge=0, description="wall time of the step (CPU: under the tracker)")
    hardware_flops: float = Field(ge=0, description="FLOPs this rank ran (memplan.planning.timing, "
                                  "recompute included)")
    achieved_flops_per_s: float = Field(ge=0)
    phases: dict[str, PhaseMeasure]
    saved_activations_bytes: int | None = Field(default=None, description="tracker only: "
                                                "bytes born in forward alive when backward starts")
    layer_saved_bytes: list[int] | None = Field(default=None, description="tracker only: the "
                                                "same per transformer block")
    op_bytes: dict[str, list[int]] | None = Field(default=None, description="user models: live "
                                                  "bytes after every op, per phase")


class RankMeasure(BaseModel):
    model_config = _FROZEN

    rank: int = 0
    steps: list[StepMeasure]
    nccl_bytes: int | None = Field(default=None, description="device used after the process "
                                   "group's first collective minus before it (CUDA)")


class Record(BaseModel):
    """One grid point: its inputs and, unless it ran out of memory, its measurements."""

    model_config = _FROZEN

    schema_version: Literal[1] = SCHEMA_VERSION
    kind: Literal["grid", "model"] = Field(description="grid: the reference model; model: a "
                                           "user's nn.Module traced under fake tensors")
    key: str
    role: Literal["fit", "holdout"] = "fit"
    status: Literal["ok", "oom"]
    error: str | None = None
    spec: ModelSpec
    layout: ParallelConfig
    workload: Workload
    num_params: int | None = Field(default=None, description="parameters of the model that ran")
    module: str | None = Field(default=None, description="kind model: the factory, pkg.mod:fn")
    ranks: list[RankMeasure] = Field(default_factory=list)
    meta: Meta

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.ranks) and bool(self.ranks[0].steps)


def record_path(folder: Path, key: str) -> Path:
    return Path(folder) / f"{key}.json"


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path``: a temporary file in the same folder, then rename."""
    text = _NUMBER_LIST.sub(lambda m: "[" + ",".join(m.group(1).split()).replace(",,", ",")
                            + "]", json.dumps(data, indent=1))
    write_atomic(path, text + "\n")



def write_record(folder: Path, record: Record) -> Path:
    path = record_path(folder, record.key)
    write_json_atomic(path, record.model_dump(mode="json", exclude_none=True))
    return path


def read_record(path: Path) -> Record:
    """One record file (a regular file, UTF-8, bounded as a profile is: ``memplan.inputs``),
    checked; one line naming the file and the field otherwise."""
    try:
        return Record.model_validate_json(read_text(path, "calibration record", PROFILE_BYTES))
    except MemplanError:
        raise
    except (OSError, ValidationError, ValueError) as err:
        first = err.errors()[0] if isinstance(err, ValidationError) else None
        where = ".".join(str(p) for p in first["loc"]) if first else ""
        detail = f"{where}: {first['msg']}" if first else str(err).splitlines()[0]
        raise MemplanError(f"calibration record {path}: {detail}") from err


def read_records(folder: Path) -> list[Record]:
    """Every record in ``folder``, sorted by key (a deterministic order for the fit)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MemplanError(f"calibration records folder {folder} does not exist")
    records = [read_record(p) for p in sorted(folder.glob("*.json")) if p.name != PROBES_FILE]
    return sorted(records, key=lambda r: r.key)


def finished_keys(folder: Path) -> set[str]:
    """Keys of the records already written in ``folder`` (what ``--resume`` skips)."""
    folder = Path(folder)
    if not folder.is_dir():
        return set()
    done = set()
    for path in folder.glob("*.json"):
        if path.name == PROBES_FILE:
            continue
        try:
            done.add(read_record(path).key)
        except MemplanError:  # unreadable: measure that point again
            continue
    return done


class ProbeRecord(BaseModel):
    """The overhead probes of one run (CUDA): device-used deltas, each from a fresh process.

    ``context``: a second fresh process's ``mem_get_info`` used bytes minus a first one's, the
    first still holding its context (each process sees the other's context, not its own start).
    ``first_tensor``, ``cublas``, ``sdpa``: the growth after ``torch.ones((1, 1)).to("cuda")``,
    then after the first bf16 matmul, then after the first flash SDPA call, in that process.
    ``nccl``: the growth over a process group's initialisation and first all-reduce (several
    ranks only)."""

    model_config = _FROZEN

    schema_version: Literal[1] = SCHEMA_VERSION
    meta: Meta
    probes: dict[str, int]


PROBES_FILE = "probes.json"


def write_probes(folder: Path, probes: ProbeRecord) -> None:
    write_json_atomic(Path(folder) / PROBES_FILE, probes.model_dump(mode="json", exclude_none=True))


def read_probes(folder: Path) -> ProbeRecord | None:
    path = Path(folder) / PROBES_FILE
    if not path.is_file():
        return None
    try:
        return ProbeRecord.model_validate_json(read_text(path, "calibration probes",
                                                         PROFILE_BYTES))
    except MemplanError:
        raise
    except (OSError, ValidationError, ValueError) as err:
        raise MemplanError(f"calibration probes {path}: {str(err).splitlines()[0]}") from err
