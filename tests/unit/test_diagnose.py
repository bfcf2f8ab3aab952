"""``memplan diagnose``: OOM messages of every PyTorch format read to exact bytes, malformed
ones rejected in one line, findings from the message's own numbers, and fixes whose savings
are the difference of two ``memplan.estimate`` calls.

The messages follow the format strings of ``c10/cuda/CUDACachingAllocator.cpp`` in each
release (see ``memplan.diagnose.oom``); sizes are ``format_size`` output, two decimals of
KiB/MiB/GiB, so each expected byte count is ``round(value * unit)``, written out.
"""

from __future__ import annotations

import json
import pickle
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

import memplan
from memplan.cli import app, main
from memplan.diagnose import diagnose, parse_oom
from memplan.diagnose.explain import rank_bytes
from memplan.diagnose.snapshot import load_snapshot, snapshot_report
from memplan.errors import MemplanError
from memplan.units import GiB

# PyTorch 1.12: RuntimeError, the parenthesised format
V1_12 = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total "
         "capacity; 14.56 GiB already allocated; 21.88 MiB free; 14.65 GiB reserved in total by "
         "PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to "
         "avoid fragmentation.  See documentation for Memory Management and "
         "PYTORCH_CUDA_ALLOC_CONF")
# PyTorch 2.0: torch.cuda.OutOfMemoryError, same format, with a memory fraction set
V2_0 = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; "
        "23.65 GiB total capacity; 14.56 GiB already allocated; 845.01 MiB free; 22.50 GiB "
        "allowed; 22.28 GiB reserved in total by PyTorch) If reserved memory is >> allocated "
        "memory try setting max_split_size_mb to avoid fragmentation.  See documentation for "
        "Memory Management and PYTORCH_CUDA_ALLOC_CONF")
# PyTorch 2.1: sentences, "capacty", NVML process lines
V2_1 = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 146.97 MiB. GPU 0 "
        "has a total capacty of 23.65 GiB of which 22.81 MiB is free. Process 1234 has 1.63 GiB "
        "memory in use. Including non-PyTorch memory, this process has 22.28 GiB memory in use. "
        "Of the allocated memory 20.53 GiB is allocated by PyTorch, and 1.26 GiB is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "max_split_size_mb to avoid fragmentation.  See documentation for Memory Management  "
        "and PYTORCH_CUDA_ALLOC_CONF")
# PyTorch 2.2
V2_2 = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has "
        "a total capacity of 79.10 GiB of which 1.50 GiB is free. Including non-PyTorch memory, "
        "this process has 77.58 GiB memory in use. Of the allocated memory 74.20 GiB is "
        "allocated by PyTorch, and 2.50 GiB is reserved by PyTorch but unallocated. If reserved "
        "but unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  "
        "See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
