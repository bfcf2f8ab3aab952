"""The split of the suite between tests/run_suite.py's processes (tests/suite_split.py): whole
files, longest first to the least loaded process, the same on every run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import suite_split  # tests/suite_split.py

ROOT = Path(__file__).resolve().parents[2]


def test_longest_first_to_the_least_loaded() -> None:
    """5 -> 0; 4 -> 1; 3 (c) -> 1 (4 < 5); 3 (d) -> 0 (5 < 7); 1 -> 1 (7 < 8): loads 8 and 8."""
    placed = suite_split.assign({"a": 5, "b": 4, "c": 3, "d": 3, "e": 1}, 2)
    assert placed == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}


def test_ties_go_by_name_then_to_the_lower_index() -> None:
    assert suite_split.assign({"y": 1.0, "x": 1.0, "z": 1.0}, 2) == {"x": 0, "y": 1, "z": 0}
    assert suite_split.assign({"x": 2.0}, 3) == {"x": 0}


def test_weights_from_the_record_and_the_median_per_test() -> None:
    """a: 40 s over 4 tests, 2 collected now -> 20 s; b: 3 s over the 1 test recorded, 5
    collected now -> 15 s; per-test times 10 and 3, median 6.5 s: an unrecorded file of 2
    tests weighs 13 s."""
    recorded = {"a": {"seconds": 40.0, "tests": 4}, "b": {"seconds": 3.0, "tests": 1}}
    assert suite_split.file_weights({"a": 2, "b": 5, "new": 2}, recorded) == {
        "a": 20.0, "b": 15.0, "new": 13.0}
    assert suite_split.file_weights({"new": 3}, {}) == {"new": 3.0}


def test_an_unrecorded_file_weighs_as_its_folder() -> None:
    """Per test: t/a 10 s and t/b 30 s (median 20), u/c 0.1 s: a new t/ file of 3 tests weighs
    60 s, a new u/ file of 10 tests 1 s, a new file elsewhere 2 tests x the median of all
    three (10 s) = 20 s."""
    recorded = {"t/a": {"seconds": 20.0, "tests": 2}, "t/b": {"seconds": 30.0, "tests": 1},
                "u/c": {"seconds": 1.0, "tests": 10}}
    weights = suite_split.file_weights({"t/new": 3, "u/new": 10, "v/new": 2}, recorded)
    assert weights == pytest.approx({"t/new": 60.0, "u/new": 1.0, "v/new": 20.0})


def test_every_file_in_exactly_one_process() -> None:
    files = [f"tests/t{i % 7}.py" for i in range(50)]
    recorded = {"tests/t1.py": {"seconds": 100.0, "tests": 8}}
    parts = [suite_split.select(files, (k, 3), recorded) for k in range(3)]
    assert set().union(*parts) == set(files)
    assert sum(len(p) for p in parts) == len(set(files))
    assert parts == [suite_split.select(files, (k, 3), recorded) for k in range(3)]


@pytest.mark.parametrize("text", ["2", "1/1", "-1/2", "a/b"])
def test_bad_shard_names_the_variable(text: str) -> None:
    with pytest.raises(ValueError, match="MEMPLAN_TEST_SHARD"):
        suite_split.parse_shard(text)


def _collected(shard: str, files: list[str]) -> set[str]:
    env = dict(os.environ, MEMPLAN_TEST_SHARD=shard)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only",
                          "-p", "no:cacheprovider", *files], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=False).stdout
    return {line for line in out.splitlines() if "::" in line}


def test_the_processes_split_the_collection_by_file() -> None:
    files = ["tests/unit/test_suite_split.py", "tests/unit/test_adapters.py"]
    if not all((ROOT / f).exists() for f in files):
        pytest.skip("a file of this check is gone")
    one, two = _collected("0/2", files), _collected("1/2", files)
    assert one and two and not one & two
    assert one | two == _collected("0/1", files)
    assert len({t.split("::")[0] for t in one}) == 1
