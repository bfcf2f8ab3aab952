"""Calibration profiles: fitted coefficients with their metadata and validation error, as JSON.

Two kinds:

- ``device``: fitted from grid records of the reference model on one device. Corrections of the
  analytic tensor peak per term (``DeviceTerms.coefficients``), the caching allocator's
  reserved/allocated ratio and rounding, the memory outside the allocator (context, NCCL), and
  the achieved FLOP/s of the time model. Applies to estimates for the GPU it was measured on
  (a CPU profile, measured with the exact tracker, to any: it has tensor terms only).
- ``model``: fitted from traces of a user's own ``nn.Module`` at several (mbs, seq) points. The
  difference between that implementation and the analytic reference, per target (saved
  activations, one block's saved activations, each phase peak), as a polynomial in (b, s).

A profile names the records it was fitted from (``records``, relative to the profile's folder),
so ``memplan calibrate --refit`` can re-derive every committed profile from committed data.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from memplan.calibrate.records import SCHEMA_VERSION, Meta, write_json_atomic
from memplan.errors import MemplanError, validation_message
from memplan.inputs import PROFILE_BYTES, read_json
from memplan.spec import ModelSpec
from memplan.workload import Workload

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class ErrorFigure(BaseModel):
    """Relative error of a predicted quantity over records, in percent."""

    model_config = _FROZEN

    quantity: str
    method: Literal["leave-one-out", "held-out", "in-sample", "analytic"]
    num_points: int
    max_abs_pct: float
    rms_pct: float


class PointFit(BaseModel):
    """One record's measured peak next to the analytic and fitted predictions (bytes)."""

    model_config = _FROZEN

    key: str
    role: str
    measured_bytes: int
    analytic_bytes: int
    fitted_bytes: int
    loo_bytes: int | None = None


class DeviceTerms(BaseModel):
    """Coefficients of a device profile. ``coefficients`` maps a feature (``features.py``) to
    its coefficient: ``fixed_bytes`` in bytes, the others relative to the analytic bytes of
    that term (0.02 = the device holds 2% more than the analytic term). Terms no record
    exercised are absent (no correction)."""

    model_config = _FROZEN

    coefficients: dict[str, float]
    # profiles fitted before the caching-allocator model: read, not applied
    reserved_ratio: float | None = Field(default=None, description="not fitted (profiles "
                                         "before the caching-allocator model)")
    reserved_rounding_bytes: int | None = None
    allocator_residual_bytes: int | None = Field(
        default=None, description="max reserved - max allocated, less the caching-allocator "
        "model's bytes beyond the tensor peak for the same configuration (memplan.model."
        "reserved); mean over records")
    outside_allocator_bytes: int | None = Field(default=None, description="device used minus "
                                                "reserved: CUDA context, kernels, NCCL")
    nccl_bytes_per_rank: int | None = None
    probes: dict[str, int] = Field(default_factory=dict, description="overhead probes, bytes")
    achieved_flops_per_s: float | None = Field(default=None, description="hardware FLOP/s "
                                               "of the time model t = t0 + FLOPs / rate")
    step_overhead_s: float | None = Field(default=None, description="t0: seconds per step "
                                          "that do not scale with FLOPs")
    mfu: float | None = Field(default=None, description="achieved hardware FLOP/s over the "
                              "GPU's catalog peak: the time model's utilisation")
    world_size: int = 1


class RegimeFit(BaseModel):
    """One regime's fit: ``residuals`` (target -> coefficients of the implementation minus the
    analytic reference) and ``envelopes`` (phase target -> coefficients of the live bytes after
    each op that is the phase's peak somewhere: the peak is their maximum)."""

    model_config = _FROZEN

    points: list[tuple[int, int]]
    residuals: dict[str, list[float]]
    envelopes: dict[str, list[list[float]]] = Field(default_factory=dict)


class ModelTerms(BaseModel):
    """A user model's fit per regime (``b=1``, ``b>=2``), polynomials in b (micro-batch) and
    s (sequence) over ``monomials``. Micro-batch 1 is its own regime: slicing a (1, s, ...)
    tensor along s keeps it contiguous, so ``.contiguous()`` copies that b >= 2 makes (e.g. a
    label shift) do not happen at b = 1."""

    model_config = _FROZEN

    module: str
    monomials: list[str]
    regimes: dict[str, RegimeFit]
    spec: ModelSpec = Field(description="the spec at the traced depth")
    workload: Workload
    layer_index: int = Field(description="the block whose saved bytes stand for one layer")
    num_params: int
    analytic_num_params: int

    @property
    def traced_layers(self) -> int:
        return self.spec.num_layers


class Profile(BaseModel):
    model_config = _FROZEN

    schema_version: Literal[1] = SCHEMA_VERSION
    kind: Literal["device", "model"]
    name: str
    meta: Meta
    records: str = Field(description="records folder, relative to this file's folder")
    num_records: int
    num_oom: int = 0
    device: DeviceTerms | None = None
    model: ModelTerms | None = None
    errors: list[ErrorFigure] = Field(default_factory=list)
    points: list[PointFit] = Field(default_factory=list)

    def error(self, quantity: str, method: str) -> ErrorFigure | None:
        return next((e for e in self.errors
                     if e.quantity == quantity and e.method == method), None)


def save_profile(path: Path, profile: Profile) -> None:
    write_json_atomic(Path(path), profile.model_dump(mode="json", exclude_none=True))


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    data = read_json(path, "calibration profile", PROFILE_BYTES)
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != SCHEMA_VERSION:
        raise MemplanError(f"calibration profile {path}: schema_version {version!r} is not "
                           f"{SCHEMA_VERSION}; re-fit it with `memplan calibrate --refit`")
    try:
        return Profile.model_validate(data)
    except ValidationError as err:
        raise MemplanError(f"calibration profile {path}: {validation_message(err)}") from err


@lru_cache(maxsize=1)
def profiles_dir() -> Path | None:
    """Committed profiles: inside the installed package, else the source tree's
    ``calibration/profiles``; None when neither exists."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "calibration_profiles", here.parent / "calibration" / "profiles"):
        if candidate.is_dir():
            return candidate
    return None


def find_profile(gpu_name: str, folder: Path | None = None) -> Path:
    """The device profile in ``folder`` (default: the committed ones) measured on ``gpu_name``
    (a catalog name); a one-line error listing what there is otherwise."""
    folder = folder if folder is not None else profiles_dir()
    found: list[tuple[str, Path]] = []
    for path in sorted(folder.glob("*.json")) if folder else []:
        prof = load_profile(path)
        if prof.kind == "device" and prof.meta.gpu == gpu_name:
            return path
        found.append((prof.meta.gpu or prof.meta.device, path))
    have = ", ".join(f"{p.name} ({g})" for g, p in found) or "none"
    raise MemplanError(f"no calibration profile for GPU {gpu_name} in {folder}; have: {have}")
