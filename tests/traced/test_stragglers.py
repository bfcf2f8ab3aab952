"""Stragglers on real 2-process gloo runs with a known injected lag, against the truth.

One ``benchmarks/gloo_trace.py`` launch makes five runs in one process group: three with no
lag, then rank 1 lagging 50 ms and rank 0 lagging 120 ms before each forward. Every rank
sleeps 20 ms before its forward too (a job waiting for data), so the two ranks do not keep
both cores of a small machine busy and equal ranks stay close. The truth comes from clocks
the processes share (CLOCK_MONOTONIC): each rank's moment of backward-compute-done per step;
a rank waited, in a step, from its own moment to the latest rank's.

Timing on a loaded machine is not fixed, so every bound is taken from the truth of the same
run: the victim's exposed wait against the truth's, and at no lag "no straggler" wherever the
truth has no rank late in most steps (a busy machine can make one rank truly slow).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from memplan.measure.profiler_traces import analyze_paths
from memplan.measure.stragglers import STRAGGLER_PCT, STRAGGLER_SHARE

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gloo_trace.py"
RUNS = [(0, 0.0), (0, 0.0), (0, 0.0), (1, 50.0), (0, 120.0)]


def _bench():
    spec = importlib.util.spec_from_file_location("gloo_trace", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("gloo")
    spec = ",".join(f"{r}:{lag:g}" for r, lag in RUNS)
    subprocess.run([sys.executable, str(SCRIPT), str(out), "--runs", spec, "--steps", "6",
                    "--buckets", "3", "--idle-ms", "20"],
                   check=True, capture_output=True, timeout=300)
    bench = _bench()
    return [(lag_rank, lag, out / bench.run_name(i, lag_rank, lag))
            for i, (lag_rank, lag) in enumerate(RUNS)]


def _truth(run: Path) -> tuple[dict[int, float], dict[int, list[float]]]:
    """Per rank, from the shared clock: the exposed wait in microseconds (summed over steps)
    and its lateness in each step in % of the step (the median of the other ranks' wait less
    its own, as memplan.measure.stragglers defines it)."""
    truth = _bench().read_truth(run)
    ranks = sorted(truth)
    waited = {r: 0.0 for r in ranks}
    late: dict[int, list[float]] = {r: [] for r in ranks}
    for rows in zip(*(truth[r] for r in ranks), strict=True):
        latest = max(row["ready_ns"] for row in rows)
        wait = {r: (latest - row["ready_ns"]) / 1000 for r, row in zip(ranks, rows, strict=True)}
        step_us = statistics.median((row["end_ns"] - row["start_ns"]) / 1000 for row in rows)
        for r in ranks:
            waited[r] += wait[r]
            others = statistics.median(v for k, v in wait.items() if k != r)
            late[r].append(100.0 * (others - wait[r]) / step_us)
    return waited, late


def _mostly_late(late: list[float], pct: float) -> bool:
    return sum(v > pct for v in late) >= STRAGGLER_SHARE * len(late)


def test_lagging_rank_named_and_victim_wait_sized(runs):
    for lag_rank, lag, run in runs:
        if not lag:
            continue
        victim = 1 - lag_rank
        across = analyze_paths(sorted(run.glob("rank*.json.gz")))["across_ranks"]
        waited, late = _truth(run)
        assert _mostly_late(late[lag_rank], STRAGGLER_PCT), (run.name, late)  # the lag is real
        assert across["stragglers"] == [lag_rank], (run.name, across["late_steps"])
        assert across["waited_for_rank"] == lag_rank
        got = across["exposed_wait_us"][victim]
        assert got == pytest.approx(waited[victim], rel=0.25), (run.name, got, waited)
        assert across["victims_exposed_wait_us"] == {victim: got}
        # the straggler itself hardly waits: what the truth has it wait (the machine can hold
        # its victim back in a step too), give or take a tenth of its victim's wait
        assert across["exposed_wait_us"][lag_rank] <= waited[lag_rank] + 0.1 * got


def test_no_straggler_without_lag(runs):
    for _, lag, run in runs:
        if lag:
            continue
        across = analyze_paths(sorted(run.glob("rank*.json.gz")))["across_ranks"]
        _, late = _truth(run)
        # a rank the truth has late in most steps (by half the threshold) was really slowed by
        # the machine; no other rank may be named
        truly_late = {r for r, v in late.items() if _mostly_late(v, STRAGGLER_PCT / 2)}
        assert set(across["stragglers"]) <= truly_late, (run.name, late, across["late_steps"])
        if not truly_late:
            assert across["stragglers"] == []
        # equal ranks take turns: neither is late in three steps of four
        assert all(across["late_steps"][r] < STRAGGLER_SHARE * across["num_steps"]
                   for r in across["late_steps"] if r not in truly_late), across["late_steps"]


def test_cli_names_the_lagging_rank(runs):
    from typer.testing import CliRunner

    from memplan.cli import app

    lag_rank, _, run = runs[-1]
    res = CliRunner().invoke(app, ["analyze-trace", *map(str, sorted(run.glob("rank*.json.gz"))),
                                   "--json"], catch_exceptions=False)
    assert res.exit_code == 0
    across = json.loads(res.stdout)["across_ranks"]
    assert across["stragglers"] == [lag_rank]
    assert set(across["exposed_wait_us"]) == {"0", "1"}  # JSON object keys: the ranks
