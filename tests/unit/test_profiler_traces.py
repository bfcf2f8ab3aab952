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
from memplan.intervals import intersect, length, subtract, union
from memplan.profiler_traces import analyze, analyze_paths, load

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
    so rank 0 waited 40 of its 100 us for rank 1."""
    paths = [_gloo_rank(tmp_path / "b.json", 1, 90), _gloo_rank(tmp_path / "a.json", 0, 50)]
    out = analyze_paths(paths)
    assert [r["rank"] for r in out["ranks"]] == [1, 0]  # ranks from distributedInfo
    r0 = out["ranks"][1]
    assert r0["split_us"] == {"compute": 50, "exposed_comm": 50, "exposed_copies": 0,
                              "idle": 0}
    across = out["across_ranks"]
    assert across["wait_in_collectives_us"] == {1: 0, 0: 40}
    assert across["waited_for_rank"] == 1 and across["others_wait_pct"] == 40
    assert across["stragglers"] == [1]
    assert analyze_paths(paths, threshold_pct=50)["across_ranks"]["stragglers"] == []


def test_real_gloo_run():
    out = analyze_paths(GLOO)
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    for r in out["ranks"]:
        assert r["device"] == "cpu" and r["num_steps"] == 3
        assert r["collectives"]["all_reduce"]["count"] == 3  # DDP: one bucket per step
        assert sum(r["split_us"].values()) == pytest.approx(r["window_us"], rel=1e-12)
        exposed = sum(s["exposed_comm_us"] for s in r["steps"])
        assert exposed == pytest.approx(r["split_us"]["exposed_comm"], rel=1e-12)
        assert 0 <= r["overlap_fraction"] <= 1
    across = out["across_ranks"]
    assert across["waited_for_rank"] == 1 and across["stragglers"] == [1]
    assert across["compute_us"][1] > across["compute_us"][0]  # rank 1's extra matmuls


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
    assert "same rank" in capsys.readouterr().err


def test_no_torch_imported():
    code = ("import sys, memplan.cli; "
            f"rc = memplan.cli.main(['analyze-trace', *{[str(p) for p in GLOO]!r}, '--json']); "
            "assert rc == 0, rc; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
