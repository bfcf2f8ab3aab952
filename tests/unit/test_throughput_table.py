"""The throughput comparison's statistics and its data file (benchmarks/throughput_table.py,
benchmarks/data/throughput_runs.json)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.throughput_table import load_runs, ranks, spearman  # noqa: E402


def test_ranks_share_ties():
    # 5 is the smallest (rank 1); the two 7s share ranks 2 and 3: 2.5 each; 9 is rank 4
    assert ranks([7, 5, 9, 7]) == [2.5, 1.0, 4.0, 2.5]


def test_spearman_by_hand():
    """published 1, 2, 3 against predicted 10, 30, 20: rank differences 0, -1, 1, so
    rho = 1 - 6 * 2 / (3 * (9 - 1)) = 0.5."""
    assert spearman([1, 2, 3], [10, 30, 20]) == pytest.approx(0.5)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # a flat prediction orders nothing
    assert spearman([1, 2, 3], [5, 5, 5]) is None


def test_every_run_names_its_source_and_what_it_published():
    runs = load_runs()
    assert len({r["id"] for r in runs}) == len(runs)
    for r in runs:
        assert r["source"].startswith("https://")
        assert r["quote"] and r["group"]
        assert set(r["published"]) & {"tokens_per_s_per_gpu", "mfu"}
        assert {"model", "gpus"} <= set(r["memplan_args"])


def test_a_published_mfu_beside_its_speed_counts_the_sources_flops():
    """KempnerForge #1 publishes 10,471 tok/s and MFU 0.578 (its own FLOPs, 6 P + 12 L D S):
    a step time giving 5,235.5 tok/s is half the speed, so MFU 0.289 in the same count.
    Korthikanti et al.'s 22B selective run: 1.1 s per iteration at MFU 0.415; a step of 2.2 s
    is MFU 0.2075. Without a speed beside it (the Llama 3 paper), memplan's own MFU."""
    from types import SimpleNamespace

    from benchmarks.throughput_table import _value

    st = SimpleNamespace(tokens_per_s_per_gpu=5235.5, step_s=2.2, mfu=0.3)
    assert _value(st, {"tokens_per_s_per_gpu": 10471.0, "mfu": 0.578}, "mfu") == \
        pytest.approx(0.289)
    assert _value(st, {"iteration_s": 1.1, "mfu": 0.415}, "mfu") == pytest.approx(0.2075)
    assert _value(st, {"mfu": 0.41, "tflops_per_gpu": 400}, "mfu") == 0.3
    assert _value(st, {"tokens_per_s_per_gpu": 4000.0}, "tokens_per_s_per_gpu") == 5235.5


def test_the_published_step_in_seconds():
    """Korthikanti et al.'s 22B selective run publishes 1.1 s per iteration: read as is.
    torchtitan's 8B FSDP run publishes 5,762 tokens/s/GPU at global batch 16 of 8,192 tokens
    on 8 GPUs: 16 x 8192 / (5762 x 8) = 131072 / 46096 = 2.843457 s. The Llama 3 paper
    publishes an MFU only: no step."""
    from types import SimpleNamespace

    from benchmarks.throughput_table import published_step_s

    est = SimpleNamespace(global_batch_size=16, workload=SimpleNamespace(seq_len=8192),
                          parallel=SimpleNamespace(world_size=8))
    assert published_step_s({"published": {"iteration_s": 1.1, "mfu": 0.415}}, est) == 1.1
    assert published_step_s({"published": {"tokens_per_s_per_gpu": 5762.0}}, est) == \
        pytest.approx(2.843457, abs=1e-6)
    assert published_step_s({"published": {"mfu": 0.41}}, est) is None


