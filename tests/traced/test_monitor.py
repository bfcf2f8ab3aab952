"""``MemoryMonitor`` and ``memplan monitor-summary``: records, warnings, ranks, never raising."""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from memplan.cli import app, main
from memplan.monitor import MemoryMonitor, read_records, summarize

GiB = 1 << 30


class Script:
    """A reader returning the given stats in turn, and a clock advancing 0.5 s per call."""

    def __init__(self, stats):
        self.stats = list(stats)
        self.t = 0.0

    def read(self):
        return dict(self.stats.pop(0))

    def clock(self):
        self.t += 0.5
        return self.t


def _stats(alloc, peak, reserved=None, cap=80 * GiB):
    return {"allocated_bytes": alloc, "peak_bytes": peak,
            "reserved_bytes": reserved if reserved is not None else peak + GiB,
            "inactive_split_bytes": 1024, "alloc_retries": 0, "num_ooms": 0,
            "capacity_bytes": cap}


def test_records_and_warnings(tmp_path):
    s = Script([_stats(10 * GiB, 40 * GiB), _stats(11 * GiB, 41 * GiB),
                _stats(12 * GiB, 42 * GiB), _stats(12 * GiB, 78 * GiB, 78 * GiB)])
    with MemoryMonitor(tmp_path, rank=3, reader=s.read, clock=s.clock, leak_steps=2,
                       predicted_peak_bytes=40 * GiB, deviation_pct=4.0) as mon:
        recs = [mon.step() for _ in range(4)]
    assert [r["step_time_s"] for r in recs] == [0.5] * 4
    assert recs[0]["fragmentation_bytes"] == 31 * GiB  # reserved 41 - allocated 10
    assert recs[0]["headroom_bytes"] == 80 * GiB - 41 * GiB
    assert recs[0]["warnings"] == [] and recs[1]["warnings"] == []
    assert recs[2]["warnings"] == [(f"allocated grew 2 steps in a row (+{2 * GiB} bytes): "
                                   "possible leak"),
                                   (f"peak {42 * GiB} bytes is +5.0% from the predicted "
                                   f"{40 * GiB} bytes")]
    assert recs[3]["headroom_bytes"] == 2 * GiB  # 2.5% of 80 GiB: under 5%
    assert recs[3]["warnings"][0].startswith(f"headroom {2 * GiB} bytes is under 5.0%")
    lines = (tmp_path / "memory_rank3.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == recs


def test_never_raises(tmp_path, caplog):
    def broken():
        raise RuntimeError("no stats")

    blocker = tmp_path / "file"
    blocker.write_text("")
    mon = MemoryMonitor(blocker / "sub", rank=0, reader=broken)  # a file where a dir should be
    with caplog.at_level(logging.WARNING, logger="memplan.monitor"), mon:
        assert mon.step() is None and mon.step() is None
    assert mon.errors == 3  # the directory once, the reader twice
    assert len(caplog.records) == 1  # logged once


def test_no_reader_records_time_only(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "5")
    with MemoryMonitor(tmp_path) as mon:
        rec = mon.step()
    assert rec["rank"] == 5 and "allocated_bytes" not in rec and rec["step_time_s"] >= 0
    assert (tmp_path / "memory_rank5.jsonl").exists()


def test_exact_leak_on_a_real_loop(tmp_path):
    """A real CPU loop under the exact tracker keeping 1,000 fp32 values (4,000 bytes) per
    step: allocated grows by exactly 4,000 bytes a step and the leak is flagged at step 4."""
    torch = pytest.importorskip("torch")
    from memplan.profile.tracker import MemoryTracker

    model = torch.nn.Linear(16, 16)
    kept = []
    tracker = MemoryTracker()
    with tracker, MemoryMonitor(tmp_path, rank=0, leak_steps=3,
                                reader=lambda: {"allocated_bytes": tracker.total_bytes}) as mon:
        for _ in range(4):
            model(torch.randn(8, 16)).sum().backward()
            model.zero_grad()
            kept.append(torch.zeros(1000))
            mon.step()
    allocs = [r["allocated_bytes"] for r in mon.records]
    assert [b - a for a, b in itertools.pairwise(allocs)] == [4000, 4000, 4000]
    assert mon.records[3]["warnings"] == [("allocated grew 3 steps in a row (+12000 bytes): "
                                          "possible leak")]


def _two_ranks(tmp_path):
    for rank, peak in ((0, 40 * GiB), (1, 44 * GiB)):
        s = Script([_stats(10 * GiB, peak), _stats(10 * GiB, peak - GiB)])
        with MemoryMonitor(tmp_path, rank=rank, reader=s.read, clock=s.clock) as mon:
            mon.step()
            mon.step()


def test_summary_worst_rank(tmp_path):
    _two_ranks(tmp_path)
    out = summarize(read_records([tmp_path]))
    assert out["worst_rank"] == 1 and out["worst_by"] == "max_peak_bytes"
    assert out["worst"]["max_peak_bytes"] == 44 * GiB
    assert out["worst"]["min_headroom_bytes"] == 80 * GiB - 45 * GiB
    assert out["ranks"][0]["num_steps"] == 2 and out["ranks"][0]["median_step_time_s"] == 0.5


def test_cli_monitor_summary(tmp_path, capsys):
    _two_ranks(tmp_path)
    res = CliRunner().invoke(app, ["monitor-summary", str(tmp_path), "--json"],
                             catch_exceptions=False)
    assert res.exit_code == 0 and json.loads(res.stdout)["worst_rank"] == 1
    res = CliRunner().invoke(app, ["monitor-summary", str(tmp_path)], env={"COLUMNS": "100"},
                             catch_exceptions=False)
    assert res.exit_code == 0 and "worst rank: 1" in res.stdout
    assert main(["monitor-summary", str(tmp_path / "missing")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["monitor-summary", str(tmp_path / "empty")]) == 2


def test_import_is_torch_free():
    code = "import sys, memplan.monitor; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
def test_cuda_reader():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from memplan.monitor import cuda_reader

    x = torch.empty(1 << 20, device="cuda")
    read = cuda_reader()
    stats = read()
    assert stats["allocated_bytes"] >= x.nbytes and stats["reserved_bytes"] >= x.nbytes
    assert stats["capacity_bytes"] == torch.cuda.get_device_properties(0).total_memory
