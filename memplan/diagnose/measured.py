"""A ``memplan profile`` output directory as evidence: measured phase peaks against the estimate.

Reads ``summary.json`` (written by ``memplan.measure.timeline.write``): per step and phase the peak
bytes (tensors under the exact CPU tracker, the caching allocator's allocated bytes on CUDA),
their split by category, the reserved bytes on CUDA, and the first-step analysis' warnings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.diagnose.explain import Finding
from memplan.errors import MemplanError, shown
from memplan.inputs import SUMMARY_BYTES, read_json
from memplan.model.estimate import StageMemory
from memplan.overheads import NOTABLE_CACHE_FRACTION


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
    """``summary.json`` of a ``memplan profile`` directory (or the file itself). Raises
    MemplanError naming the file and the field that is missing or of the wrong type."""
    file = Path(path)
    if file.is_dir():
        file = file / "summary.json"
    data = read_json(file, "--profile", SUMMARY_BYTES)
    where = f"--profile: {file}"
    if not isinstance(data, dict):
        raise MemplanError(f"{where} holds {shown(data)}, not a `memplan profile` summary")
    phases = _field(data, "phases", dict, where)
    last = _field(data, "num_steps", int, where)
    if last < 1:
        raise MemplanError(f"{where}: num_steps is {last}, not a step count")
    first = _phases(_field(phases, "1", dict, f"{where}: phases"), 1, where)
    steady = _phases(phases.get(str(last), {}), last, where)
    head = data.get("first_step", {})
    warnings = head.get("warnings", []) if isinstance(head, dict) else []
    if not isinstance(warnings, list):
        raise MemplanError(f"{where}: first_step.warnings is {shown(warnings)}, not a list")
    return Measured(str(data.get("device", "")), first, steady, tuple(map(str, warnings)))


def _field(data: dict[str, Any], key: str, kind: type, where: str) -> Any:
    """``data[key]`` of type ``kind`` (an int is not a bool), or one line naming it."""
    value = data.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        got = "missing" if key not in data else f"{shown(value)}"
        raise MemplanError(f"{where}: {key} is {got}, not {_KINDS[kind]} (a `memplan profile` "
                           "summary has phases by step with peak_bytes)")
    return value


_KINDS = {dict: "an object", int: "an integer", list: "a list"}


def _bytes(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MemplanError(f"{where} is {shown(value)}, not a byte count")
    return value


def _phases(raw: Any, step: int, where: str) -> dict[str, PhasePeak]:
    if not isinstance(raw, dict):
        raise MemplanError(f"{where}: phases.{step} is {shown(raw)}, not an object")
    out = {}
    for phase, v in raw.items():
        at = f"{where}: phases.{step}.{phase}"
        if not isinstance(v, dict):
            raise MemplanError(f"{at} is {shown(v)}, not an object")
        cats = v.get("by_category", {})
        if not isinstance(cats, dict):
            raise MemplanError(f"{at}.by_category is {shown(cats)}, not an object")
        reserved = v.get("reserved_bytes")
        out[phase] = PhasePeak(
            step, phase, _bytes(v.get("peak_bytes"), f"{at}.peak_bytes"),
            {k: _bytes(b, f"{at}.by_category.{k}") for k, b in cats.items()},
            None if reserved is None else _bytes(reserved, f"{at}.reserved_bytes"))
    return out


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
        if cache > NOTABLE_CACHE_FRACTION * peak.reserved_bytes:
            out.append(Finding("fragmentation", "measured: {cache_bytes} reserved but unallocated "
                               "at the peak, above the "
                               f"{NOTABLE_CACHE_FRACTION:.0%} of the reserved bytes; "
                               "expandable_segments:True reduces it",
                               {"cache_bytes": cache}, cause=True))
    out += [Finding("profile_warning", w.replace("{", "{{").replace("}", "}}"))
            for w in m.warnings]
    return out
