"""Memory over time by phase from a job's own files: a real torch.profiler trace made on CPU
with profile_memory=True (tests/data/memory/cpu_step.pt.trace.json.gz, written by
tests/data/memory/make_profiler_trace.py) and a memory snapshot.

The snapshot here is synthetic: CPU has no CUDA memory history, so it is built with the
structure ``torch.cuda.memory._snapshot()`` returns (``torch/cuda/memory.py`` ``_snapshot``'s
docstring in torch 2.13.0: "segments" of "blocks", "device_traces" of TraceEntry dicts with
"action", "addr", "size", "stream", "time_us" and "frames" of "filename", "line", "name",
innermost first) and pickled as ``_dump_snapshot`` does.
"""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import pytest

from memplan.cli import main
from memplan.measure.memory_timeline import profiler_timelines, snapshot_timelines

MiB = 2**20
TRACE = Path(__file__).resolve().parents[1] / "data" / "memory" / "cpu_step.pt.trace.json.gz"
# the MLP's parameters: Linear(256, 1024) and Linear(1024, 256), fp32
PARAM_BYTES = 4 * (1024 * 256 + 1024 + 256 * 1024 + 256)  # 2,102,272


def _peaks(tl) -> dict[tuple[int, str], int]:
    return {(r["step"], r["phase"]): r["peak_allocated_bytes"] for r in tl.phase_peaks()}


