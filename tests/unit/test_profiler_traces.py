"""``memplan analyze-trace``: interval math, hand-built traces with known overlaps, a real
2-process gloo run (``benchmarks/gloo_trace.py``, rank 1 made slow on purpose)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from memplan.cli import app, main
from memplan.errors import MemplanError
from memplan.measure.intervals import intersect, length, subtract, union
from memplan.measure.profiler_traces import analyze, analyze_paths, load

TRACES = Path(__file__).parent.parent / "data" / "traces"
GLOO = sorted((TRACES / "gloo_2rank").glob("rank*.json.gz"))


def test_interval_ops():
    a, b = [(0, 10), (12, 20)], [(2, 3), (5, 13), (19, 25)]
    assert union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert intersect(a, b) == [(2, 3), (5, 10), (12, 13), (19, 20)]
    assert subtract(a, b) == [(0, 2), (3, 5), (13, 19)]
    assert length([(0, 10), (5, 15)]) == 15


spans = st.lists(st.tuples(st.integers(0, 100), st.integers(0, 30)).map(
    lambda t: (t[0], t[0] + t[1])), max_size=12)


@given(spans, spans)
def test_interval_partition(a, b):
    assert length(a) == length(intersect(a, b)) + length(subtract(a, b))
    assert length(union(a + b)) == length(a) + length(b) - length(intersect(a, b))


def X(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
            "args": args}


def _write(path: Path, events, rank=None):
    data = {"traceEvents": events}
    if rank is not None:
        data["distributedInfo"] = {"rank": rank, "world_size": 2, "backend": "nccl"}
    path.write_text(json.dumps(data))
    return path


GPU_EVENTS = [
    X("ProfilerStep#1", "user_annotation", 0, 90),  # host ranges ignored on GPU traces
    X("ProfilerStep#1", "gpu_user_annotation", 0, 100, tid=7),
    X("ProfilerStep#2", "gpu_user_annotation", 100, 100, tid=7),
    X("ampere_bf16_gemm", "kernel", 0, 40, tid=7), X("flash_fwd", "kernel", 50, 40, tid=7),
    X("flash_bwd", "kernel", 100, 80, tid=7),
    X("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "kernel", 30, 30, tid=20),
    X("ncclKernel_AllGather_RING_LL_Sum_int8_t", "kernel", 170, 30, tid=20),
    X("Memcpy DtoH", "gpu_memcpy", 90, 5, tid=8), X("Memset", "gpu_memset", 120, 5, tid=8),
    X("aten::mm", "cpu_op", 0, 200, tid=1),  # host ops are not GPU time
]


def test_gpu_trace_known_overlaps(tmp_path):
    """Window [0, 200]. Compute [0,40] [50,90] [100,180] = 160. Communication [30,60]
    [170,200] = 60, under compute [30,40] [50,60] [170,180] = 30, exposed [40,50] [180,200]
    = 30. Copies [90,95] exposed (5), [120,125] under compute. Idle [95,100] = 5."""
    r = analyze(load(_write(tmp_path / "t.json", GPU_EVENTS)))
    assert r["device"] == "gpu" and r["window_us"] == 200 and r["num_steps"] == 2
    assert r["split_us"] == {"compute": 160, "exposed_comm": 30, "exposed_copies": 5,
                             "idle": 5}
    assert r["comm_us"] == 60 and r["overlapped_comm_us"] == 30 and r["overlap_fraction"] == 0.5
    assert r["collectives"] == {"all_gather": {"count": 1, "time_us": 30, "exposed_us": 20},
                                "all_reduce": {"count": 1, "time_us": 30, "exposed_us": 10}}
    assert r["lanes_busy_us"] == {"stream 20": 60, "stream 7": 160, "stream 8": 10}
    assert r["steps"] == [
        {"step": 1, "duration_us": 100, "compute_us": 80, "comm_us": 30, "exposed_comm_us": 10},
        {"step": 2, "duration_us": 100, "compute_us": 80, "comm_us": 30, "exposed_comm_us": 20}]


def _gloo_rank(path: Path, rank: int, compute_end: int) -> Path:
    return _write(path, [
        X("ProfilerStep#0", "user_annotation", 0, 100),
        X("aten::mm", "cpu_op", 0, compute_end),
        X("c10d::allreduce_", "cpu_op", compute_end, 1),  # a launch, not compute
        X("gloo:all_reduce", "user_annotation", compute_end, 100 - compute_end, tid=9),
    ], rank=rank)


def test_straggler_from_waits(tmp_path):
    """Rank 1 computes until 90, rank 0 until 50: rank 0's all-reduce lasts 50, rank 1's 10,
    so rank 0 waited 40 of its 100 us for rank 1, all of it exposed ([50, 90]): rank 1 is late
    by 40% of the step in the only step."""
    paths = [_gloo_rank(tmp_path / "b.json", 1, 90), _gloo_rank(tmp_path / "a.json", 0, 50)]
    out = analyze_paths(paths)
    assert [r["rank"] for r in out["ranks"]] == [1, 0]  # ranks from distributedInfo
    r0 = out["ranks"][1]
    assert r0["split_us"] == {"compute": 50, "exposed_comm": 50, "exposed_copies": 0,
                              "idle": 0}
    across = out["across_ranks"]
    assert across["waiting_us"] == {1: 0, 0: 40} and across["exposed_wait_us"] == {1: 0, 0: 40}
    assert across["late_pct_lower_quartile"] == {1: 40, 0: -40}
    assert across["late_steps"] == {1: 1, 0: 0} and across["num_steps"] == 1
    assert across["waited_for_rank"] == 1 and across["stragglers"] == [1]
    assert across["victims_exposed_wait_us"] == {0: 40}
    assert analyze_paths(paths, threshold_pct=50)["across_ranks"]["stragglers"] == []


def test_exposed_wait_is_a_union_less_compute(tmp_path):
    """Two DDP buckets wait at once. Rank 0 computes [0, 60]; bucket A runs [20, 100] and B
    [55, 100] on its two gloo threads. Rank 1 computes [0, 90]; A [88, 100], B [90, 100]. Rank
    0 waited 80 - 12 = 68 in A ([20, 88]) and 45 - 10 = 35 in B ([55, 90]): 103 summed, but the
    union is [20, 90] = 70, and [20, 60] of it is hidden under compute, so its exposed wait is
    [60, 90] = 30: from the end of its compute to rank 1's arrival."""
    def rank(r, compute_end, calls):
        return _write(tmp_path / f"r{r}.json", [
            X("ProfilerStep#1", "user_annotation", 0, 100), X("aten::mm", "cpu_op", 0, compute_end),
            *(X("gloo:all_reduce", "user_annotation", lo, hi - lo, tid=9 + k)
              for k, (lo, hi) in enumerate(calls))], rank=r)

    paths = [rank(0, 60, [(20, 100), (55, 100)]), rank(1, 90, [(88, 100), (90, 100)])]
    across = analyze_paths(paths)["across_ranks"]
    assert across["matched_collective_calls"] == 2
    assert across["waiting_us"] == {0: 70, 1: 0} and across["exposed_wait_us"] == {0: 30, 1: 0}
    assert across["steps"] == [{"step": 1, "duration_us": 100, "exposed_wait_us": {0: 30, 1: 0},
                                "late_pct": {0: -30, 1: 30}}]
    assert across["stragglers"] == [1]


