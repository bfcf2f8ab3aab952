"""The data the plots draw, not their pixels: the timeline's optimizer layers (made at setup;
states from step 1's optimizer step, as ``memplan.model.stage`` splits a first step's peaks)
and the monitor's headroom (a band under the capacity line, a panel scaled to it, or a word
in the title). torch-free, matplotlib-free."""

from __future__ import annotations

from memplan.measure.timeline import Sample, Timeline
from memplan.report.plot_monitor import headroom_view, least_headroom
from memplan.report.plot_timeline import (
    SETUP_LAYER,
    STATES_LAYER,
    setup_optimizer_bytes,
    stack_layers,
)

MiB, GiB = 2**20, 2**30

# 100 MiB of bf16 weights (50 Mi parameters): an fp32 master copy of 200 MiB made at setup, AdamW's
# two fp32 moments (400 MiB) made by step 1's optimizer step, counted as optimizer bytes from
# there on (the tracker relabels them as they are made).
ROWS = [  # (step, phase, optimizer bytes, activations bytes)
    (0, "forward", 0, 0),  # setup: the weights only
    (0, "forward", 200, 0),  # setup: the master copy made with the optimizer
    (1, "forward", 200, 0), (1, "forward", 200, 300), (1, "backward", 200, 100),
    (1, "optimizer", 200, 0), (1, "optimizer", 600, 0),
    (2, "forward", 600, 300), (2, "backward", 600, 100), (2, "optimizer", 600, 0)]


def _timeline(rows=ROWS) -> Timeline:
    samples = [Sample(index=k, step=st, phase=ph, total_bytes=(100 + opt + act) * MiB,
                      time_s=0.1 * k, by_category={"parameters": 100 * MiB,
                                                   "optimizer": opt * MiB,
                                                   "activations": act * MiB})
               for k, (st, ph, opt, act) in enumerate(rows)]
    return Timeline(device="cpu-tracker", source="exact tensor tracker (test)", num_steps=2,
                    samples=samples)


def test_master_copy_from_setup_states_from_the_first_optimizer_step():
    """The master copy (200 MiB, alive when step 1 starts) is its own layer from the sample
    that made it, through step 1; the optimizer states layer is 0 until step 1's optimizer
    step made the 400 MiB of moments, then 400 MiB (the old plot drew all 600 MiB as optimizer
    states, and 200 of them from the start of step 1)."""
    tl = _timeline()
    assert setup_optimizer_bytes(tl) == 200 * MiB
    layers = stack_layers(tl)
    assert [v // MiB for v in layers[SETUP_LAYER]] == [0, 200, 200, 200, 200, 200, 200, 200,
                                                       200, 200]
    assert [v // MiB for v in layers[STATES_LAYER]] == [0, 0, 0, 0, 0, 0, 400, 400, 400, 400]
    first_states = next(k for k, v in enumerate(layers[STATES_LAYER]) if v)
    assert (tl.samples[first_states].step, tl.samples[first_states].phase) == (1, "optimizer")
    # the layers sum to the categorised bytes, sample by sample
    for k, s in enumerate(tl.samples):
        assert sum(v[k] for v in layers.values()) == sum(s.by_category.values())
    assert list(layers) == ["parameters", "gradients", SETUP_LAYER, STATES_LAYER, "activations",
                            "temporaries"]


def test_no_master_copy_no_setup_layer():
    """bf16-pure (the optimizer updates the weights): no optimizer bytes when step 1 starts,
    so all of them are states, from step 1's optimizer step."""
    rows = [(st, ph, 0 if opt == 200 else opt - 200 if opt else 0, act)
            for st, ph, opt, act in ROWS]
    layers = stack_layers(_timeline(rows))
    assert setup_optimizer_bytes(_timeline(rows)) == 0 and not any(layers[SETUP_LAYER])
    assert [v // MiB for v in layers[STATES_LAYER]] == [0, 0, 0, 0, 0, 0, 400, 400, 400, 400]


def _recs(rank, mem, cap, rooms, key="peak_bytes"):
    return [{"rank": rank, "step": k, key: mem, "capacity_bytes": cap, "headroom_bytes": room}
            for k, room in enumerate(rooms, start=1)]


def test_headroom_view():
    """A band where the capacity line is drawn (30 GiB of 80 reaches its quarter); a panel
    where the capacity is off the scale (1 GiB of a 64 GiB host) and the headroom moves; the
    title where it does not move; nothing without headroom."""
    assert headroom_view({0: _recs(0, 30 * GiB, 80 * GiB, [50 * GiB] * 3)}) == "band"
    host = _recs(0, GiB, 64 * GiB, [40 * GiB, 39 * GiB, 38 * GiB], key="rss_bytes")
    assert headroom_view({0: host}) == "panel"
    flat = _recs(0, GiB, 64 * GiB, [40 * GiB] * 3, key="rss_bytes")
    assert headroom_view({0: flat}) == "title"
    assert headroom_view({0: [{"rank": 0, "step": 1, "peak_bytes": GiB}]}) is None
    # two capacities (ranks on different GPUs): no one line, so the panel
    mixed = {0: _recs(0, 30 * GiB, 80 * GiB, [50 * GiB, 49 * GiB]),
             1: _recs(1, 30 * GiB, 40 * GiB, [10 * GiB, 9 * GiB])}
    assert headroom_view(mixed) == "panel"


def test_least_headroom_across_ranks():
    """Step by step, the smaller of the ranks' headroom: rank 1 leaks 1 GiB a step from
    48 GiB, rank 0 holds 47 GiB, so 47, 46, 45 (rank 0, then rank 1 twice)."""
    recs = {0: _recs(0, 30 * GiB, 80 * GiB, [47 * GiB] * 3),
            1: _recs(1, 31 * GiB, 80 * GiB, [47 * GiB, 46 * GiB, 45 * GiB])}
    recs[1][0]["headroom_bytes"] = 48 * GiB
    assert least_headroom(recs) == [(1, 47 * GiB), (2, 46 * GiB), (3, 45 * GiB)]
