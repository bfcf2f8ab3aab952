"""The Python API's results read as plain values: no ``<Recompute.NONE: 0>`` in what
``print(result)``, a notebook cell (``repr``) or a field shows; each choice compares equal to,
prints as and serialises as its string or int, and the ordered ones keep their order."""

from __future__ import annotations

import enum
import json
import re

import pytest

import memplan
from memplan.choices import PlainEnum, PlainIntEnum
from memplan.parallel import Offload, ZeroStage
from memplan.workload import Precision, Recompute

ENUM_REPR = re.compile(r"<[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_0-9]+: ")


def _enum_classes() -> list[type[enum.Enum]]:
    """Every enum defined in memplan's modules that results carry (the CLI's option choices
    excepted: typer shows them, no result holds them)."""
    import importlib
    import pkgutil

    found = []
    for info in pkgutil.walk_packages(memplan.__path__, "memplan."):
        if info.name.startswith(("memplan.cli", "memplan.profile", "memplan.__main__")):
            continue
        module = importlib.import_module(info.name)
        found += [v for v in vars(module).values() if isinstance(v, type)
                  and issubclass(v, enum.Enum) and v.__module__ == info.name]
    return found


def _shown(value: object) -> str:
    return f"{value!r}\n{value!s}"


def test_estimate_shows_no_enum_reprs():
    est = memplan.estimate("llama-2-7b", gpus=8, gpu="h100", zero=1, micro_batch_size=2,
                           recompute="selective", offload="optimizer")
    text = _shown(est) + _shown(est.workload) + _shown(est.parallel) + _shown(est.spec)
    assert not ENUM_REPR.findall(text)
    assert "recompute='selective'" in repr(est.workload) and "zero=1," in repr(est.parallel)
    assert "precision='bf16-mixed'" in repr(est.workload)
    assert "offload=frozenset({'optimizer'})" in repr(est.parallel)


def test_plan_and_check_show_no_enum_reprs():
    result = memplan.plan("llama-2-7b", gpus=8, gpu="h100", top=3)
    best = result.candidates[0]
    assert not ENUM_REPR.findall(_shown(result) + _shown(best) + _shown(best.layout))
    assert repr(best.recompute) == "'none'" and repr(best.layout.zero) == "1"
    assert not ENUM_REPR.findall(_shown(memplan.check("gpt2", gpus=1)))
    layout = memplan.make_layout(8, tp=2, zero=3, tp_style="dtensor", grad_buffers="copy")
    wl = memplan.make_workload(memplan.load_model("gpt2"), recompute="full", precision="fp32")
    assert not ENUM_REPR.findall(_shown(layout) + _shown(wl))


def test_choices_are_plain_values():
    """Equal to their values, shown as them in str, format and repr, the same in JSON."""
    est = memplan.estimate("llama-2-7b", gpus=8, gpu="h100", zero=2, recompute="full",
                           precision="fp16-mixed")
    wl, par = est.workload, est.parallel
    assert (wl.recompute, par.zero, wl.precision, wl.optimizer) == ("full", 2, "fp16-mixed",
                                                                     "adamw")
    assert isinstance(wl.recompute, str) and isinstance(par.zero, int)
    assert f"{wl.recompute} {par.zero} {wl.precision}" == "full 2 fp16-mixed"
    assert (str(wl.recompute), repr(wl.recompute), str(par.zero), repr(par.zero)) == (
        "full", "'full'", "2", "2")
    assert json.dumps([wl.recompute, par.zero, wl.precision]) == '["full", 2, "fp16-mixed"]'
    # the workload and layout a JSON output echoes (``trace --json``, timeline.json, records)
    dumped = {**wl.model_dump(mode="json"), **par.model_dump(mode="json")}
    assert (dumped["recompute"], dumped["zero"], dumped["precision"]) == ("full", 2, "fp16-mixed")
    # a dict keyed by the plain value finds the member, and the other way round
    assert {"full": 1}[wl.recompute] == 1 and {Recompute.FULL: 1}["full"] == 1
    # the name is still there for who wants it
    assert (wl.recompute.name, par.zero.name) == ("FULL", "GRADIENTS")


def test_ordered_levels_keep_their_order():
    """ZeRO stages compare as ints; recompute policies by declaration (memory saved), not
    alphabetically ("full" < "none" as text), with each other and with their values."""
    assert ZeroStage.GRADIENTS >= 2 and ZeroStage.OPTIMIZER < ZeroStage.PARAMETERS
    assert Recompute.NONE < Recompute.SELECTIVE < Recompute.FULL
    assert max(Recompute) is Recompute.FULL and min(Recompute) is Recompute.NONE
    assert Recompute.NONE < "full" and "full" > Recompute.SELECTIVE
    assert sorted(["full", Recompute.NONE, Recompute.SELECTIVE]) == ["none", "selective", "full"]
    with pytest.raises(TypeError, match="compares with 'none', 'selective', 'ops', 'full', not 'x'"):
        _ = Recompute.NONE < "x"
    with pytest.raises(TypeError):
        _ = Recompute.NONE < 0


def test_recompute_reads_names_and_old_ranks():
    """Records written while the policies were ints 0, 1, 2 still read (calibration/records
    hold ``"recompute": 0``); names in any case; anything else is refused by name."""
    gpt2 = memplan.load_model("gpt2")
    assert [memplan.make_workload(gpt2, recompute=r).recompute for r in (0, 1, 2)] == [
        "none", "selective", "full"]
    assert Recompute.parse("Selective") is Recompute.SELECTIVE
    with pytest.raises(memplan.MemplanError, match="recompute must be none, selective, ops or full"):
        Recompute.parse(3)
    with pytest.raises(memplan.MemplanError, match="recompute"):
        memplan.make_workload(gpt2, recompute=True)


def test_every_result_enum_is_plain():
    """Each enum a result can carry is a PlainEnum (str) or PlainIntEnum (int): a new one
    that is not would show ``<Kind.MEMBER: ...>`` again. (Mechanism, the presets' internal
    grouping of settings, is reached by no result.)"""
    kinds = {k for k in _enum_classes() if k.__name__ != "Mechanism"}
    assert {Precision, Recompute, ZeroStage, Offload} <= kinds
    assert not [k.__name__ for k in kinds if not issubclass(k, (PlainEnum, PlainIntEnum))]


def test_frozen_inputs_hash_by_their_fields_once_per_object() -> None:
    """``ModelSpec``, ``Workload`` and ``ParallelConfig`` hash as pydantic hashes a frozen model
    (the tuple of their field values, in field order: written out here with the fields' own
    names), so equal objects hash equal and a copy with one field changed is another key; the
    value is kept in the object (``Record._kept_hash``), not in its fields, and a copy starts
    without it. Pickled or copied, a record carries its fields alone."""
    import copy
    import pickle

    spec = memplan.load_model("tiny")
    wl = memplan.make_workload(spec, micro_batch_size=3)
    par = memplan.make_layout(8, tp=2)
    for obj in (spec, wl, par):
        by_hand = hash(tuple(getattr(obj, name) for name in type(obj).model_fields))
        assert hash(obj) == by_hand and obj._kept_hash == by_hand
        assert "_kept_hash" not in obj.__dict__
        fresh = obj.model_copy()
        assert not hasattr(fresh, "_kept_hash") and hash(fresh) == by_hand
        for again in (pickle.loads(pickle.dumps(obj)), copy.deepcopy(obj), copy.copy(obj)):
            assert again == obj and again.__dict__ == obj.__dict__ and hash(again) == by_hand
    other = wl.model_copy(update={"micro_batch_size": 4})
    assert hash(other) != hash(wl) and other != wl