def test_straggler_needs_most_steps(tmp_path):
    """Four steps; rank 1 arrives 30 us late in steps 1 and 2, rank 0 in steps 3 and 4 (ranks
    taking turns, as on a busy machine): each is late by 30% in half the steps, and nobody is
    named. Late in three steps of four, rank 1 is."""
    def trace(r, late_steps):
        events = []
        for k in range(4):
            t0 = 100 * k
            mine = 80 if k in late_steps[r] else 50
            other = 80 if k in late_steps[1 - r] else 50
            end = max(mine, other)
            events += [X(f"ProfilerStep#{k + 1}", "user_annotation", t0, 100),
                       X("aten::mm", "cpu_op", t0, mine),
                       X("gloo:all_reduce", "user_annotation", t0 + mine, end + 10 - mine, tid=9)]
        return _write(tmp_path / f"t{r}.json", events, rank=r)

    turns = {1: {0, 1}, 0: {2, 3}}
    across = analyze_paths([trace(0, turns), trace(1, turns)])["across_ranks"]
    assert [s["late_pct"] for s in across["steps"]] == [{0: -30, 1: 30}] * 2 + [
        {0: 30, 1: -30}] * 2
    assert across["late_steps"] == {0: 2, 1: 2} and across["stragglers"] == []
    assert across["late_pct_lower_quartile"] == {0: -30, 1: -30}
    mostly = {1: {0, 1, 2}, 0: {3}}
    across = analyze_paths([trace(0, mostly), trace(1, mostly)])["across_ranks"]
    assert across["late_steps"] == {0: 1, 1: 3} and across["stragglers"] == [1]


