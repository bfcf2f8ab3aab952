"""The micro-batch sizes the planner and calibration's re-check search
(``memplan.planning.batch_sizes``)."""

from __future__ import annotations

from memplan.calibrate import apply
from memplan.parallel import ParallelConfig
from memplan.planning import planner
from memplan.planning.batch_sizes import MAX_MBS, divisors, micro_batch_sizes


def test_sizes_by_hand() -> None:
    """24 samples per replica: 1, 2, 3, 4, 6, 8, 12, 24; interleaved on pp 4 the count 24 / b
    must also divide by 4: 1, 2, 3, 6. Never above the search bound."""
    assert divisors(24) == [1, 2, 3, 4, 6, 8, 12, 24]
    assert micro_batch_sizes(ParallelConfig(dp=2), 48) == (1, 2, 3, 4, 6, 8, 12, 24)
    assert micro_batch_sizes(ParallelConfig(pp=4, vpp=2, dp=2), 48) == (1, 2, 3, 6)
    assert max(micro_batch_sizes(ParallelConfig(), 1024)) == MAX_MBS == 64


def test_one_definition() -> None:
    """The planner and the calibrated re-check use this module's sizes, not copies."""
    assert planner.micro_batch_sizes is micro_batch_sizes
    assert apply.micro_batch_sizes is micro_batch_sizes
