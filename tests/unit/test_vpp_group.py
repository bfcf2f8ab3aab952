"""Interleaved 1F1B with micro-batch groups other than pp (Megatron-LM's
--microbatch-group-size-per-virtual-pipeline-stage N, ``vpp_group``): the warm-up forwards
(pp - rank - 1) * 2 + (chunks - 1) * N (pipeline_parallel/schedules.py
get_pp_rank_microbatches) plus the steady state's one, in get_schedule_table's order (each
group through chunk 0, then chunk 1, ...); the batch rule of
forward_backward_pipelining_with_interleaving: pp <= N <= m, m mod N zero or at least pp."""

from __future__ import annotations

import pytest

import memplan
from memplan.errors import LayoutError
from memplan.model.pipeline import chunks_in_flight
from memplan.parallel import (
    INTERLEAVED_GROUPS,
    INTERLEAVED_MICROBATCHES,
    ParallelConfig,
    resolve_batch,
)
from memplan.workload import Workload


@pytest.mark.parametrize(("pp", "m", "group", "stage", "want"), [
    # pp 4, 2 chunks, m 6 in one group of 6: rank 0 warms up 3*2 + 6 = 12 >= m*v = 12: all;
    # rank 3: 0 + 6 + 1 = 7 forwards: the group's 6 through chunk 0, one through chunk 1
    (4, 6, 6, 0, [6, 6]),
    (4, 6, 6, 3, [6, 1]),
    # pp 2, m 5 in groups of 3 and 2 (2 >= pp): order 0,0,0,1,1,1,0,0,1,1; rank 1 runs
    # 0 + 3 + 1 = 4 forwards: 0,0,0,1; rank 0 2 + 3 + 1 = 6: 0,0,0,1,1,1
    (2, 5, 3, 1, [3, 1]),
    (2, 5, 3, 0, [3, 3]),
    # the default group (pp): (k // pp) % v, as before: pp 2, m 4, rank 1: 0 + 2 + 1 = 3
    # forwards: 0,0,1
    (2, 4, None, 1, [2, 1]),
])
def test_chunks_in_flight_with_groups(pp: int, m: int, group: int | None, stage: int,
                                      want: list[int]) -> None:
    par = ParallelConfig(pp=pp, vpp=2, vpp_group=group)
    assert chunks_in_flight(par, m, stage) == want


@pytest.mark.parametrize(("group", "rule"), [
    (None, INTERLEAVED_MICROBATCHES),  # 6 micro-batches over pp 4: Megatron raises
    (5, INTERLEAVED_GROUPS),  # 6 mod 5 = 1 < pp 4
    (3, INTERLEAVED_GROUPS),  # a group below pp
    (7, INTERLEAVED_GROUPS),  # a group above m
])
def test_batch_rule(group: int | None, rule: str) -> None:
    par = ParallelConfig(pp=4, vpp=2, vpp_group=group)
    with pytest.raises(LayoutError) as err:
        resolve_batch(par, Workload(micro_batch_size=1, global_batch_size=6, seq_len=128))
    assert err.value.rule == rule


def test_six_micro_batches_over_four_stages() -> None:
    """pp 4, vpp 2, m 6 runs with groups of 6; rank 0 keeps all 12 chunk-forwards (6
    micro-batches of each of its 2 chunks), rank 3 seven (6 + 1): at most 6 of one chunk."""
    par = ParallelConfig(pp=4, vpp=2, vpp_group=6)
    assert resolve_batch(par, Workload(micro_batch_size=1, global_batch_size=6,
                                       seq_len=128)) == (6, 6)
    est = memplan.estimate("llama-2-7b", gpus=4, pp=4, vpp=2, vpp_group=6, seq_len=128,
                           global_batch_size=6)
    assert [s.microbatches_in_flight for s in est.stages] == [6, 6, 6, 6]
    with pytest.raises(memplan.MemplanError):
        memplan.estimate("llama-2-7b", gpus=4, pp=4, vpp=2, seq_len=128, global_batch_size=6)


def test_plan_keeps_a_given_group() -> None:
    """A plan with 6 micro-batches over pp 4: interleaving only with groups of 6."""
    kw = dict(gpus=4, pp=4, tp=1, cp=1, zero=1, seq_len=128, global_batch_size=6)
    grouped = memplan.plan("llama-2-7b", vpp_group=6, **kw)
    assert {c.layout.vpp_group for c in grouped.candidates if c.layout.vpp > 1} == {6}
    assert any(c.layout.vpp > 1 for c in grouped.candidates)
    plain = memplan.plan("llama-2-7b", **kw)
    assert all(c.layout.vpp == 1 for c in plain.candidates)