def test_the_rate_the_published_step_leaves(monkeypatch):
    """A step of 8 GPUs, 8e15 hardware FLOPs (1e15 a GPU) on an A100 (312e12 dense BF16):
    memplan's compute takes 8 s, its bubble 1 s and its exposed communication 0.5 s. Its
    compute rate is 1e15 / 8 / 312e12 = 0.400641; a published 6 s step leaves 6 - 1 - 0.5 =
    4.5 s for the same FLOPs: 1e15 / 4.5 / 312e12 = 0.712251. A published step shorter than
    the bubble and the communication alone leaves none."""
    from types import SimpleNamespace

    import benchmarks.throughput_table as tt

    est = SimpleNamespace(parallel=SimpleNamespace(world_size=8, tp=8),
                          gpu=SimpleNamespace(bf16_flops=312e12), spec=None)
    st = SimpleNamespace(hardware_flops=8e15, compute_s=8.0, bubble_s=1.0, exposed_comm_s=0.5)
    monkeypatch.setattr(tt.memplan, "estimate", lambda **_: est)
    monkeypatch.setattr(tt, "_args", lambda run: {})
    monkeypatch.setattr(tt, "_timed", lambda e, run: st)
    monkeypatch.setattr(tt, "linear_time_factor", lambda *a: 1.0)
    run = {"published": {"iteration_s": 6.0}, "memplan_args": {}}
    b = tt.breakdown(run)
    assert b["rate"] == pytest.approx(0.400641, abs=1e-6)
    assert b["left_rate"] == pytest.approx(0.712251, abs=1e-6)
    assert tt.breakdown({"published": {"iteration_s": 1.2}, "memplan_args": {}})["left_rate"] \
        is None


def test_rank_correlation_with_a_term_left_out(monkeypatch):
    """Three runs published in the order a < b < c, each at memplan's step of 10 s: a at 0.5
    (no bubble, no exposed communication), b at 0.4 with a 5 s bubble, c at 0.3 with 5 s of
    exposed communication; memplan orders them c < b < a: rho -1. Without the bubble b runs
    at 0.4 x 10 / 5 = 0.8: ranks (a, b, c) = (2, 3, 1), differences -1, -1, 2, rho = 1 - 6 x 6
    / (3 x 8) = -0.5. Without the communication c runs at 0.6: ranks (2, 1, 3), rho = 1 - 6 x
    2 / 24 = 0.5. Without both: 0.5, 0.8, 0.6, ranks (1, 3, 2), rho 0.5."""
    from types import SimpleNamespace

    import benchmarks.throughput_table as tt

    steps = {"a": (0.0, 0.0), "b": (5.0, 0.0), "c": (0.0, 5.0)}
    monkeypatch.setattr(tt, "breakdown", lambda run: {"st": SimpleNamespace(
        step_s=10.0, bubble_s=steps[run["id"]][0], exposed_comm_s=steps[run["id"]][1])})
    members = [{"run": {"id": i}, "published": p, "memplan": m}
               for i, p, m in (("a", 1.0, 0.5), ("b", 2.0, 0.4), ("c", 3.0, 0.3))]
    rho = tt.term_rho(members)
    assert tt.spearman([1.0, 2.0, 3.0], [0.5, 0.4, 0.3]) == pytest.approx(-1.0)
    assert rho["the bubble"] == pytest.approx(-0.5)
    assert rho["the exposed communication"] == pytest.approx(0.5)
    assert rho["both (compute alone)"] == pytest.approx(0.5)


def test_kernel_by_kernel_times_flat_runs_with_the_modules_kernels(monkeypatch):
    """``by_kernel``: a run its preset times at the flat fraction (torchtitan's) is timed with
    ``step_model`` kernels-torch, a Megatron-LM run keeps the kernels its preset selects;
    without ``by_kernel`` each keeps its preset's step model."""
    import benchmarks.throughput_table as tt
    import memplan
    from memplan.workload import StepModel

    seen = []
    monkeypatch.setattr(tt, "step_time", lambda spec, gpu, par, wl, *a, **k: seen.append(
        wl.step_model))
    monkeypatch.setattr(tt, "estimate_step_time", lambda est: seen.append(
        est.workload.step_model))
    runs = {r["id"]: r for r in load_runs()}
    for rid in ("torchtitan-8b-8gpu-fsdp", "korthikanti-22b-full"):
        est = memplan.estimate(**tt._args(runs[rid]))
        tt._timed(est, runs[rid])
        tt._timed(est, runs[rid], by_kernel=True)
    assert seen == [StepModel.MFU, StepModel.KERNELS_TORCH, StepModel.KERNELS,
                    StepModel.KERNELS]
