"""Performance summary: the bound rule and MFU on hand rows; a real profiled CPU step whose
FLOPs are derived by hand; ``memplan profile --perf``."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.cli import app, main
from memplan.measure.perf import NOT_CLASSIFIED, bound, summarize

SPLIT = {"compute": 100.0, "exposed_comm": 0.0, "exposed_copies": 0.0, "idle": 0.0}
TRACE = {"steps": [{"duration_us": 40.0}, {"duration_us": 60.0}], "window_us": 100.0,
         "split_us": SPLIT, "collectives": {}}


def _ops(mm_us, mul_us):
    return [{"name": "aten::mm", "calls": 2, "self_us": mm_us, "flops": 6_000_000},
            {"name": "aten::mul", "calls": 4, "self_us": mul_us, "flops": 1000}]


def test_summary_flops_and_mfu():
    """Two steps, 50 us on average; 6,001,000 FLOPs in all: 3,000,500 per step, so
    6.001e10 FLOP/s, 6.001% of a 1e12 FLOP/s peak. 1,000,000 bytes a step: 2e10 bytes/s, an
    intensity of 3.0005 FLOP/byte, under the ridge point 1e12 / 1e11 = 10: memory-bound, and
    the roofline allows 3.0005 x 1e11 FLOP/s there, of which 6.001e10 is 20%."""
    out = summarize(_ops(60, 40), [], TRACE, device="cuda", bytes_per_step=1_000_000,
                    peak_flops=1e12, peak_bytes_per_s=1e11, gpu_name="x")
    assert out["mean_step_us"] == 50 and out["flops_per_step"] == 3_000_500
    assert out["achieved_flops_per_s"] == pytest.approx(6.001e10, rel=1e-12)
    assert out["achieved_bytes_per_s"] == pytest.approx(2e10, rel=1e-12)
    assert out["mfu"] == pytest.approx(0.06001, rel=1e-12)
    assert out["bound"] == "memory" and out["ridge_point"] == 10
    assert out["arithmetic_intensity"] == pytest.approx(3.0005, rel=1e-12)
    assert out["of_roofline"] == pytest.approx(0.2, rel=1e-12)
    assert out["matmul_ops_share"] == 0.6  # reported, no longer the verdict
    assert [r["name"] for r in out["top_ops"]] == ["aten::mm", "aten::mul"]
    cpu = summarize(_ops(60, 40), [], TRACE, device="cpu", bytes_per_step=1_000_000)
    assert cpu["mfu"] is None and cpu["bound"] == NOT_CLASSIFIED


def test_bound_rule():
    """Compute-bound at or above the ridge point; communication-bound on any device when
    exposed communication is at least compute; not classified on CPU or without peaks."""
    peaks = {"peak_flops": 1e12, "peak_bytes_per_s": 1e11}
    assert bound(SPLIT, device="cuda", flops_per_s=1e11, bytes_per_s=1e10, **peaks)[
        "bound"] == "compute"  # 10 FLOP/byte: the ridge
    assert bound(SPLIT, device="cuda", flops_per_s=1e11, bytes_per_s=2e10, **peaks)[
        "bound"] == "memory"
    comm = dict(SPLIT, exposed_comm=100.0)
    for device in ("cuda", "cpu"):
        assert bound(comm, device=device, flops_per_s=1e11, bytes_per_s=1e10, **peaks)[
            "bound"] == "communication"
    assert bound(SPLIT, device="cpu", flops_per_s=1e11, bytes_per_s=1e10, **peaks)[
        "bound"] == NOT_CLASSIFIED
    assert bound(SPLIT, device="cuda", flops_per_s=1e11, bytes_per_s=1e10)[
        "bound"] == NOT_CLASSIFIED


def test_traffic_counter_exact_bytes():
    """x (8 x 16 fp32, 512 B) @ w.t() with w 4 x 16 (256 B): aten.t is a view (0 B), aten.mm
    reads 512 + 256 and writes 8 x 4 x 4 = 128 B (896 B); .add_(1.0) in place reads and writes
    128 B each (256 B): 1,152 bytes."""
    torch = pytest.importorskip("torch")
    from memplan.profile.perf import TrafficCounter

    x, w = torch.ones(8, 16), torch.ones(4, 16)
    with TrafficCounter() as counter:
        y = x @ w.t()
        y.add_(1.0)
    assert counter.bytes == 1152


def test_phase_ranges_and_memory_counters_in_the_trace(tmp_path):
    """Every profiled step holds one forward, backward and optimizer range, in that order and
    inside the step, and the trace has a memory counter track whose last value per step is the
    profiler's own total."""
    torch = pytest.importorskip("torch")
    from memplan.profile.perf import COUNTER, profile_perf

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters())

    def step(model, opt, k):
        model(torch.randn(32, 64)).sum().backward()
        opt.step()
        opt.zero_grad()

    profile_perf(model, opt, step, steps=2, out_dir=tmp_path)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X"
                   and e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep"))
    assert len(steps) == 2
    for lo, hi in steps:
        inside = sorted((e["ts"], e["name"]) for e in events if e.get("ph") == "X"
                        and e.get("cat") == "user_annotation" and lo <= e["ts"] < hi
                        and e["name"] in ("forward", "backward", "optimizer"))
        assert [name for _, name in inside] == ["forward", "backward", "optimizer"]
    counters = [e for e in events if e.get("ph") == "C" and e["name"] == COUNTER]
    memory = [e for e in events if e.get("name") == "[memory]"]
    assert len(counters) == len(memory) > 0
    assert [c["args"]["cpu"] for c in counters] == [m["args"]["Total Allocated"]
                                                   for m in memory]


