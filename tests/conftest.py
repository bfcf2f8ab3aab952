"""Suite-wide settings that keep every run's outcome independent of the machine and its load.

Hypothesis: the default profile derandomises the search (the same examples on every run, so a
property either holds on them or fails every time), keeps no example database (a failure seen
once does not change what later runs try), and has no deadline and no too-slow health check
(both are wall-clock limits; a loaded 2-core machine trips them). ``HYPOTHESIS_PROFILE=explore``
searches with fresh random examples, for looking for counter-examples on purpose.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # a test dependency; only the modules that import it need it
    settings = None

if settings is not None:
    _UNTIMED = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("deterministic", derandomize=True, database=None, **_UNTIMED)
    settings.register_profile("explore", derandomize=False, max_examples=500, **_UNTIMED)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# Weights & Biases never logs online from the suite, whatever the machine's account: a test that
# reaches wandb.init (monitor-summary --wandb, fuzzed) gets a disabled run. The sinks' own tests
# (tests/traced/test_monitor_sinks.py) set an offline run under tmp_path.
os.environ["WANDB_MODE"] = "disabled"

# plan's reserved check replays in the test's own process (no workers forked ahead:
# memplan.planning.ahead); tests/unit/test_ahead.py runs the workers in a process of its own
os.environ["MEMPLAN_JOBS"] = "1"


# Every ``--json`` output any test produces is checked against the published schema
# (docs/schema/output.schema.json): the commands' JSON and its documentation cannot drift.
_SCHEMA = Path(__file__).resolve().parent.parent / "docs" / "schema" / "output.schema.json"


@pytest.fixture(autouse=True)
def _recursion_limit_restored() -> Any:
    """Each test leaves the interpreter's recursion limit as it found it: torch.compile's
    Inductor raises it while it compiles and leaves it raised (to 2000), which would let a
    later test's too-deep input parse in the same process or not, by test order."""
    import sys

    limit = sys.getrecursionlimit()
    yield
    sys.setrecursionlimit(limit)


@pytest.fixture(autouse=True)
def _json_outputs_follow_the_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    import jsonschema

    from memplan.report import versioned

    validator = _validator(jsonschema)
    made = versioned.versioned

    def checked(command: str, out: Any, key: str = "") -> dict[str, Any]:
        result = made(command, out, key)
        # the text the command prints is what a reader parses: check that, not the objects
        validator.validate(json.loads(json.dumps(result)))
        return result

    monkeypatch.setattr(versioned, "versioned", checked)


_VALIDATORS: list[Any] = []


def _validator(jsonschema: Any) -> Any:
    if not _VALIDATORS:
        schema = json.loads(_SCHEMA.read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        _VALIDATORS.append(jsonschema.Draft202012Validator(schema))
    return _VALIDATORS[0]


# --- the suite split between processes (tests/run_suite.py) ---------------------------------
# MEMPLAN_TEST_SHARD=k/n keeps the whole files tests/suite_split.py places in process k of n;
# MEMPLAN_TEST_DURATIONS=PATH appends each test file's seconds there (run_suite.py --record).


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = os.environ.get("MEMPLAN_TEST_SHARD")
    if not shard:
        return
    import suite_split  # tests/suite_split.py

    files = [item.nodeid.split("::")[0] for item in items]
    keep = suite_split.select(files, suite_split.parse_shard(shard),
                              suite_split.load_durations())
    dropped = [item for item, f in zip(items, files) if f not in keep]
    items[:] = [item for item, f in zip(items, files) if f in keep]
    config.hook.pytest_deselected(items=dropped)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    out = os.environ.get("MEMPLAN_TEST_DURATIONS")
    if out:
        with open(out, "a") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.duration:.4f}\n")