def test_threshold_is_checked(tmp_path):
    paths = [_gloo_rank(tmp_path / "b.json", 1, 90), _gloo_rank(tmp_path / "a.json", 0, 50)]
    for bad in (-5, 100, True, "5"):
        with pytest.raises(MemplanError, match="straggler threshold"):
            analyze_paths(paths, threshold_pct=bad)


def test_real_gloo_run():
    """``benchmarks/gloo_trace.py``'s defaults: rank 1 computes 40 ms more before each
    forward, 4 steps, 3 DDP buckets a step; the ranks' aligned-clock ready moments are in
    truth_rank*.json next to the traces."""
    out = analyze_paths(GLOO)
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    for r in out["ranks"]:
        assert r["device"] == "cpu" and r["num_steps"] == 4
        assert r["collectives"]["all_reduce"]["count"] == 12  # 3 buckets in each of 4 steps
        assert sum(r["split_us"].values()) == pytest.approx(r["window_us"], rel=1e-12)
        exposed = sum(s["exposed_comm_us"] for s in r["steps"])
        assert exposed == pytest.approx(r["split_us"]["exposed_comm"], rel=1e-12)
        assert 0 <= r["overlap_fraction"] <= 1
    across = out["across_ranks"]
    assert across["waited_for_rank"] == 1 and across["stragglers"] == [1]
    assert across["compute_us"][1] > across["compute_us"][0]  # rank 1's extra matmuls
    truth = [json.loads((TRACES / "gloo_2rank" / f"truth_rank{r}.json").read_text())
             for r in (0, 1)]
    waited = sum(b["ready_ns"] - a["ready_ns"] for a, b in zip(*truth, strict=True)) / 1000
    assert across["exposed_wait_us"][0] == pytest.approx(waited, rel=0.25)
    assert across["exposed_wait_us"][1] < 0.05 * across["exposed_wait_us"][0]


def test_cli_json_and_text(tmp_path):
    paths = [str(_gloo_rank(tmp_path / f"r{k}.json", k, end)) for k, end in ((0, 50), (1, 90))]
    res = CliRunner().invoke(app, ["analyze-trace", *paths, "--json"], catch_exceptions=False)
    assert res.exit_code == 0
    assert json.loads(res.stdout)["across_ranks"]["stragglers"] == [1]
    res = CliRunner().invoke(app, ["analyze-trace", *paths], env={"COLUMNS": "80"},
                             catch_exceptions=False)
    assert res.exit_code == 0 and "straggler: rank 1" in res.stdout


def test_cli_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["analyze-trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memplan: error:") and "not a readable chrome trace" in err
    same = [str(_gloo_rank(tmp_path / f"r{k}.json", 0, 50)) for k in range(2)]
    assert main(["analyze-trace", *same]) == 2
    err = capsys.readouterr().err
    assert f"{same[0]} and {same[1]} are both rank 0" in err and err.count("\n") == 1


def test_no_torch_imported():
    code = ("import sys, memplan.cli; "
            f"rc = memplan.cli.main(['analyze-trace', *{[str(p) for p in GLOO]!r}, '--json']); "
            "assert rc == 0, rc; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
