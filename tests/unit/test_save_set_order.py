"""``--recompute auto``'s search of the save-set frontier (``memplan.planning.save_sets.
choose``) without assuming that a stage's peak rises with a set's bytes.

It does not always: a set of fewer bytes made early in the layer (the projections) holds
more at the checkpointed forward's peak than one of more bytes made late (the MLP's). On
a one-layer model of 16 heads of 64 (q 1,024 wide on h 128), seq 1,024, micro-batch 4, the
frontier's 53rd set peaks 1,064,960 bytes above the 54th, which keeps more. What does hold:
a set enters the estimate only through its layer's saved bytes and forward peak
(``memplan.model.layer.ops_kind``), each added with a nonnegative count at every moment of
a stage's walk, so the peak cannot fall as both grow. It is checked here over every pair
of frontier sets of several configurations, and the search is checked against brute force
at every budget.
"""

from __future__ import annotations

import itertools
import random

import pytest
from memplan.api import estimate, resolve
from memplan.model.dims import Dims
from memplan.model.estimate import resolve_split
from memplan.model.layer import layer_kind, ops_forward_peaks, ops_items
from memplan.planning.save_sets import Choice, choose, frontier
from memplan.spec import ModelSpec, load_model
from memplan.workload import Recompute

TINY = load_model("tiny")


def _variant(**update) -> ModelSpec:
    return ModelSpec.model_validate({**TINY.model_dump(), **update})


# one layer, q (1,024) eight times h: the projections' outputs are large and made early
WIDE_Q = _variant(name="tiny-wide-q", num_layers=1, vocab_size=8, hidden_size=128,
                  ffn_hidden_size=384, num_attention_heads=16, num_kv_heads=16, head_dim=64)
WIDE_Q_RUN = dict(seq_len=1024, micro_batch_size=4)


def _frontier(spec: ModelSpec, **fields):
    spec, par, wl = resolve(spec, recompute="ops", **fields)
    par = resolve_split(spec, par, wl)
    dm = Dims.of(spec, par, wl)
    sets = frontier(ops_items(spec, wl, dm))
    return sets, ops_forward_peaks(spec, wl, dm, sets), (spec, wl, dm)


def _peaks(spec: ModelSpec, sets, **fields) -> list[tuple[int, ...]]:
    return [tuple(s.peak_bytes for s in estimate(spec, recompute="ops", recompute_save=list(
        c.kept), **fields).stages) for c in sets]


def test_the_peak_can_fall_as_kept_bytes_grow() -> None:
    """The bytes-only order fails on ``WIDE_Q``: adjacent frontier sets whose peaks fall, by
    at most 1,064,960 B (T = 4 x 1,024 tokens): the 53rd set keeps the attention norm's output
    T*h*e = 4,096 x 128 x 2 = 1,048,576 B and statistics T*4 = 16,384 B, made early and alive
    at the MLP's moments (the forward's peak); the 54th keeps the gate projection's output
    instead, made there. (2,113,536 B while a kept MLP norm output was counted twice at the
    MLP's moments: ``memplan.model.sac_ops.input_held``.)"""
    sets, _, _ = _frontier(WIDE_Q, **WIDE_Q_RUN)
    peaks = [p[0] for p in _peaks(WIDE_Q, sets, **WIDE_Q_RUN)]
    falls = [peaks[i] - peaks[i + 1] for i in range(len(sets) - 1) if peaks[i] > peaks[i + 1]]
    assert max(falls) == peaks[52] - peaks[53] == 1_064_960
    assert {"attn_norm.output", "attn_norm.stats"} <= set(sets[52].kept) - set(sets[53].kept)
    assert "mlp.gate" in set(sets[53].kept) - set(sets[52].kept)


