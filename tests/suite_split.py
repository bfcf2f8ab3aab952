"""How ``tests/run_suite.py`` splits the suite between its processes: whole test files, placed
by their recorded run time, the same way on every run.

A file is never split: its module-scoped fixtures and module-level caches (a traced grid, a
process group, a compiled model) are built once, in one process, and its tests run in the
order they always run in. The placement is a pure function of the collected files and the
durations committed in ``tests/data/test_durations.json``, so a given commit runs each file in
the same process after the same files every time: no placement depends on timing or load.

Longest file first, each to the process with the least recorded time so far (ties: the lower
index); a file with no recorded time weighs its test count times the median recorded time
per test of its folder's files.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Iterable, Mapping

DURATIONS = Path(__file__).resolve().parent / "data" / "test_durations.json"


def load_durations(path: Path = DURATIONS) -> dict[str, dict[str, float]]:
    """``{file: {"seconds": s, "tests": n}}`` as last recorded, or nothing."""
    if not path.exists():
        return {}
    return json.loads(path.read_text())["files"]


def file_weights(counts: Mapping[str, int],
                 recorded: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Seconds each collected file is expected to take: its recorded time per recorded test
    times its tests collected now (a record of part of a file, or a file grown since, scaled
    up); else its test count times the median recorded
    seconds per test of the files in its folder (a traced test costs what traced tests do,
    not what unit tests do), of all files where its folder has none, one second where
    nothing is recorded."""
    def per_test(names: Iterable[str]) -> list[float]:
        return [recorded[f]["seconds"] / recorded[f]["tests"] for f in names
                if recorded[f].get("tests")]

    overall = per_test(recorded)
    out = {}
    for name, n in counts.items():
        r = recorded.get(name)
        if r and r.get("tests"):
            out[name] = r["seconds"] * n / r["tests"]
            continue
        near = per_test(f for f in recorded if _folder(f) == _folder(name)) or overall
        out[name] = n * (statistics.median(near) if near else 1.0)
    return out


def _folder(name: str) -> str:
    return name.rpartition("/")[0]


def assign(weights: Mapping[str, float], shards: int) -> dict[str, int]:
    """The process (0 .. shards - 1) each file runs in: longest first to the least loaded."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    load = [0.0] * shards
    out: dict[str, int] = {}
    for name in sorted(weights, key=lambda f: (-weights[f], f)):
        k = min(range(shards), key=lambda i: (load[i], i))
        out[name] = k
        load[k] += weights[name]
    return out


def parse_shard(text: str) -> tuple[int, int]:
    """``"k/n"`` -> (k, n), 0 <= k < n."""
    try:
        k, n = (int(p) for p in text.split("/"))
    except ValueError:
        raise ValueError(f"MEMPLAN_TEST_SHARD must be k/n (e.g. 0/2), got {text!r}") from None
    if not 0 <= k < n:
        raise ValueError(f"MEMPLAN_TEST_SHARD {text!r}: need 0 <= k < n")
    return k, n


def select(files: Iterable[str], shard: tuple[int, int],
           recorded: Mapping[str, Mapping[str, float]]) -> set[str]:
    """The files (one entry per collected test, repeated) that ``shard`` runs."""
    counts: dict[str, int] = {}
    for f in files:
        counts[f] = counts.get(f, 0) + 1
    k, n = shard
    placed = assign(file_weights(counts, recorded), n)
    return {f for f, i in placed.items() if i == k}
