"""A ``memplan profile`` output directory as evidence: measured phase peaks against the estimate.

Reads ``summary.json`` (written by ``memplan.timeline.write``): per step and phase the peak
bytes (tensors under the exact CPU tracker, the caching allocator's allocated bytes on CUDA),
their split by category, the reserved bytes on CUDA, and the first-step analysis' warnings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.diagnose.explain import Finding
from memplan.errors import MemplanError
from memplan.model.estimate import StageMemory
from memplan.overheads import ALLOCATOR_FRACTION


@dataclass(frozen=True)
class PhasePeak:
    step: int
    phase: str
    peak_bytes: int
    by_category: dict[str, int]
    reserved_bytes: int | None


@dataclass(frozen=True)
class Measured:
    """One rank's measured peaks: the first step's and the last (steady) step's phases."""

    device: str  # "cpu-tracker" or "cuda"
    first: dict[str, PhasePeak]
    steady: dict[str, PhasePeak]
    warnings: tuple[str, ...]

    @property
    def peak(self) -> PhasePeak:
        every = [*self.first.values(), *self.steady.values()]
        return max(every, key=lambda p: (p.peak_bytes, p.step))


def read_profile(path: str) -> Measured:
    """``summary.json`` of a ``memplan profile`` directory (or the file itself)."""
    file = Path(path)
    if file.is_dir():
        file = file / "summary.json"
    try:
        data = json.loads(file.read_text())
    except OSError as err:
        raise MemplanError(f"--profile: cannot read {file}: {err.strerror}") from err
    except json.JSONDecodeError as err:
        raise MemplanError(f"--profile: {file} is not JSON ({err.msg}, line {err.lineno})") from err
    try:
        phases = data["phases"]
        last = str(data["num_steps"])
        first = _phases(phases["1"], 1)
        steady = _phases(phases.get(last, {}), int(last))
        warnings = tuple(str(w) for w in data.get("first_step", {}).get("warnings", []))
        return Measured(str(data.get("device", "")), first, steady, warnings)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise MemplanError(f"--profile: {file} lacks {err} of a `memplan profile` summary "
                           "(phases by step with peak_bytes)") from err


def _phases(raw: dict[str, Any], step: int) -> dict[str, PhasePeak]:
    return {phase: PhasePeak(step, phase, int(v["peak_bytes"]),
                             {k: int(b) for k, b in v.get("by_category", {}).items()},
                             None if v.get("reserved_bytes") is None else int(v["reserved_bytes"]))
            for phase, v in raw.items()}


def profile_findings(s: StageMemory, m: Measured) -> list[Finding]:
    """The measured peak next to the estimate's bytes for the same step and phase, its largest
    category, the allocator's cache at that peak (CUDA), and the profile's own warnings."""
    out = []
    peak = m.peak
    label = "step 1" if peak.step == 1 else "the steady state"
    phases = s.first_step if peak.step == 1 else s.steady
    predicted = getattr(phases, peak.phase, None)
    sizes = {"measured_bytes": peak.peak_bytes}
    text = f"measured peak ({m.device}, step {peak.step} {peak.phase}): {{measured_bytes}}"
    if predicted is not None:
        sizes.update(predicted_bytes=predicted, gap_bytes=abs(predicted - peak.peak_bytes))
        where = "above" if predicted >= peak.peak_bytes else "below"
        text += (f"; the estimate's {peak.phase} of {label} on stage {s.stage} is "
                 f"{{predicted_bytes}}, {{gap_bytes}} {where} it")
    if peak.by_category:
        name, size = max(peak.by_category.items(), key=lambda item: item[1])
        sizes["category_bytes"] = size
        text += f"; measured largest category: {name} ({{category_bytes}})"
    out.append(Finding("profile", text, sizes, cause=False))
    if peak.reserved_bytes is not None:
        cache = peak.reserved_bytes - peak.peak_bytes
        if cache > ALLOCATOR_FRACTION * peak.reserved_bytes:
            out.append(Finding("fragmentation", "measured: {cache_bytes} reserved but unallocated "
                               "at the peak, above the "
                               f"{ALLOCATOR_FRACTION:.0%} the estimate assumes "
                               "(memplan.overheads); expandable_segments:True reduces it",
                               {"cache_bytes": cache}, cause=True))
    out += [Finding("profile_warning", w.replace("{", "{{").replace("}", "}}"))
            for w in m.warnings]
    return out
