"""Which layers each pipeline rank holds, and how many micro-batches it keeps in flight.

1F1B (PipeDream-Flush, Narayanan et al. 2021): rank i holds min(m, p - i) micro-batches of
activations at its peak. Interleaved 1F1B with v chunks per rank (Megatron-LM's
``forward_backward_pipelining_with_interleaving``): rank i runs (p - i - 1) * 2 + (v - 1) * p
warm-up chunk-forwards plus one, in order of groups of p micro-batches per chunk. GPipe keeps all
m micro-batches of every stage.
"""

from __future__ import annotations

import enum
from itertools import accumulate

from memplan.parallel import ParallelConfig, virtual_stage_layers


class Schedule(str, enum.Enum):
    ONE_F_ONE_B = "1f1b"  # interleaved when vpp > 1
    GPIPE = "gpipe"


def stage_layers(num_layers: int, par: ParallelConfig, stage: int) -> list[list[int]]:
    """Layer indices of each model chunk on pipeline rank ``stage``."""
    counts = virtual_stage_layers(num_layers, par)
    starts = [0, *accumulate(counts)]
    return [list(range(starts[c * par.pp + stage], starts[c * par.pp + stage + 1]))
            for c in range(par.vpp)]


def chunks_in_flight(par: ParallelConfig, num_microbatches: int, stage: int,
                     schedule: Schedule = Schedule.ONE_F_ONE_B) -> list[int]:
    """Micro-batches of activations each chunk of rank ``stage`` holds at the rank's peak."""
    p, v, m = par.pp, par.vpp, num_microbatches
    if schedule is Schedule.GPIPE:
        return [m] * v
    if v == 1:
        return [min(m, p - stage)]
    warmup = min(m * v, (p - stage - 1) * 2 + (v - 1) * p + 1)
    counts = [0] * v
    for k in range(warmup):  # the k-th chunk-forward goes to chunk (k // p) % v
        counts[(k // p) % v] += 1
    return counts