def test_choose_is_exact_at_every_budget() -> None:
    """At each set's own peak (and a byte below it) as the budget, ``choose`` given the
    forward peaks returns the set of most bytes whose peak fits (brute force); taking the
    peaks to rise with the bytes alone (no forward peaks) misses it at some budget."""
    sets, forward, _ = _frontier(WIDE_Q, **WIDE_Q_RUN)
    peaks = {c.kept: p[0] for c, p in zip(sets, _peaks(WIDE_Q, sets, **WIDE_Q_RUN))}
    wrong = 0
    for budget in sorted({b - d for b in peaks.values() for d in (0, 1)}):
        want = max((i for i, c in enumerate(sets) if peaks[c.kept] <= budget), default=None)

        def fits(kept: tuple[str, ...]) -> bool:
            return peaks[kept] <= budget

        got, _ = choose(sets, fits, forward=forward)
        assert (None if got is None else sets.index(got)) == want, budget
        got, _ = choose(sets, lambda kept: budget - peaks[kept], forward=forward)
        assert (None if got is None else sets.index(got)) == want, budget
        old, _ = choose(sets, fits)
        wrong += (None if old is None else sets.index(old)) != want
    assert wrong > 0


def test_forward_peaks_are_the_layer_kinds() -> None:
    """``ops_forward_peaks`` (no estimate) equals the layer kind's forward peak under
    ``Recompute.OPS`` for every set of the frontier."""
    sets, forward, (spec, wl, dm) = _frontier(WIDE_Q, **WIDE_Q_RUN)
    for c, peak in zip(sets, forward):
        swl = wl.model_copy(update={"recompute_save": c.kept})
        assert layer_kind(spec, swl, dm, False, Recompute.OPS).forward_peak_bytes == peak


CONFIGS = [
    (WIDE_Q, dict(WIDE_Q_RUN)), (WIDE_Q, dict(seq_len=128, micro_batch_size=1)),
    (TINY, dict(seq_len=1024, micro_batch_size=2)),
    (TINY, dict(seq_len=512, micro_batch_size=1, gpus=2, tp=2)),
    (TINY, dict(seq_len=512, micro_batch_size=1, gpus=2, pp=2, global_batch_size=8)),
    (TINY, dict(seq_len=256, micro_batch_size=2, norm_impl="fused")),
    (_variant(name="tiny-1l", num_layers=1, vocab_size=8),
     dict(seq_len=1024, micro_batch_size=4)),
]


@pytest.mark.parametrize(("spec", "fields"), CONFIGS,
                         ids=[f"{s.name}-{'-'.join(map(str, f.values()))}" for s, f in CONFIGS])
def test_peak_rises_with_bytes_and_forward_peak(spec: ModelSpec, fields: dict) -> None:
    """Every pair of frontier sets A before B (B keeps more bytes) with A's forward peak no
    higher than B's: no stage of A peaks above B's."""
    sets, forward, _ = _frontier(spec, **fields)
    peaks = _peaks(spec, sets, **fields)
    bad = [(i, j) for i, j in itertools.combinations(range(len(sets)), 2)
           if forward[i] <= forward[j] and any(a > b for a, b in zip(peaks[i], peaks[j]))]
    assert not bad


def test_choose_against_brute_force_on_random_orders() -> None:
    """Random frontiers (bytes rising, forward peaks in any order) and a peak that rises
    with both: ``choose`` finds the last set that fits at every budget, asking no more
    than once per set, whether ``fits`` answers yes or no or how far from the budget."""
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 24)
        sizes = sorted(rng.sample(range(1, 10_000), n - 1))
        sets = tuple(Choice(((f"s{i}",) if i else ()), b, float(n - i))
                     for i, b in enumerate([0] + sizes))
        forward = tuple([0] + [rng.randint(0, 5_000) for _ in range(n - 1)])
        scale = rng.randint(1, 4)
        peak = {c.kept: scale * c.kept_bytes + f for c, f in zip(sets, forward)}
        for budget in rng.sample(range(0, 30_000), 6):
            want = max((i for i, c in enumerate(sets) if peak[c.kept] <= budget), default=None)
            got, asked = choose(sets, lambda kept: peak[kept] <= budget, forward=forward)
            assert (None if got is None else sets.index(got)) == want
            assert asked <= n
            # told how far each set is from the budget, it guesses its probes: same answer
            got, asked = choose(sets, lambda kept: budget - peak[kept], forward=forward)
            assert (None if got is None else sets.index(got)) == want
            assert asked <= n
