"""The step-time model: FLOPs derived by hand, bubble, communication placement, MFU."""

from __future__ import annotations

import pytest

import memplan
from memplan.timing import (
    DEFAULT_MFU, OVERLAP, Bound, comm_seconds, forward_flops_per_token, step_flops, step_time,
)

LLAMA2_7B_LAYERS = 6_476_267_520  # 32 * 202,383,360 (attention, MLP, norms)
LLAMA2_7B_HEAD = 32_000 * 4096


def test_llama2_forward_flops_per_token() -> None:
    """2 FLOPs per weight of every layer and of the head (the embedding is a lookup):
    2 * (6,476,267,520 + 131,072,000) = 13,214,679,040; attention at s = 4096, per layer
    2 * 4096 * 4096 = 33,554,432, times 32 layers = 1,073,741,824."""
    spec = memplan.load_model("llama-2-7b")
    matmul, attention, per_layer = forward_flops_per_token(spec, 4096)
    assert matmul == 2 * (LLAMA2_7B_LAYERS + LLAMA2_7B_HEAD) == 13_214_679_040
    assert per_layer == 33_554_432
    assert attention == 32 * per_layer


def test_model_flops_are_three_forwards() -> None:
    spec = memplan.load_model("llama-2-7b")
    wl = memplan.make_workload(spec, seq_len=4096)
    model, hardware = step_flops(spec, wl, global_batch=8)
    forward = 13_214_679_040 + 1_073_741_824
    assert model == hardware == 3 * forward * 8 * 4096


def test_recompute_adds_a_forward_of_the_recomputed_part() -> None:
    """Full recompute reruns every layer's forward (not the head); selective reruns the
    attention matmuls; full on 8 of 32 layers reruns a quarter of the layers."""
    spec = memplan.load_model("llama-2-7b")
    tokens = 4 * 4096
    layer_fwd = (2 * LLAMA2_7B_LAYERS + 1_073_741_824) / 32
    for fields, extra in (
        (dict(recompute="full"), 32 * layer_fwd * tokens),
        (dict(recompute="full", recompute_layers=8), 8 * layer_fwd * tokens),
        (dict(recompute="selective"), 1_073_741_824 * tokens),
    ):
        wl = memplan.make_workload(spec, seq_len=4096, **fields)
        model, hardware = step_flops(spec, wl, global_batch=4)
        assert hardware - model == pytest.approx(extra, rel=1e-12)


def test_moe_counts_only_the_experts_a_token_visits() -> None:
    """Mixtral: each token runs 2 of 8 experts, so a layer's expert FLOPs are a quarter of
    its expert weights' (the well-known ~12.9B active parameters)."""
    spec = memplan.load_model("mixtral-8x7b")
    counts = memplan.param_counts(spec)
    active = sum(lp.tp_sharded + lp.replicated + lp.expert // 4 for lp in counts.layers)
    matmul, _, _ = forward_flops_per_token(spec, 4096)
    assert matmul == 2 * (active + 32_000 * 4096)
    assert 12.5e9 < active + 2 * 32_000 * 4096 < 13.0e9


def test_single_gpu_runs_at_the_assumed_mfu() -> None:
    spec = memplan.load_model("llama-2-7b")
    gpu = memplan.load_gpu("h100")
    wl = memplan.make_workload(spec, seq_len=4096)
    t = step_time(spec, gpu, memplan.make_layout(1), wl, global_batch=1, num_microbatches=1,
                  params_on_rank=spec.num_params)
    assert t.exposed_comm_s == 0 and t.bubble_s == 0
    assert t.mfu == pytest.approx(DEFAULT_MFU)
    assert t.bound is Bound.COMPUTE
    assert t.tokens_per_s_per_gpu == pytest.approx(4096 / t.step_s)


def test_pipeline_bubble() -> None:
    """(p - 1) / (v * m) of the compute and exposed communication."""
    spec = memplan.load_model("llama-2-7b")
    gpu = memplan.load_gpu("h100")
    wl = memplan.make_workload(spec, seq_len=4096)
    for vpp, m in ((1, 8), (2, 8), (1, 32)):
        par = memplan.make_layout(4, pp=4, vpp=vpp)
        t = step_time(spec, gpu, par, wl, global_batch=m, num_microbatches=m,
                      params_on_rank=spec.num_params // 4)
        assert t.bubble_s == pytest.approx(3 / (vpp * m) * (t.compute_s + t.exposed_comm_s))


def test_groups_inside_a_node_use_the_links_beyond_it_the_network() -> None:
    """H100 nodes of 8: tp 8 stays on NVLink (450 GB/s), tp 16 crosses the network (50 GB/s):
    the per-byte time rises 9x, the ring factor 15/16 vs 7/8."""
    spec = memplan.load_model("llama-2-70b")
    gpu = memplan.load_gpu("h100")
    wl = memplan.make_workload(spec, seq_len=4096)
    t8 = comm_seconds(spec, gpu, memplan.make_layout(8, tp=8), wl, 1, 1)["tp"]
    t16 = comm_seconds(spec, gpu, memplan.make_layout(16, tp=16), wl, 1, 1)["tp"]
    assert t16 / t8 == pytest.approx((450e9 / 50e9) * (15 / 16) / (7 / 8))


def test_no_parallelism_no_communication() -> None:
    spec = memplan.load_model("tiny")
    comm = comm_seconds(spec, memplan.load_gpu("h100"), memplan.make_layout(1),
                        memplan.make_workload(spec), 1, spec.num_params)
    assert set(comm) == set(OVERLAP)
    assert all(v == 0 for v in comm.values())


def test_data_parallel_all_reduce_volume() -> None:
    """dp 64 across nodes: 2 * 63/64 of the bf16 gradients over the 50 GB/s network."""
    spec = memplan.load_model("llama-2-7b")
    comm = comm_seconds(spec, memplan.load_gpu("h100"), memplan.make_layout(64),
                        memplan.make_workload(spec), 1, spec.num_params)
    assert comm["dp"] == pytest.approx(2 * 63 / 64 * spec.num_params * 2 / 50e9)
