"""The quick CPU calibration grid's points traced once per test session.

``memplan calibrate --device cpu --quick`` traces ten points of the CPU reference model
(``memplan.calibrate.grid.device_grid("cpu", quick=True)``) with the exact tracker on real,
seeded CPU tensors; tests/traced/test_calibrate.py runs that grid twice (the Ctrl-C test and
``cpu_run``) and tests/traced/test_readme.py once more (docs/calibration.md's command). The
tracker's bytes of a point do not change from one run to the next (the same spec, workload,
seed and steps; only a step's time would), so each point is traced the first time a run asks
for it and its record is handed again, under the asking run's meta, when it comes back.
"""

from __future__ import annotations

from typing import Any

import pytest

_TRACED: dict[str, Any] = {}


def cpu_points_traced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``calibrate_run.measure_cpu`` traces each point once in the session (until the
    monkeypatch is undone)."""
    from memplan.profile import calibrate_run

    real = calibrate_run.measure_cpu

    def once(point: Any, meta: Any, steps: int) -> Any:
        key = repr((point.key, point.spec.model_dump(mode="json"),
                    point.layout.model_dump(mode="json"),
                    point.workload.model_dump(mode="json"), steps))
        if key not in _TRACED:
            _TRACED[key] = real(point, meta, steps)
        return _TRACED[key].model_copy(update={"meta": meta})

    monkeypatch.setattr(calibrate_run, "measure_cpu", once)
