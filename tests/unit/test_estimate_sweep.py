"""The pinned sweep: ``estimate --json`` over 600 fixed configurations equals the recorded one.

``tests/data/estimate_sweep.jsonl.gz`` was written by ``benchmarks/sweep_estimates.py --write``
before the analytic core was restructured by block; a change that moves any of these numbers
on purpose rewrites it with that command and says why in its commit.
"""

from __future__ import annotations

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


def test_sweep_is_unchanged() -> None:
    sweep = _sweep_module()
    with gzip.open(SWEEP, "rt") as fh:
        recorded = [json.loads(line) for line in fh]
    for rec in recorded:
        differences: list[str] = []
        sweep._diff(rec["estimate"], sweep.record(rec["config"])["estimate"], "", differences,
                    set())
        assert not differences, (rec["config"], differences[:5])
