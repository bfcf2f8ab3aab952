"""All rendering: JSON with int bytes, and text, tables and plots with sizes in GiB (2^30),
labelled. The only place bytes become GiB (``memplan.report.sizes``).

One module per command's output: ``estimate`` (also ``memplan.check``'s error), ``plan``,
``diagnose``, ``catalog``, ``monitor``, ``calibration``. The estimate's are imported here, as
every command that prints an estimate needs them; the others by their module.
"""

from __future__ import annotations

from memplan.report.estimate import (
    does_not_fit,
    estimate_json,
    render_estimate,
    stage_json,
    time_json,
)

__all__ = ["does_not_fit", "estimate_json", "render_estimate", "stage_json", "time_json"]
