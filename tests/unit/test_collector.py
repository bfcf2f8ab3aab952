"""The collector around a pass (``memplan.model.collector``) is left as it was found, and the
passes it wraps give the same answers."""

from __future__ import annotations

import gc

import pytest

import memplan
from memplan.model import collector
from memplan.model.collector import collector_paused, with_older_frozen


def _state() -> tuple[bool, int]:
    return gc.isenabled(), gc.get_freeze_count()


def _seen() -> tuple[bool, int]:
    """What the wrapped function sees."""
    return _state()


def _nested() -> tuple[tuple[bool, int], int]:
    """What a wrapped call inside a wrapped call sees, and the frozen count after it."""
    return with_older_frozen(_seen)(), gc.get_freeze_count()


def _fails() -> None:
    raise ValueError("inside")


def test_older_frozen_during_the_call_only():
    assert _state() == (True, 0)
    held = [[n] for n in range(10)]  # (tracked objects made before the call)
    enabled, frozen = with_older_frozen(_seen)()
    assert enabled and frozen >= 1
    # a call inside the call (an estimate inside a plan) leaves the outer one's frozen
    (_, inside), after_inner = with_older_frozen(_nested)()
    assert inside >= 1 and after_inner >= 1
    assert _state() == (True, 0)
    with pytest.raises(ValueError, match="inside"):
        with_older_frozen(_fails)()
    assert _state() == (True, 0)
    del held


def test_a_callers_freeze_and_a_disabled_collector_are_kept(monkeypatch):
    monkeypatch.setattr(collector, "_CALLER_FREEZES", [False])
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        # not frozen again (that would add every object made since), not undone (0); a frozen
        # object can die by reference counting meanwhile, which lowers the count (fresh-clone
        # runs freed 2 before the call and 2 after it), so the count is bounded, not equal
        enabled, inside = with_older_frozen(_seen)()
        assert enabled and 0 < inside <= before
        # not unfrozen after (that empties the permanent generation)
        assert 0 < gc.get_freeze_count() <= inside
    finally:
        gc.unfreeze()
    # once seen, never again: the count walks every frozen object
    assert collector._CALLER_FREEZES == [True]
    assert with_older_frozen(_seen)() == (True, 0)
    gc.disable()
    try:
        assert with_older_frozen(_seen)() == (False, 0)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_paused_restores_the_collector():
    with pytest.raises(ValueError, match="inside"):
        with collector_paused():
            _fails()
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: the outer pause holds
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_estimate_and_plan_leave_the_collector_as_found():
    """``memplan.model.estimate.estimate`` and ``memplan.planning.planner.plan`` freeze the
    older objects for their call: the collector as found after each, and an estimate asked
    with the collector off gives the same record."""
    from memplan.model.estimate import estimate

    spec, gpu = memplan.load_model("gpt2"), memplan.load_gpu("h100-sxm")
    par = memplan.make_layout(8, tp=2, pp=2, zero=1)
    wl = memplan.make_workload(spec, micro_batch_size=2)
    first = estimate(spec, gpu, par, wl)
    assert _state() == (True, 0)
    gc.disable()
    try:
        assert estimate(spec, gpu, par, wl) == first
    finally:
        gc.enable()
    assert memplan.plan("gpt2", gpus=8, top=2).candidates
    assert _state() == (True, 0)