def test_profile_perf_cpu_exact_flops(tmp_path):
    """Linear(64, 64) -> ReLU -> Linear(64, 64) on 32 rows, loss .sum(), SGD: forward two
    addmm of 2*32*64*64 = 262,144 FLOPs; backward the second layer's input and weight grads
    and the first layer's weight grad, three mm of 262,144 (the input needs no grad).
    5 * 262,144 = 1,310,720 FLOPs per step."""
    torch = pytest.importorskip("torch")
    from memplan.measure.profiler_traces import load
    from memplan.profile.perf import profile_perf

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, k):
        model(torch.randn(32, 64)).sum().backward()
        opt.step()
        opt.zero_grad()

    out = profile_perf(model, opt, step, steps=3, out_dir=tmp_path)
    assert out["num_steps"] == 3 and out["device"] == "cpu"
    assert out["flops_per_step"] == 1_310_720
    assert {"aten::addmm", "aten::mm"} <= {r["name"] for r in out["top_ops"]}
    calls = {r["name"]: r["calls"] for r in out["top_ops"]}
    assert calls["aten::addmm"] == 6 and calls["aten::mm"] == 9  # 3 steps
    steps = load(tmp_path / "trace.json").steps
    assert [n for n, _, _ in steps] == [1, 2, 3]  # the warm-up step is not in the trace
    assert sum(out["split_us"].values()) == pytest.approx(sum(hi - lo for _, lo, hi in steps),
                                                          rel=1e-9)


def test_cli_profile_perf(tmp_path, capsys):
    pytest.importorskip("torch")
    assert main(["profile", "-m", "tiny", "--perf"]) == 2
    assert "add --real" in capsys.readouterr().err
    res = CliRunner().invoke(app, ["profile", "-m", "tiny", "--real", "--perf", "--seq", "64",
                                   "--json", "--out", str(tmp_path)], catch_exceptions=False)
    assert res.exit_code == 0
    perf = json.loads(res.stdout)["perf"]
    # no collectives on CPU and no roofline there: not classified, whatever the op times
    assert perf["num_steps"] == 3 and perf["split_us"]["exposed_comm"] == 0
    assert perf["bound"] == NOT_CLASSIFIED and perf["bytes_per_step"] > 0
    assert perf["achieved_bytes_per_s"] == pytest.approx(
        perf["bytes_per_step"] / (perf["mean_step_us"] * 1e-6), rel=1e-12)
    assert perf["trace"] == str(tmp_path / "trace.json")
    assert json.loads((tmp_path / "perf.json").read_text()) == dict(perf, trace="trace.json")
    assert (tmp_path / "trace.json").exists()
