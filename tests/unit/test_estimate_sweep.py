"""The pinned sweep: ``estimate --json`` over 648 fixed configurations equals the recorded one.

``tests/data/estimate_sweep.jsonl.gz`` was written by ``benchmarks/sweep_estimates.py --write``
before the analytic core was restructured by block; a change that moves any of these numbers
on purpose rewrites it with that command (which prints how many configurations changed, per
field) and says why in its commit. The first 600 configurations are drawn over powers of two
for dp; 48 more with dp 3, 5, 6 and 12 (ZeRO 1, 2, 3) were appended later, recorded with the
code of that day, the 600 unchanged. Every record must also hold the sweep's ``invariants``
(each stated with its reason in ``benchmarks/sweep_estimates.py``).
"""

from __future__ import annotations

import copy
import gzip
import importlib.util
import json
from pathlib import Path

from memplan.workload import Precision

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "tests" / "data" / "estimate_sweep.jsonl.gz"


def _sweep_module():  # the benchmark script is not a package: load it by path
    spec = importlib.util.spec_from_file_location("sweep_estimates",
                                                  ROOT / "benchmarks" / "sweep_estimates.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sweep_covers_every_option() -> None:
    """At least 500 configurations, every recompute policy, precision, attention, norm and
    ZeRO stage among them, pipelines with virtual stages, CP, EP, loss chunks and offload."""
    with gzip.open(SWEEP, "rt") as fh:
        configs = [json.loads(line)["config"] for line in fh]
    assert len(configs) >= 500

    def values(key: str) -> set:
        return {c.get(key) for c in configs}

    assert values("recompute") == {"none", "selective", "full"}
    assert values("precision") == {p.value for p in Precision}
    assert values("attention") == {"flash", "eager"} and values("norm_impl") == {"upcast", "fused"}
    assert values("zero") == {0, 1, 2, 3} and {2, 4} <= values("vpp") and {2, 4} <= values("cp")
    assert {2, 4, 8} <= values("ep") and {4, 8} <= values("loss_chunks")
    assert "optimizer" in values("offload") and {0, 1, 2, 3} <= values("recompute_layers")
    assert {"mixtral-8x7b", "llama-3.1-405b", "gpt2"} <= values("model")


def _recorded() -> list[dict]:
    with gzip.open(SWEEP, "rt") as fh:
        return [json.loads(line) for line in fh]


def test_sweep_covers_uneven_data_parallel_sizes() -> None:
    """After the 600 drawn configurations, four for each dp in 3, 5, 6, 12 and each ZeRO
    stage 1, 2, 3, exactly as ``uneven_configs`` draws them."""
    sweep = _sweep_module()
    recorded = _recorded()
    uneven = [rec["config"] for rec in recorded[600:]]
    assert uneven == sweep.uneven_configs()
    pairs = [(rec["estimate"]["layout"]["dp"], rec["estimate"]["layout"]["zero"])
             for rec in recorded[600:]]
    assert sorted(set(pairs)) == [(dp, z) for dp in (3, 5, 6, 12) for z in (1, 2, 3)]
    assert all(pairs.count(pair) == 4 for pair in pairs)


def test_sweep_records_hold_the_invariants() -> None:
    """Every recorded configuration (the next test shows they equal today's estimates) holds
    every invariant of ``sweep_estimates.invariants``."""
    sweep = _sweep_module()
    broken = [(i, what) for i, rec in enumerate(_recorded()) for what in sweep.invariants(rec)]
    assert not broken, broken[:10]


def test_invariants_catch_a_broken_record() -> None:
    """A record whose allocator line moved by one byte breaks the sum of its lines and the
    analytic peak's lack of allocator bytes (the caching allocator is replayed apart); one whose steady optimizer phase lost a byte breaks the phase's parts;
    one whose stage-0 gradients are sharded one element the wrong way breaks the ZeRO
    sharding (the first dense ZeRO-2 record at dp 3)."""
    sweep = _sweep_module()
    recorded = _recorded()
    rec = copy.deepcopy(recorded[0])
    rec["estimate"]["stages"][0]["allocator_bytes"] += 1
    assert {w.split(": ", 1)[1] for w in sweep.invariants(rec)} >= {
        "peak != tensor peak + overheads", "allocator bytes in the analytic peak"}
    rec = copy.deepcopy(recorded[0])
    stage = rec["estimate"]["stages"][0]
    stage["phases"]["steady"]["optimizer_bytes"] -= 1
    assert "stage 0: optimizer phase != its parts" in sweep.invariants(rec)
    rec = next(copy.deepcopy(r) for r in recorded[600:] if r["estimate"]["layout"]["zero"] == 2
               and r["config"]["model"] != "mixtral-8x7b")
    stage = rec["estimate"]["stages"][0]
    stage["grads_bytes"] -= sweep.PRECISION_BYTES[rec["config"]["precision"]][1]
    assert "stage 0: gradients by ZeRO stage" in sweep.invariants(rec)


def test_rerecord_says_what_changed() -> None:
    """Three old records, the new ones: the first unchanged, the second with two stages'
    peaks and the top-level peak moved, the third gone and a fourth added: 1 changed, 1 added,
    1 removed; the stage peak field moved in one configuration (its two stages count once)."""
    sweep = _sweep_module()

    def rec(n: int, peaks: list[int]) -> dict:
        return {"config": {"n": n}, "estimate": {"peak_bytes": max(peaks),
                                                 "stages": [{"peak_bytes": p} for p in peaks]}}

    old = [rec(1, [10]), rec(2, [20, 30]), rec(3, [5])]
    new = [rec(1, [10]), rec(2, [21, 31]), rec(4, [7])]
    lines = sweep.changes(old, new)
    assert lines[0] == "3 configurations: 1 changed, 1 added, 1 removed"
    assert lines[1:] == ["  .peak_bytes: 1 configurations (e.g. .peak_bytes: 30 -> 31)",
                         "  .stages[*].peak_bytes: 1 configurations "
                         "(e.g. .stages[0].peak_bytes: 20 -> 21)"]


def test_sweep_is_unchanged() -> None:
    sweep = _sweep_module()
    with gzip.open(SWEEP, "rt") as fh:
        recorded = [json.loads(line) for line in fh]
    for rec in recorded:
        differences: list[str] = []
        sweep._diff(rec["estimate"], sweep.record(rec["config"])["estimate"], "", differences,
                    set())
        assert not differences, (rec["config"], differences[:5])