def test_profiler_trace_by_phase() -> None:
    """The trace's 263 "[memory]" events, all on the CPU (Device Type 0), in two steps.

    - step 1 forward peaks at 524,288 B: the first Linear's output and the ReLU's, each
      64 x 1024 fp32 (262,144 B), alive together at the ReLU (Total Allocated counts what was
      allocated while profiling: c10/core/CPUAllocator.cpp ProfiledCPUMemoryReporter::New, so
      the weights made before are not in it);
    - step 1's backward allocates the two weight gradients, 1,048,576 B each;
    - step 1's optimizer step leaves AdamW's states behind: exp_avg and exp_avg_sq of every
      parameter (2 x 2,102,272 B) and four step counts of 4 B: +4,204,560 B net; step 2's
      leaves nothing (net 0);
    - each optimizer step peaks at 8,473,628 B (the largest Total Allocated of the events
      inside its Optimizer.step#AdamW.step range)."""
    (tl,) = profiler_timelines(str(TRACE))
    assert (tl.device, len(tl.points)) == ("cpu", 263)
    peaks = _peaks(tl)
    assert peaks[(1, "forward")] == 2 * 64 * 1024 * 4 == 524_288
    assert peaks[(1, "optimizer step")] == peaks[(2, "optimizer step")] == 8_473_628
    raw = json.loads(gzip.decompress(TRACE.read_bytes()))["traceEvents"]
    mem = sorted((e for e in raw if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    by_phase: dict[tuple[int, str], list[int]] = {}
    for point, e in zip(tl.points, mem):
        by_phase.setdefault((point.step, point.phase), []).append(e["args"]["Bytes"])
    assert sum(by_phase[(1, "optimizer step")]) == 2 * PARAM_BYTES + 4 * 4 == 4_204_560
    assert sum(by_phase[(2, "optimizer step")]) == 0
    assert by_phase[(1, "backward")].count(256 * 1024 * 4) == 2
    assert [r["phase"] for r in tl.phase_peaks()][:4] == [
        "forward", "backward", "other", "optimizer step"]


def _frame(path: str, name: str, line: int = 1) -> dict:
    return {"filename": path, "line": line, "name": name}


SITE = "/usr/lib/python3.12/site-packages/"
FWD = [_frame(SITE + "torch/nn/modules/linear.py", "forward", 125),
       _frame(SITE + "torch/nn/modules/module.py", "_call_impl", 1786),
       _frame("/work/train.py", "main", 40)]
BWD = [_frame("??", "torch::autograd::Engine::thread_main(std::shared_ptr<GraphTask> const&)", 0)]
STATES = [_frame(SITE + "torch/optim/adam.py", "_init_group", 180),
          _frame(SITE + "torch/optim/adam.py", "step", 240)]
TEMP = [_frame(SITE + "torch/optim/adam.py", "_multi_tensor_adam", 690),
        _frame(SITE + "torch/optim/adam.py", "step", 240)]
ZERO = [_frame(SITE + "torch/optim/optimizer.py", "zero_grad", 1060)]
BASE, SEG = 0x7F0000000000, 0x7F1000000000


def _entry(action: str, addr: int, size: int, t: int, frames: list) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
            "frames": frames}


def synthetic_snapshot() -> dict:
    """Two steps of a model of 100 MiB of weights (allocated before the ring buffer starts,
    in a 100 MiB segment) under foreach Adam: per step two 20 MiB activations, a 100 MiB
    gradient (allocated on the autograd engine's thread: C++ frames only), in step 1 the
    states (2 x 100 MiB, Adam._init_group), a 100 MiB foreach temporary, zero_grad's free.
    A 512 MiB segment is allocated first in the trace."""
    e, t = [_entry("segment_alloc", SEG, 512 * MiB, 1, FWD)], 2
    act1, act2, grad, avg, sq, tmp = (SEG + k * 100 * MiB for k in range(6))
    for step in (1, 2):
        e += [_entry("alloc", act1, 20 * MiB, t, FWD), _entry("alloc", act2, 20 * MiB, t + 1, FWD),
              _entry("alloc", grad, 100 * MiB, t + 2, BWD),
              _entry("free_completed", act2, 20 * MiB, t + 3, BWD),
              _entry("free_completed", act1, 20 * MiB, t + 4, BWD)]
        if step == 1:
            e += [_entry("alloc", avg, 100 * MiB, t + 5, STATES),
                  _entry("alloc", sq, 100 * MiB, t + 6, STATES)]
        e += [_entry("alloc", tmp, 100 * MiB, t + 7, TEMP),
              _entry("free_requested", tmp, 100 * MiB, t + 8, TEMP),
              _entry("free_completed", tmp, 100 * MiB, t + 8, TEMP),
              _entry("free_completed", grad, 100 * MiB, t + 9, ZERO)]
        t += 10
    e.append({"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": t})

    def block(addr: int, size: int, state: str) -> dict:
        return {"address": addr, "size": size, "requested_size": size if state != "inactive"
                else 0, "state": state, "frames": []}

    weights = [block(BASE, 100 * MiB, "active_allocated")]
    big = [block(avg, 100 * MiB, "active_allocated"), block(sq, 100 * MiB, "active_allocated"),
           block(SEG, 312 * MiB, "inactive")]
    segments = []
    for address, blocks in ((BASE, weights), (SEG, big)):
        live = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        segments.append({"device": 0, "address": address,
                         "total_size": sum(b["size"] for b in blocks), "allocated_size": live,
                         "active_size": live, "requested_size": live, "stream": 0,
                         "segment_type": "large", "segment_pool_id": (0, 0),
                         "is_expandable": False, "frames": [], "blocks": blocks})
    return {"segments": segments, "device_traces": [e], "allocator_settings": {},
            "external_annotations": []}


def test_snapshot_by_phase() -> None:
    """At the snapshot 300 MiB is allocated (weights and the two states) and 612 MiB
    reserved; the trace's net change is +200 MiB, so it starts at 100 MiB (the weights).
    Step 1: forward 100 + 2 x 20 = 140 MiB; backward 140 + 100 (gradient) = 240 MiB;
    optimizer 100 + 100 + 200 (states) + 100 (temporary) = 500 MiB. Step 2, states alive:
    forward 300 + 40 = 340; backward 440; optimizer 300 + 100 + 100 = 500 MiB. Reserved is
    612 MiB throughout (100 before the trace, its segment_alloc of 512)."""
    (tl,) = snapshot_timelines(synthetic_snapshot(), "snap.pickle")
    assert tl.device == "cuda:0"
    assert _peaks(tl) == {(1, "forward"): 140 * MiB, (1, "backward"): 240 * MiB,
                          (1, "optimizer step"): 500 * MiB, (2, "forward"): 340 * MiB,
                          (2, "backward"): 440 * MiB, (2, "optimizer step"): 500 * MiB}
    assert {p.reserved_bytes for p in tl.points} == {612 * MiB}
    assert tl.points[-1].allocated_bytes == 300 * MiB


def test_analyze_trace_reads_a_folder_and_a_snapshot_beside_the_estimate(tmp_path,
                                                                         capsys) -> None:
    """The folder's trace and the snapshot each become a timeline; with --model each step
    phase carries the estimate's tensor bytes of the most loaded stage (step 1 against the
    first step, step 2 against the steady state) and the measured minus the estimate."""
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps(synthetic_snapshot()))
    assert main(["analyze-trace", str(TRACE.parent), "--snapshot", str(snap), "--trust-pickle",
                 "-m", "tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["source"].split(" (")[0] for m in out["memory"]] == [
        "torch.profiler trace", "memory snapshot"]
    from memplan.api import estimate

    est = estimate("tiny")
    rows = {(r["step"], r["phase"]): r for r in out["memory"][1]["versus_estimate"]}
    assert rows[(1, "forward")]["estimated_bytes"] == est.worst.first_step.forward
    assert rows[(2, "optimizer step")]["estimated_bytes"] == est.worst.steady.optimizer
    assert rows[(2, "backward")]["diff_bytes"] == 440 * MiB - est.worst.steady.backward
    assert out["ranks"][0]["device"] == "cpu"


def test_a_snapshot_needs_trust_and_a_history(tmp_path, capsys) -> None:
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps({**synthetic_snapshot(), "device_traces": [[]]}))
    assert main(["analyze-trace", "--snapshot", str(snap)]) == 2
    assert "--trust-pickle" in capsys.readouterr().err
    assert main(["analyze-trace", "--snapshot", str(snap), "--trust-pickle"]) == 2
    assert "_record_memory_history" in capsys.readouterr().err
    assert main(["analyze-trace"]) == 2


def _mem(t: float, total: int, reserved: int, dev_type: int = 1) -> dict:
    return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1,
            "tid": 1, "ts": t, "args": {"Total Reserved": reserved, "Total Allocated": total,
                                        "Bytes": 512, "Device Id": 0 if dev_type else -1,
                                        "Device Type": dev_type, "Addr": 1}}


