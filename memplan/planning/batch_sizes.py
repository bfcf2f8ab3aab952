"""The micro-batch sizes a layout can run at a global batch size: the planner's search space.

Torch-free and below both users: ``memplan.planning.planner`` searches these sizes, and
calibration's ``calibrate_plan`` re-searches each planned candidate's micro-batch over the same
ones without importing the planner (which sits above calibration).
"""

from __future__ import annotations

import math
from functools import lru_cache
from memplan.parallel import ParallelConfig, interleaved_rule, pipeline_only

# The largest micro-batch the planner searches: a stated bound of the search, not a device limit.
MAX_MBS = 64


@lru_cache(maxsize=1024)  # a search asks for the same few batch sizes' divisors per layout
def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending (trial division to sqrt(n): for counts of
    layers, experts and batches, which the specs and workloads bound)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def micro_batch_sizes(par: ParallelConfig, global_batch_size: int) -> tuple[int, ...]:
    """Micro-batch sizes up to ``MAX_MBS`` that divide the per-replica batch
    (``global_batch_size // dp``); with interleaving (vpp > 1) the micro-batch count must also
    split into the schedule's groups (``interleaved_rule``: divide by pp with Megatron-LM's
    default group of pp)."""
    # what the sizes read of the layout: its replica count and its interleaving
    return _sizes(global_batch_size // par.dp, par.pp, par.vpp, par.vpp_group)


@lru_cache(maxsize=4096)
def _sizes(per_replica: int, pp: int, vpp: int, group: int | None) -> tuple[int, ...]:
    # only sizes up to MAX_MBS are searched: try those, not every divisor of a large batch
    par = pipeline_only(pp, vpp, vpp_group=group)
    return tuple(b for b in range(1, min(MAX_MBS, per_replica) + 1) if per_replica % b == 0
                 and interleaved_rule(par, per_replica // b) is None)


__all__ = ["MAX_MBS", "divisors", "micro_batch_sizes"]