# PyTorch 2.4+: torch.OutOfMemoryError (expandable_segments advice from 2.2), wrapped by torchrun
V2_5 = """[rank3]: Traceback (most recent call last):
[rank3]:   File "/workspace/train.py", line 212, in <module>
[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.71 GiB. GPU 3 has a
[rank3]: total capacity of 79.10 GiB of which 1.50 GiB is free. Including non-PyTorch memory,
[rank3]: this process has 77.58 GiB memory in use. Of the allocated memory 74.20 GiB is
[rank3]: allocated by PyTorch, and 2.50 GiB is reserved by PyTorch but unallocated. If reserved
[rank3]: but unallocated memory is large try setting
[rank3]: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See
[rank3]: documentation for Memory Management
[rank3]: (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
"""
# ROCm: "HIP", no NVML process lines, "0 bytes" from format_size
HIP = ("torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 MiB. GPU 0 has a "
       "total capacity of 191.98 GiB of which 0 bytes is free. Of the allocated memory 189.88 "
       "GiB is allocated by PyTorch, and 1.09 GiB is reserved by PyTorch but unallocated. If "
       "reserved but unallocated memory is large try setting "
       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")

GIB_BOUND = 5_368_710  # ceil(0.005 * 2^30): half a unit in the last printed place


def test_pytorch_1_12() -> None:
    r = parse_oom(V1_12)
    assert (r.kind, r.version, r.device, r.rank) == ("allocator", "1.x-2.0", 0, None)
    assert r.requested_bytes == 20_971_520
    assert r.total_bytes == 16_943_645_983
    assert r.allocated_bytes == 15_633_680_957
    assert r.free_bytes == 22_942_843
    assert r.reserved_bytes == 15_730_317_722
    assert r.unallocated_bytes == 15_730_317_722 - 15_633_680_957
    assert r.allowed_bytes is None and r.process_bytes is None
    # no NVML lines: everything on the device PyTorch did not reserve
    assert r.non_pytorch_bytes == 16_943_645_983 - 22_942_843 - 15_730_317_722
    assert r.rounding_bytes == GIB_BOUND


def test_pytorch_2_0_with_memory_fraction() -> None:
    r = parse_oom(V2_0)
    assert (r.version, r.device) == ("1.x-2.0", 1)
    assert r.requested_bytes == 2_147_483_648
    assert r.total_bytes == 25_393_994_138
    assert r.free_bytes == 886_057_206
    assert r.allowed_bytes == 24_159_191_040
    assert r.reserved_bytes == 23_922_967_839


def test_pytorch_2_1_with_other_process() -> None:
    r = parse_oom(V2_1)
    assert (r.version, r.device) == ("2.1+", 0)
    assert r.requested_bytes == 154_109_215
    assert r.total_bytes == 25_393_994_138
    assert r.free_bytes == 23_918_019
    assert r.other_processes_bytes == 1_750_199_173
    assert r.process_bytes == 23_922_967_839
    assert r.allocated_bytes == 22_043_919_647
    assert r.reserved_bytes == 22_043_919_647 + 1_352_914_698
    assert r.non_pytorch_bytes == 23_922_967_839 - (22_043_919_647 + 1_352_914_698)
    assert r.rounding_bytes == 2 * GIB_BOUND  # reserved is the sum of two printed sizes


def test_pytorch_2_2() -> None:
    r = parse_oom(V2_2)
    assert r.requested_bytes == 2_147_483_648
    assert r.total_bytes == 84_932_978_278
    assert r.process_bytes == 83_300_890_706
    assert r.allocated_bytes == 79_671_643_341
    assert r.unallocated_bytes == 2_684_354_560
    assert r.other_processes_bytes == 0


def test_pytorch_2_5_wrapped_by_the_launcher() -> None:
    r = parse_oom(V2_5)
    assert (r.version, r.device, r.rank) == ("2.1+", 3, 3)
    assert r.requested_bytes == 1_836_098_519
    assert r.allocated_bytes == 79_671_643_341
    assert r.reserved_bytes == 79_671_643_341 + 2_684_354_560


def test_rocm_zero_bytes_free() -> None:
    r = parse_oom(HIP)
    assert r.requested_bytes == 2_097_152
    assert r.free_bytes == 0
    assert r.total_bytes == 206_136_955_372
    assert r.allocated_bytes == 203_882_097_541
    assert r.unallocated_bytes == 1_170_378_588


def test_cuda_runtime_error_has_no_sizes() -> None:
    r = parse_oom("RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be "
                  "asynchronously reported at some other API call")
    assert (r.kind, r.requested_bytes, r.allocated_bytes) == ("driver", None, None)


@pytest.mark.parametrize("text, says", [
    ("", "empty"),
    ("Segmentation fault (core dumped)", "no PyTorch out-of-memory message"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total",
     "incomplete"),
    (V2_2.replace("74.20 GiB is allocated", "74.20 GB is allocated"), "incomplete"),
    ("RuntimeError: MPS backend out of memory (MPS allocated: 17.50 GB)", "MPS backend"),
])
def test_malformed_messages(text: str, says: str) -> None:
    with pytest.raises(MemplanError, match=says):
        parse_oom(text)


def test_malformed_message_cli_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "err.txt"
    path.write_text("CUDA out of memory. Tried to allocate lots")
    code = main(["diagnose", "-m", "tiny", "--oom", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("memplan: error: ") and err.count("\n") == 1
    assert "Traceback" not in err
    assert main(["diagnose", "-m", "tiny", "--oom", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt: no such file" in capsys.readouterr().err


# llama-2-7b on 8 H100s, ZeRO-1, micro-batch 4: does not fit (the estimate's 138.96 GiB)
CONFIG = {"gpus": 8, "gpu": "h100", "zero": 1, "micro_batch_size": 4}
CLI_CONFIG = ["-m", "llama-2-7b", "-n", "8", "--gpu", "h100", "--zero", "1", "--mbs", "4"]


def _message(requested: int, allocated: int, unallocated: int) -> str:
    g = lambda b: f"{b / GiB:.2f} GiB"
    return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {g(requested)}. GPU 0 "
            f"has a total capacity of 79.10 GiB of which 0.50 GiB is free. Including non-PyTorch "
            f"memory, this process has 78.60 GiB memory in use. Of the allocated memory "
            f"{g(allocated)} is allocated by PyTorch, and {g(unallocated)} is reserved by "
            f"PyTorch but unallocated.")


def test_fragmentation_and_loss_spike_named() -> None:
    est = memplan.estimate("llama-2-7b", **CONFIG)
    logits = 4 * 4 * 4096 * est.spec.vocab_size  # fp32, mbs 4, seq 4096, vocabulary
    r = diagnose("llama-2-7b", oom=_message(logits, 70 * GiB, 6 * GiB), fixes=False, **CONFIG)
    kinds = {f.kind: f for f in r.diagnosis.findings}
    assert kinds["fragmentation"].cause  # 6 GiB unallocated >= the request
    assert kinds["loss"].sizes["logits_bytes"] == logits
    assert r.diagnosis.capacity_bytes == 84_932_978_278  # the error's total capacity
    outside = kinds["outside_pytorch"].sizes
    assert outside["outside_bytes"] == round(78.60 * GiB) - round(76.00 * GiB)
    # little unallocated: no fragmentation finding
    r = diagnose("llama-2-7b", oom=_message(logits, 70 * GiB, GiB // 100), fixes=False, **CONFIG)
    assert "fragmentation" not in {f.kind for f in r.diagnosis.findings}


def test_comparison_states_the_gap() -> None:
    r = diagnose("llama-2-7b", oom=V2_2, fixes=False, **CONFIG)
    comp = next(f for f in r.diagnosis.findings if f.kind == "comparison")
    demand = 79_671_643_341 + 2_147_483_648
    assert comp.sizes["demand_bytes"] == demand
    assert comp.sizes["gap_bytes"] == abs(r.diagnosis.stage.tensor_peak_bytes - demand)
    assert r.diagnosis.dominant == ("saved activations", r.diagnosis.stage.activations_bytes)


def test_fails_from_step_two() -> None:
    """ZeRO-1: the steady backward (with the optimizer's states) is the peak."""
    kwargs = {"gpus": 8, "gpu": "h100", "zero": 1, "micro_batch_size": 1, "seq_len": 2048}
    est = memplan.estimate("llama-2-7b", **kwargs)
    first = rank_bytes(est, est.worst, est.worst.first_step.peak)
    assert first < est.peak_bytes
    r = diagnose("llama-2-7b", fixes=False, gpu_memory=(first + est.peak_bytes) // 2, **kwargs)
    found = next(f for f in r.diagnosis.findings if f.kind == "first_step")
    assert found.cause
    assert (r.diagnosis.failing_step, r.diagnosis.failing_phase) == ("steady", "forward")
    assert found.sizes["delta_bytes"] == est.worst.steady.forward - est.worst.first_step.forward


def test_fails_at_the_first_optimizer_step() -> None:
    """ZeRO-0: the first optimizer step (states created, foreach temporaries) is the peak."""
    kwargs = {"gpus": 8, "gpu": "h100", "zero": 0, "micro_batch_size": 1, "seq_len": 2048}
    est = memplan.estimate("llama-2-7b", **kwargs)
    w = est.worst
    fb = rank_bytes(est, w, max(w.first_step.forward, w.first_step.backward))
    r = diagnose("llama-2-7b", gpu_memory=(fb + est.peak_bytes) // 2, **kwargs)
    d = r.diagnosis
    assert (d.failing_step, d.failing_phase) == ("first step", "optimizer")
    kinds = {f.kind: f for f in d.findings}
    assert kinds["first_step"].sizes["opt_bytes"] == w.first_step.optimizer
    assert kinds["optimizer_temporaries"].sizes["temp_bytes"] == w.optimizer_temp_bytes > 0
    fused = next(f for f in r.fixes.ranked if f.name == "fused optimizer")
    again = memplan.estimate("llama-2-7b", optimizer_impl="fused", global_batch_size=8,
                             gpu_memory=(fb + est.peak_bytes) // 2, **kwargs)
    assert fused.saved_bytes == est.peak_bytes - again.peak_bytes > 0


def test_pipeline_imbalance() -> None:
    r = diagnose("llama-2-7b", fixes=False, gpus=8, pp=4, micro_batch_size=2)
    found = next(f for f in r.diagnosis.findings if f.kind == "pipeline_imbalance")
    peaks = [s.peak_bytes for s in r.diagnosis.estimate.stages]
    assert found.sizes["spread_bytes"] == max(peaks) - min(peaks)


def test_fix_savings_are_estimate_differences() -> None:
    r = diagnose("llama-2-7b", oom=V2_2, **CONFIG)
    base = memplan.estimate("llama-2-7b", gpu_memory=84_932_978_278, **CONFIG)
    assert r.fixes is not None and len(r.fixes.ranked) >= 5
    names = {f.name for f in r.fixes.ranked}
    assert {"recompute full", "TP 2", "ZeRO stage 3", "micro-batch 2 with more accumulation",
            "layout from memplan plan"} <= names
    for fix in r.fixes.ranked:
        kwargs = {**CONFIG, "gpu_memory": 84_932_978_278, "global_batch_size": 32, **fix.change}
        again = memplan.estimate("llama-2-7b", **kwargs)
        assert fix.peak_bytes == again.peak_bytes
        assert fix.saved_bytes == base.peak_bytes - again.peak_bytes > 0
        assert fix.fits == (again.peak_bytes <= 84_932_978_278)
    fitting = [f for f in r.fixes.ranked if f.fits]
    assert fitting and fitting == list(r.fixes.ranked[:len(fitting)])
    safe = [f for f in fitting if f.safe]  # 5% of the capacity free: first, fastest first
    assert safe == fitting[:len(safe)]
    assert [f.time.step_s for f in safe] == sorted(f.time.step_s for f in safe)
    for fix in fitting:
        assert fix.safe == (fix.peak_bytes <= 84_932_978_278 * 0.95)


def test_cli_json_fixes_match_estimate_cli(tmp_path) -> None:
    path = tmp_path / "err.txt"
    path.write_text(V2_5)
    runner = CliRunner()
    out = runner.invoke(app, ["diagnose", *CLI_CONFIG, "--oom", str(path), "--json"],
                        catch_exceptions=False)
    assert out.exit_code == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["oom"]["rank"] == 3 and data["oom"]["requested_bytes"] == 1_836_098_519
    assert data["estimate"]["peak_bytes"] == memplan.estimate("llama-2-7b", **CONFIG).peak_bytes
    checked = 0
    for fix in data["fixes"]:
        if not fix["flags"].startswith("--"):
            continue  # an environment variable, not an estimate option
        args = [*CLI_CONFIG, "--gpu-memory", str(data["capacity_bytes"]), "--gbs", "32",
                *shlex.split(fix["flags"]), "--json"]
        est = json.loads(runner.invoke(app, ["estimate", *args]).stdout)
        assert est["peak_bytes"] == fix["peak_bytes"], fix["name"]
        assert est["fits"] == fix["fits"]
        checked += 1
    assert checked >= 5
    assert data["utilisation"]["bound"] == "memory"


def test_cli_reads_stdin_and_prints_text() -> None:
    out = CliRunner().invoke(app, ["diagnose", *CLI_CONFIG, "--oom", "-"], input=V2_2,
                             env={"COLUMNS": "100"}, catch_exceptions=False)
    assert out.exit_code == 0
    assert "fixes (re-estimated" in out.stdout and "utilisation: memory-bound" in out.stdout


def test_utilisation_of_a_fitting_job() -> None:
    r = diagnose("llama-2-7b", fixes=False, gpus=8, zero=1)
    u = r.utilisation
    assert u.bound == "compute" and u.headroom_bytes == r.diagnosis.estimate.headroom_bytes
    assert u.recompute_share == 0.0


SNAPSHOT = {
    "segments": [
        {"device": 0, "total_size": 20 * 2**20, "allocated_size": 12 * 2**20,
         "blocks": [{"size": 12 * 2**20, "state": "active_allocated"},
                    {"size": 6 * 2**20, "state": "inactive"},
                    {"size": 2 * 2**20, "state": "inactive"}]},
        {"device": 0, "total_size": 2 * 2**20, "allocated_size": 2 * 2**20,
         "blocks": [{"size": 2 * 2**20, "state": "active_allocated"}]},
    ],
    "device_traces": [[{"action": "alloc", "addr": 1, "size": 512},
                       {"action": "oom", "size": 7 * 2**20, "device_free": 1024}]],
}


def test_snapshot_needs_trust(tmp_path, capsys) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(SNAPSHOT))
    assert main(["diagnose", "-m", "tiny", "--snapshot", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--trust-pickle" in err and "run arbitrary code" in err and err.count("\n") == 1
    r = snapshot_report(load_snapshot(str(path), trust_pickle=True))
    assert (r.reserved_bytes, r.allocated_bytes) == (22 * 2**20, 14 * 2**20)
    assert (r.requested_bytes, r.free_bytes) == (7 * 2**20, 1024)
    assert (r.largest_free_block_bytes, r.num_segments) == (6 * 2**20, 2)
    assert main(["diagnose", "-m", "tiny", "--snapshot", str(path), "--trust-pickle",
                 "--no-fixes", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    frag = next(f for f in data["findings"] if f["kind"] == "fragmentation")
    assert frag["sizes"]["largest_free_bytes"] == 6 * 2**20


class _Evil:
    def __reduce__(self):
        return (print, ("executed",))


def test_snapshot_with_globals_is_refused(tmp_path, capsys) -> None:
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [_Evil()]}))
    with pytest.raises(MemplanError, match="builtins.print"):
        load_snapshot(str(path), trust_pickle=True)
    assert "executed" not in capsys.readouterr().out
    path.write_bytes(b"not a pickle")
    with pytest.raises(MemplanError, match="not a readable pickle"):
        load_snapshot(str(path), trust_pickle=True)


def _timeline():
    from memplan.measure.timeline import Sample, Timeline

    mib = 2**20
    samples = [Sample(0, 1, "forward", 10 * mib, {"parameters": 4 * mib}, reserved_bytes=12 * mib),
               Sample(1, 1, "backward", 30 * mib, {"activations": 20 * mib, "parameters": 4 * mib},
                      reserved_bytes=40 * mib),
               Sample(2, 2, "forward", 12 * mib, {"parameters": 4 * mib}, reserved_bytes=40 * mib),
               Sample(3, 2, "backward", 31 * mib, {"activations": 21 * mib},
                      reserved_bytes=40 * mib),
               Sample(4, 2, "optimizer", 8 * mib, {"optimizer": 6 * mib}, reserved_bytes=40 * mib)]
    return Timeline(device="cuda", source="allocator", num_steps=2, samples=samples)


def test_profile_directory(tmp_path) -> None:
    from memplan.measure.timeline import write

    write(_timeline(), tmp_path)
    r = diagnose("tiny", profile=str(tmp_path), fixes=False)
    kinds = {f.kind: f for f in r.diagnosis.findings}
    measured = kinds["profile"].sizes
    assert measured["measured_bytes"] == 31 * 2**20
    assert measured["predicted_bytes"] == r.diagnosis.stage.steady.backward
    assert measured["category_bytes"] == 21 * 2**20
    assert kinds["fragmentation"].sizes["cache_bytes"] == 9 * 2**20  # 40 reserved - 31 MiB
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(MemplanError, match="phases is missing, not an object"):
        diagnose("tiny", profile=str(tmp_path), fixes=False)
    assert main(["diagnose", "-m", "tiny", "--profile", str(tmp_path / "none")]) == 2


def test_under_prediction_carries_into_the_fixes() -> None:
    """Rank 40 of tp 8 x dp 2 x pp 4 is on stage 40 // 16 = 2; the job held more than the
    estimate there, and each fix is judged with that excess added."""
    text = V2_5.replace("[rank3]", "[rank40]").replace("1.71 GiB", "448.00 MiB")
    kwargs = {"gpus": 64, "tp": 8, "pp": 4, "zero": 1, "micro_batch_size": 1, "seq_len": 8192,
                  "global_batch_size": 256}
    r = diagnose("llama-3-70b", oom=text, **kwargs)
    d = r.diagnosis
    assert d.stage.stage == 2 and d.fails
    margin = 79_671_643_341 + 469_762_048 - d.stage.tensor_peak_bytes
    assert margin > 0
    assert next(f for f in d.findings if f.kind == "comparison").cause
    for fix in r.fixes.ranked:
        assert fix.margin_bytes == margin
        assert fix.fits == (fix.peak_bytes + margin <= 84_932_978_278)
    assert r.utilisation.bound == "memory"


def test_pytorch_1_4_cached() -> None:
    r = parse_oom("RuntimeError: CUDA out of memory. Tried to allocate 128.00 MiB (GPU 0; 15.78 "
                  "GiB total capacity; 14.56 GiB already allocated; 21.88 MiB free; 14.65 GiB "
                  "cached)")
    assert (r.requested_bytes, r.reserved_bytes) == (134_217_728, 15_730_317_722)


@pytest.mark.parametrize("middle", [
    "22.50 GiB allowed; Including non-PyTorch memory, this process has 22.28 GiB memory in use. ",
    "Including non-PyTorch memory, this process has 22.28 GiB memory in use. 22.50 GiB allowed; ",
])
def test_memory_fraction_in_either_place(middle: str) -> None:
    r = parse_oom("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                  f"23.65 GiB of which 845.01 MiB is free. {middle}Of the allocated memory 20.53 "
                  "GiB is allocated by PyTorch, and 1.26 GiB is reserved by PyTorch but "
                  "unallocated.")
    assert (r.allowed_bytes, r.process_bytes) == (24_159_191_040, 23_922_967_839)
    assert r.free_bytes == 886_057_206


def test_xpu_without_free() -> None:
    r = parse_oom("torch.OutOfMemoryError: XPU out of memory. Tried to allocate 2.00 GiB. GPU 0 "
                  "has a total capacity of 31.75 GiB. Of the allocated memory 30.12 GiB is "
                  "allocated by PyTorch, and 1.26 GiB is reserved by PyTorch but unallocated.")
    assert (r.total_bytes, r.free_bytes) == (34_091_302_912, None)
    assert r.allocated_bytes == 32_341_103_739 and r.non_pytorch_bytes is None


def test_message_and_snapshot_together(tmp_path, capsys) -> None:
    """The message gives the sizes; the snapshot adds its largest free block."""
    snap, err = tmp_path / "snap.pickle", tmp_path / "err.txt"
    snap.write_bytes(pickle.dumps(SNAPSHOT))
    err.write_text(V2_2)
    assert main(["diagnose", *CLI_CONFIG, "--oom", str(err), "--snapshot", str(snap),
                 "--trust-pickle", "--no-fixes", "--json"]) == 0
    oom = json.loads(capsys.readouterr().out)["oom"]
    assert (oom["version"], oom["requested_bytes"]) == ("2.1+", 2_147_483_648)
    assert (oom["largest_free_block_bytes"], oom["num_segments"]) == (6 * 2**20, 2)


# MemoryMonitor records written by hand: the fields memplan.monitor.MemoryMonitor._step writes.
MiB = 2**20


def _record(rank, step, alloc, peak, reserved, split=0, retries=0, ooms=0, cap=80 * GiB):
    return {"rank": rank, "step": step, "time": 1.7e9 + step, "step_time_s": 0.5,
            "allocated_bytes": alloc, "reserved_bytes": reserved, "peak_bytes": peak,
            "inactive_split_bytes": split, "alloc_retries": retries, "num_ooms": ooms,
            "capacity_bytes": cap, "fragmentation_bytes": reserved - alloc,
            "headroom_bytes": cap - max(reserved, peak), "warnings": []}


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _two_monitored_ranks(tmp_path):
    """Rank 0: 2 quiet steps, peak 5 GiB. Rank 1: 6 steps, allocated at step end k GiB and the
    step's peak k + 2 GiB at step k, 10 GiB reserved, 64 MiB of inactive split blocks, 3
    allocation retries by the end: the worse rank (peak 8 GiB), and it grows 5 steps in a
    row (+5 GiB), the monitor's leak rule. Its largest unused cache is at step 1: 10 GiB
    reserved less a 3 GiB peak = 7 GiB (70% > 5%); reserved less allocated there is 9 GiB."""
    _write_jsonl(tmp_path / "memory_rank0.jsonl",
                 [_record(0, s, GiB, 5 * GiB, 6 * GiB) for s in (1, 2)])
    _write_jsonl(tmp_path / "memory_rank1.jsonl",
                 [_record(1, k, k * GiB, (k + 2) * GiB, 10 * GiB, 64 * MiB, max(k - 3, 0))
                  for k in range(1, 7)])
    return tmp_path


MONITOR_CONFIG = {"gpus": 2, "pp": 2}  # tiny on 2 stages: rank 1 is stage 1


def test_monitor_worst_rank_against_its_stage(tmp_path) -> None:
    _two_monitored_ranks(tmp_path)
    r = diagnose("tiny", monitor=str(tmp_path), fixes=False, **MONITOR_CONFIG)
    est = memplan.estimate("tiny", gpu_memory=80 * GiB, **MONITOR_CONFIG)
    stage1 = est.stages[1]
    assert r.capacity_source == "the monitor's device capacity"
    assert r.diagnosis.capacity_bytes == 80 * GiB
    assert r.monitor.worst_rank == 1
    kinds = {f.kind: f for f in r.diagnosis.findings}
    peak = kinds["monitor_peak"]
    want_reserved = stage1.peak_bytes - stage1.cuda_context_bytes
    assert peak.sizes == {
        "measured_bytes": 8 * GiB, "predicted_bytes": stage1.tensor_peak_bytes,
        "peak_gap_bytes": 8 * GiB - stage1.tensor_peak_bytes,
        "measured_reserved_bytes": 10 * GiB, "predicted_reserved_bytes": want_reserved,
        "reserved_gap_bytes": 10 * GiB - want_reserved}
    pct = 100.0 * (8 * GiB - stage1.tensor_peak_bytes) / stage1.tensor_peak_bytes
    assert f"({pct:+.1f}%) above" in peak.text and "stage 1" in peak.text and peak.cause
    assert kinds["fragmentation"].sizes == {"reserved_bytes": 10 * GiB, "cache_bytes": 7 * GiB,
                                            "split_bytes": 64 * MiB,
                                            "unallocated_bytes": 9 * GiB}
    assert "rank 1 at step 1" in kinds["fragmentation"].text
    assert kinds["alloc_retries"].text.startswith("3 allocation retries on rank 1 (1 of 2 ")
    assert "num_ooms" not in kinds  # zero on every rank
    leak = kinds["leak"]
    assert leak.sizes == {"growth_bytes": 5 * GiB} and "from step 1 to 6" in leak.text
    assert kinds["headroom"].sizes == {"headroom_bytes": 70 * GiB, "device_bytes": 80 * GiB,
                                       "predicted_headroom_bytes": 80 * GiB - stage1.peak_bytes}
    assert "(87.5%;" in kinds["headroom"].text and not kinds["headroom"].cause


def test_monitor_cli_json_and_text(tmp_path, capsys) -> None:
    """Two files given one by one, rank 0's quiet and rank 1's worse; --json keeps int bytes."""
    _two_monitored_ranks(tmp_path)
    files = [str(tmp_path / "memory_rank0.jsonl"), str(tmp_path / "memory_rank1.jsonl")]
    assert main(["diagnose", "-m", "tiny", "-n", "2", "--pp", "2", "--monitor", files[0],
                 "--monitor", files[1], "--no-fixes", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    mon = data["monitor"]
    assert (mon["worst_rank"], mon["worst_stage"], mon["files"]) == (1, 1, files)
    assert mon["ranks"]["1"]["max_peak_bytes"] == 8 * GiB
    assert mon["ranks"]["0"]["max_reserved_bytes"] == 6 * GiB
    found = {f["kind"]: f for f in data["findings"]}
    assert found["monitor_peak"]["sizes"]["measured_bytes"] == 8 * GiB
    assert found["leak"]["sizes"]["growth_bytes"] == 5 * GiB
    assert found["fragmentation"]["cause"] is True
    out = CliRunner().invoke(app, ["diagnose", "-m", "tiny", "-n", "2", "--pp", "2",
                                   "--monitor", str(tmp_path), "--no-fixes"],
                             env={"COLUMNS": "100"}, catch_exceptions=False)
    assert out.exit_code == 0
    assert ("monitor (2 files, 2 ranks): worst rank 1, 6 steps, peak 8.00 GiB, reserved "
            "10.00 GiB, least headroom 70.00 GiB") in out.stdout
    assert "+5.00 GiB" in out.stdout


def test_monitor_quiet_rank_and_ooms(tmp_path) -> None:
    """One rank near its capacity: 38 GiB reserved of 40 GiB (5% headroom would be 2 GiB, so
    2 GiB - 1 byte is under it), an OOM raised, reserved within 5% of the peak, no growth."""
    cap = 40 * GiB
    recs = [_record(0, 1, 4 * GiB, 37 * GiB, 38 * GiB, cap=cap),
            _record(0, 2, 4 * GiB, 38 * GiB, 38 * GiB + 1, ooms=1, cap=cap)]
    path = _write_jsonl(tmp_path / "memory_rank0.jsonl", recs)
    r = diagnose("tiny", monitor=[str(path)], fixes=False, gpu_memory=cap)
    kinds = {f.kind: f for f in r.diagnosis.findings}
    assert r.capacity_source == "--gpu-memory"
    assert "fragmentation" not in kinds and "leak" not in kinds and "alloc_retries" not in kinds
    assert kinds["num_ooms"].text.startswith("1 out-of-memory errors on rank 0 (1 of 1 ")
    room = kinds["headroom"]
    assert room.sizes["headroom_bytes"] == 2 * GiB - 1 and room.cause
    assert "under the monitor's 5%" in room.text


def test_monitor_step_times_only(tmp_path) -> None:
    recs = [{"rank": 0, "step": s, "time": 1.7e9, "step_time_s": 0.25, "warnings": []}
            for s in (1, 2)]
    path = _write_jsonl(tmp_path / "memory_rank0.jsonl", recs)
    r = diagnose("tiny", monitor=str(path), fixes=False)
    found = [f for f in r.diagnosis.findings if f.kind in ("monitor_peak", "headroom", "leak")]
    assert [f.kind for f in found] == ["monitor_peak"] and "step times only" in found[0].text
    assert r.capacity_source == "GPU catalog"


@pytest.mark.parametrize("lines, says", [
    ([json.dumps(_record(0, 1, GiB, GiB, GiB)), '{"rank": 0, "step": 2, "allocated_',
      json.dumps(_record(0, 3, GiB, GiB, GiB))], "line 2 (byte offset 318) is not JSON"),
    (['{"step": 1, "step_time_s": 0.5}'], "line 1 (byte offset 0): 'rank' is null, not an int"),
    (["", json.dumps({**_record(0, 1, GiB, GiB, GiB), "peak_bytes": "8GiB"})],
     "line 2 (byte offset 1): 'peak_bytes' is '8GiB', not a byte count"),
    (["[1, 2]"], "line 1 (byte offset 0): a record is a JSON object, not list"),
    ([""], "holds no records"),
])
def test_monitor_malformed_one_line(tmp_path, capsys, lines, says) -> None:
    good = _write_jsonl(tmp_path / "memory_rank1.jsonl", [_record(1, 1, GiB, GiB, GiB)])
    bad = tmp_path / "memory_rank0.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    assert main(["diagnose", "-m", "tiny", "--monitor", str(good), "--monitor", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"memplan: error: --monitor: {bad}") and says in err
    assert err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(MemplanError, match=re.escape(says)):
        diagnose("tiny", monitor=str(tmp_path), fixes=False)


@pytest.mark.parametrize("newline", ["", "\n"])
def test_monitor_cut_last_record_is_reported_and_the_rest_used(tmp_path, capsys,
                                                                newline) -> None:
    """A job killed while writing leaves its last record cut (usually without its newline):
    ``diagnose --monitor`` and ``monitor-summary`` both read the records before it, say so on
    one stderr line naming the file and line, and mark the result partial."""
    recs = [_record(0, s, s * GiB, (s + 1) * GiB, 8 * GiB) for s in (1, 2)]
    path = tmp_path / "memory_rank0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs)
                    + json.dumps(_record(0, 3, GiB, GiB, GiB))[:40] + newline)
    assert main(["monitor-summary", str(tmp_path), "--json"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["ranks"]["0"]["num_steps"] == 2
    assert summary["ranks"]["0"]["max_peak_bytes"] == 3 * GiB
    assert summary["partial"] == [(f"{path} line 3 is cut (40 bytes of a record: the job "
                                   "stopped while writing it); the 2 records before it are used")]
    assert err == f"memplan: warning: {summary['partial'][0]}\n"
    assert main(["diagnose", "-m", "tiny", "--monitor", str(path), "--no-fixes", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and f"{path} line 3 is cut" in err
    found = {f["kind"]: f for f in json.loads(out)["findings"]}
    assert "partial monitor evidence" in found["monitor_partial"]["message"]

    r = diagnose("tiny", monitor=str(path), fixes=False)
    assert r.monitor.summary["ranks"][0]["num_steps"] == 2 and len(r.monitor.partial) == 1


def test_monitor_cut_record_then_a_restarted_job(tmp_path) -> None:
    """A restarted job appends to the file its killed predecessor cut: the cut record and the
    new first record share a line. The new record is read, the cut one skipped and named."""
    cut = json.dumps(_record(0, 7, GiB, GiB, GiB))[:55]
    path = tmp_path / "memory_rank0.jsonl"
    path.write_text(json.dumps(_record(0, 6, GiB, GiB, GiB)) + "\n" + cut
                    + json.dumps(_record(0, 1, 2 * GiB, 2 * GiB, 4 * GiB)) + "\n")
    r = diagnose("tiny", monitor=str(path), fixes=False)
    assert [rec["step"] for rec in r.monitor.records[0]] == [6, 1]
    assert r.monitor.partial == ((f"{path} line 2 starts with a record cut by a stopped job "
                                  "(55 bytes, skipped) before the restarted job's first record"),)


def test_monitor_missing_paths(tmp_path, capsys) -> None:
    missing = tmp_path / "missing.jsonl"
    assert main(["diagnose", "-m", "tiny", "--monitor", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"memplan: error: --monitor: {missing}: no such file\n"

    assert main(["diagnose", "-m", "tiny", "--monitor", str(tmp_path)]) == 2
    assert f"{tmp_path} holds no memory_rank*.jsonl files" in capsys.readouterr().err


def test_chunked_loss_fix_is_re_estimated() -> None:
    """Llama-2-7B (V 32,000, h 4096): ceil(V / h) = 8 chunks. The failed allocation is one fp32
    logits tensor; the chunked-loss fix's peak is `estimate --loss-chunks 8`'s."""
    est = memplan.estimate("llama-2-7b", **CONFIG)
    logits = 4 * 4 * 4096 * est.spec.vocab_size
    r = diagnose("llama-2-7b", oom=_message(logits, 70 * GiB, GiB // 100), **CONFIG)
    fix = next(f for f in r.fixes.ranked if f.name.startswith("chunked cross-entropy"))
    assert fix.change == {"loss_chunks": 8} and fix.flags.startswith("--loss-chunks 8")
    again = memplan.estimate("llama-2-7b", gpu_memory=r.diagnosis.capacity_bytes,
                             global_batch_size=est.global_batch_size, loss_chunks=8, **CONFIG)
    assert fix.peak_bytes == again.peak_bytes
    # the saved log-softmax (T * V * 4) and a loss scalar are gone from the activations
    assert est.worst.activations_bytes - again.worst.activations_bytes == logits + 4
    assert fix.saved_bytes == r.fixes.baseline.peak_bytes - again.peak_bytes > logits


def test_requested_size_is_the_allocator_segment() -> None:
    """The caching allocator reports the segment it asked the driver for: a 40,000 B tensor
    asks for 2 MiB (pytorch/pytorch#67971 prints "Tried to allocate 2.00 MiB"), one under
    10 MiB for 20 MiB, a larger one rounded up to 2 MiB; cudaMallocAsync reports the request."""
    from memplan.diagnose.oom import OomReport, request_matches, segment_bytes

    assert segment_bytes(40_000) == 2 * 1024**2
    assert segment_bytes(5 * 1024**2) == 20 * 1024**2
    assert segment_bytes(10 * 1024**2 + 1) == 12 * 1024**2
    # Llama-3-8B's fp32 logits at mbs 1, seq 4095: 4095 * 128,256 * 4 = 2,100,813,120 B, a
    # segment of 1,002 * 2 MiB = 2,101,346,304 B ("Tried to allocate 1.96 GiB")
    logits = 4095 * 128_256 * 4
    assert segment_bytes(logits) == 2_101_346_304
    cached = OomReport(kind="allocator", version="2.1+", requested_bytes=2_101_346_304)
    assert request_matches(cached, logits) and not request_matches(cached, logits // 2)
    exact = OomReport(kind="allocator", version="cudaMallocAsync", requested_bytes=logits)
    assert request_matches(exact, logits) and not request_matches(exact, logits + 512)


def test_private_pools_named_in_the_comparison() -> None:
    """A 2.4+ message with CUDA-graph private pools: the comparison names them."""
    text = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB. GPU 5 has a "
            "total capacity of 79.19 GiB of which 1.12 GiB is free. Including non-PyTorch memory, "
            "this process has 78.06 GiB memory in use. Of the allocated memory 74.30 GiB is "
            "allocated by PyTorch, with 512.00 MiB allocated in private pools (e.g., CUDA "
            "Graphs), and 2.81 GiB is reserved by PyTorch but unallocated.")
    r = diagnose("llama-3-8b", oom=text, fixes=False, gpus=16, zero=1, micro_batch_size=1,
                 seq_len=4095, global_batch_size=64)
    comp = next(f for f in r.diagnosis.findings if f.kind == "comparison")
    assert comp.cause and comp.sizes["private_pool_bytes"] == 512 * 1024**2


def test_pure_bf16_recipe_is_offered_and_saves_eight_bytes_per_parameter() -> None:
    """A single-GPU bf16-mixed fine-tune of Llama-2-7B (6,738,415,616 parameters) with full
    recompute does not fit in 80 GB: bf16 weights (2 B) and gradients (2 B), an fp32 master
    copy (4 B) and two fp32 Adam states (8 B) are 16 B per parameter, 107.8 GB before any
    activation. The pure-bf16 recipe keeps the weights and gradients and drops the master copy,
    its two states in bf16 (2 x 2 B): 8 B per parameter, so the model states shrink by exactly
    8 x 6,738,415,616 = 53,907,324,928 B, and 53.9 GB of states fit."""
    given = dict(gpus=1, micro_batch_size=1, seq_len=2048, precision="bf16-mixed",
                 recompute="full")
    r = diagnose("llama-2-7b", gpu_memory=80 * 10**9, **given)
    fix = next(f for f in r.fixes.ranked if f.flags.startswith("--precision bf16-pure"))
    base, new = r.diagnosis.estimate.stages[0], fix.estimate.stages[0]
    states = lambda s: s.params_bytes + s.grads_bytes + s.optimizer_bytes  # noqa: E731
    assert base.num_params == 6_738_415_616
    assert states(base) - states(new) == 8 * 6_738_415_616
    assert fix.fits and not base.peak_bytes <= 80 * 10**9


def test_eight_bit_states_and_offloads_are_offered_with_their_bytes() -> None:
    """A pure-bf16 full fine-tune of Llama-2-7B (6,738,415,616 parameters, every tensor of at
    least 4,096 elements, each a multiple of 256) on one 32 GB GPU. AdamW keeps two bf16
    states, 4 B per parameter. bitsandbytes' AdamW8bit keeps two uint8 states and one fp32
    absmax per 256-element block of each: 2 + 2 x 4 / 256 = 2 + 1/32 B per parameter, plus its
    two 256-entry fp32 quantization maps (2,048 B): the states shrink by
    63/32 x 6,738,415,616 - 2,048 = 13,266,253,696 B. Offloading the saved activations is
    offered too; the job has no ZeRO-3, so offloading its weights is not."""
    given = dict(gpus=1, micro_batch_size=1, seq_len=2048, precision="bf16-pure",
                 recompute="full")
    r = diagnose("llama-2-7b", gpu_memory=32 * 10**9, **given)
    fixes = {f.flags.split(" --gbs")[0]: f for f in r.fixes.ranked}
    skipped = dict(r.fixes.skipped)
    base = r.diagnosis.estimate.stages[0]
    eight = fixes["--optimizer adamw8bit"].estimate.stages[0]
    assert base.optimizer_bytes - eight.optimizer_bytes == 13_266_253_696
    assert fixes["--optimizer paged-adamw8bit"].fits
    assert "--offload activations" in fixes or \
        "saved activations offloaded to the host (save_on_cpu)" in skipped
    assert not any("CPUOffloadPolicy" in name for name in [*skipped, *(
        f.name for f in r.fixes.ranked)])


def test_plan_ranks_the_savers_when_nothing_fits(capsys) -> None:
    """Llama-2-7B on one RTX 4090 fits in no layout (bf16-mixed AdamW: 16 B per parameter,
    108 GB). The plan's JSON ranks the savers applied to its closest configuration, each
    re-estimated: a saver that fits is one whose peak is within the plan's budget, and that
    peak is what memplan.estimate gives with the saver's flags on that configuration
    (QLoRA fits only under full recompute, which its flags say)."""
    from memplan.cli import main

    code = main(["plan", "-m", "llama-2-7b", "--gpus", "1", "--gpu", "rtx-4090", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and not out["candidates"]
    ranked = out["savers"]["ranked"]
    fits = [f for f in ranked if f["fits"]]
    assert fits and ranked[:len(fits)] == fits
    assert all(f["peak_bytes"] <= out["budget_bytes"] for f in fits)
    qlora = next(f for f in ranked if f["flags"].startswith("--lora-rank 8 --base-quant nf4"))
    assert qlora["fits"] and qlora["flags"].endswith("--recompute full")
    again = memplan.estimate("llama-2-7b", gpus=1, gpu="rtx-4090", lora_rank=8,
                             base_quant="nf4", recompute="full", micro_batch_size=1,
                             global_batch_size=out["global_batch_size"])
    assert qlora["peak_bytes"] == again.peak_bytes
    assert out["savers"]["baseline_peak_bytes"] == out["closest_miss"]["peak_bytes"] or \
        out["savers"]["baseline_peak_bytes"] > out["budget_bytes"]


OOM_REPORTS = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "data"
                          / "oom_reports.json").read_text())


@pytest.mark.parametrize("report", OOM_REPORTS, ids=[r["id"] for r in OOM_REPORTS])
def test_real_fine_tuning_ooms_get_a_saver_that_fits(report) -> None:
    """Eight fine-tuning jobs that ran out of memory, from public issue threads, described
    by the settings their threads give (benchmarks/data/oom_reports.json, with each source):
    diagnose proposes at least one change the estimate says fits. Where the thread says what
    fixed it or what the arithmetic gives (``expected``), one of those is among the fitting
    changes, but for alpaca-lora's 65B int8 job: read as amp-fp16 (fp32 weights under
    autocast, an fp32 residual stream) its activations are what overflows, and only the
    pure-bf16 recipe fits."""
    args = dict(report["memplan_args"])
    result = diagnose(args.pop("model"), **args)
    fitting = {f.flags.split(" --gbs")[0] for f in result.fixes.ranked if f.fits}
    assert fitting, report["id"]
    expected = {x["flags"] for x in report["expected"]["fits_with"]}
    if report["id"].startswith("alpaca-lora/"):
        assert fitting == {"--precision bf16-pure"}
    else:
        assert expected & fitting, (report["id"], sorted(fitting))
