"""Which layers each pipeline rank holds, and how many micro-batches it keeps in flight.

1F1B (PipeDream-Flush, Narayanan et al. 2021): rank i holds min(m, p - i) micro-batches of
activations at its peak. Interleaved 1F1B with v chunks per rank (Megatron-LM's
``forward_backward_pipelining_with_interleaving``): rank i runs (p - i - 1) * 2 + (v - 1) * p
warm-up chunk-forwards plus one, in order of groups of p micro-batches per chunk; with groups of N
micro-batches (``vpp_group``, Megatron-LM's microbatch_group_size_per_vp_stage) (v - 1) * N in
place of (v - 1) * p (``get_pp_rank_microbatches``), in the order of ``get_schedule_table``: each
group of N (the last of m mod N) through chunk 0, then chunk 1, .... GPipe keeps all m
micro-batches of every stage.
"""

from __future__ import annotations

from itertools import accumulate

from memplan.choices import PlainEnum
from memplan.parallel import ParallelConfig, virtual_stage_layers


class Schedule(PlainEnum):
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
    group = par.vpp_group or p
    warmup = min(m * v, (p - stage - 1) * 2 + (v - 1) * group + 1)
    counts = [0] * v
    if m % group == 0:
        # the k-th chunk-forward goes to chunk (k // group) % v: ``full`` whole groups of
        # ``group`` chunk-forwards, group g to chunk g % v, then ``rest`` to chunk full % v
        full, rest = divmod(warmup, group)
        rounds, extra = divmod(full, v)
        counts = [group * (rounds + (c < extra)) for c in range(v)]
        counts[extra] += rest
        return counts
    order = [c for start in range(0, m, group)  # get_schedule_table's chunk order
             for c in range(v) for _ in range(min(group, m - start))]
    for c in order[:warmup]:
        counts[c] += 1
    return counts