def _x(name: str, cat: str, t: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": t, "dur": dur}


def test_steps_phases_and_gaps_of_a_cuda_trace(tmp_path) -> None:
    """A hand-made trace in the profiler's layout (the events' keys as the CPU trace above
    has them), CUDA memory events (Device Type 1, Device Id 0): ProfilerStep#3 spans 0-100 us
    (so it is the job's step 4: prof.step() counts from the profiler's start), an autograd
    operator 40-60, Optimizer.step#AdamW.step 80-95; ProfilerStep#4 105-200. Memory at -5
    (before any step: setup, step 0), 10 (forward), 50 (backward), 70 (after backward:
    other), 90 (optimizer), 102 (between the steps: other of step 4), 110 (step 5's
    forward). Reserved is read on CUDA."""
    events = [_x("ProfilerStep#3", "user_annotation", 0, 100),
              _x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 40, 20),
              _x("Optimizer.step#AdamW.step", "user_annotation", 80, 15),
              _x("ProfilerStep#4", "user_annotation", 105, 95)]
    times = (-5, 10, 50, 70, 90, 102, 110)
    events += [_mem(t, 1000 + i, 4096) for i, t in enumerate(times)]
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    (tl,) = profiler_timelines(str(path))
    assert tl.device == "cuda:0"
    assert [(p.step, p.phase) for p in tl.points] == [
        (0, "setup"), (4, "forward"), (4, "backward"), (4, "other"), (4, "optimizer step"),
        (4, "other"), (5, "forward")]
    assert [p.allocated_bytes for p in tl.points] == [1000, 1001, 1002, 1003, 1004, 1005, 1006]
    assert {p.reserved_bytes for p in tl.points} == {4096}


def test_a_bad_memory_event_is_one_line(tmp_path, capsys) -> None:
    bad = _mem(1, 10, 0)
    bad["args"]["Total Allocated"] = "10"
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [_x("ProfilerStep#0", "user_annotation", 0, 5),
                                                bad]}))
    assert main(["analyze-trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Total Allocated" in err and "'10'" in err and err.count("\n") == 1


def test_a_ranks_trace_is_set_beside_its_own_stage(tmp_path, capsys) -> None:
    """A trace of rank 7 (distributedInfo) of 8 GPUs in 2 pipeline stages: ranks are ordered
    tp, cp, dp, pp, so rank 7 is in stage 1, whose first-step forward the estimate sets beside
    step 1's forward (and not the most loaded stage's)."""
    events = [_x("ProfilerStep#0", "user_annotation", 0, 100), _mem(10, 4096, 8192)]
    path = tmp_path / "rank7.json"
    path.write_text(json.dumps({"distributedInfo": {"rank": 7, "world_size": 8},
                                "traceEvents": events}))
    assert main(["analyze-trace", str(path), "-m", "tiny", "-n", "8", "--pp", "2",
                 "--json"]) == 0
    (tl,) = json.loads(capsys.readouterr().out)["memory"]
    from memplan.api import estimate

    est = estimate("tiny", gpus=8, pp=2)
    assert tl["rank"] == 7 and len(est.stages) == 2
    (row,) = tl["versus_estimate"]
    assert (row["step"], row["phase"]) == (1, "forward")
    assert row["estimated_bytes"] == est.stages[1].first_step.forward
    assert row["diff_bytes"] == 4096 - est.stages[1].first_step.forward
