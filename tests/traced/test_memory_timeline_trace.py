"""The memory timeline read from files torch itself writes, made here on the CPU.

- A torch.profiler trace made now by ``tests/data/memory/make_profiler_trace.py`` (two AdamW
  steps of a small MLP, profile_memory=True): the same invariants as the committed one
  (tests/unit/test_memory_timeline.py), so the reader follows what this torch writes.
- The synthetic snapshot of tests/unit/test_memory_timeline.py given to torch's own reader of
  snapshots (``torch.cuda._memory_viz.trace_plot`` and ``segment_plot``, pure Python): it takes
  the structure as its own.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from memplan.measure.memory_timeline import profiler_timelines  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_fresh_cpu_trace(tmp_path) -> None:
    """Step 1's optimizer step leaves AdamW's states (2 x 2,102,272 B) and four 4 B step
    counts behind; step 2's nothing; the forward of step 1 peaks at two 64 x 1024 fp32
    activations (524,288 B)."""
    out = tmp_path / "fresh.pt.trace.json.gz"
    # in a fresh interpreter: the CPU profiler records every allocation of the process, and
    # threads other tests leave behind (event writers, process groups) allocate too
    subprocess.run([sys.executable, str(ROOT / "tests" / "data" / "memory" /
                                        "make_profiler_trace.py"), str(out)],
                   check=True, cwd=ROOT)
    (tl,) = profiler_timelines(str(out))
    peaks = {(r["step"], r["phase"]): r["peak_allocated_bytes"] for r in tl.phase_peaks()}
    assert peaks[(1, "forward")] == 524_288
    import gzip
    import json

    raw = json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    mem = sorted((e for e in raw if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    net: dict[tuple[int, str], int] = {}
    for point, e in zip(tl.points, mem):
        key = (point.step, point.phase)
        net[key] = net.get(key, 0) + e["args"]["Bytes"]
    assert net[(1, "optimizer step")] == 2 * 2_102_272 + 16
    assert net[(2, "optimizer step")] == 0


def test_torch_reads_the_synthetic_snapshot() -> None:
    from torch.cuda import _memory_viz

    unit = _load(ROOT / "tests" / "unit" / "test_memory_timeline.py", "unit_timeline")
    snap = unit.synthetic_snapshot()
    assert "<html" in _memory_viz.trace_plot(snap).lower()
    assert "<html" in _memory_viz.segment_plot(snap).lower()
