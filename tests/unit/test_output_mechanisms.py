"""The output names the mechanisms it modelled: compile, float8 and async TP change bytes or
time, so the text's assumptions and ``--json``'s workload say they were read (before, an
estimate with ``--compile --float8 tensorwise`` printed neither)."""

from __future__ import annotations

import json

from memplan.api import estimate
from memplan.cli import main


def test_compile_float8_and_async_tp_are_said() -> None:
    est = estimate("llama-3-8b", gpus=8, tp=2, zero=3, framework="torchtitan", compile=True,
                   recompute="full", float8="tensorwise", float8_all_gather=True,
                   async_tp=True)
    lines = [a for a in est.assumptions if "compiled" in a or "float8" in a or "async" in a]
    assert len(lines) == 3
    assert lines[0].startswith("each decoder layer compiled (torch.compile, Inductor)")
    assert "tensorwise scaling" in lines[1] and "all-gathered by FSDP2 in float8" in lines[1]
    assert lines[2].startswith("async TP") and "step time only" in lines[2]
    plain = estimate("llama-3-8b", gpus=8, zero=3, framework="torchtitan")
    assert not [a for a in plain.assumptions if "compiled" in a or "float8" in a]


def test_json_workload_names_compile_and_float8(capsys) -> None:
    assert main(["estimate", "-m", "llama-3-8b", "-n", "8", "--zero", "3", "--framework",
                 "torchtitan", "--compile", "--float8", "rowwise", "--json"]) == 0
    wl = json.loads(capsys.readouterr().out)["workload"]
    assert (wl["compile"], wl["float8"]) == (True, "rowwise")
