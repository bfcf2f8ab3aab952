"""docs/accuracy.md is what benchmarks/accuracy_table.py builds from the committed runs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "accuracy_table.py"


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("accuracy_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["accuracy_table"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(table):
    return table.load_runs()


def test_every_run_has_a_source_and_a_measurement(table, runs):
    assert runs
    ids = [run["id"] for run in runs]
    assert len(ids) == len(set(ids)), "run ids must be unique"
    for run in runs:
        assert run["source"].strip(), run["id"]
        assert run["quote"].strip(), run["id"]
        assert run["what"].strip(), run["id"]
        assert isinstance(run["measured_bytes"], int) and run["measured_bytes"] > 0, run["id"]
        assert run["quantity"] in table.QUANTITIES, run["id"]
        assert run["rank"] in table.RANKS, run["id"]
        assert run["framework"] in {"megatron", "torchtitan", "hf", "lightning", "generic"}
        assert isinstance(run["not_expressible"], list), run["id"]
        assert "model" in run["memplan_args"] and "gpus" in run["memplan_args"], run["id"]


def test_committed_configs_exist(runs):
    for run in runs:
        model = run["memplan_args"]["model"]
        if "/" in model:
            assert (ROOT / model).is_file(), f"{run['id']}: {model} is missing"


def test_committed_doc_is_current(table, runs):
    text = table.render(table.build_rows(runs))
    assert (ROOT / "docs" / "accuracy.md").read_text() == text, (
        "docs/accuracy.md is stale: run python benchmarks/accuracy_table.py")
    assert table.main(["--check"]) == 0


def test_torch_free():
    """The table builder never imports torch (checked in a fresh interpreter)."""
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('accuracy_table', {str(SCRIPT)!r}); "
            "m = importlib.util.module_from_spec(spec); sys.modules['accuracy_table'] = m; "
            "spec.loader.exec_module(m); "
            "m.build_rows(m.load_runs()); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0
