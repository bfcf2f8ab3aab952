"""The step-time model: FLOPs derived by hand, bubble, communication placement, MFU."""

from __future__ import annotations

import pytest

import memplan
from memplan.planning.timing import (
    DEFAULT_MFU,
    OVERLAP,
    Bound,
    comm_seconds,
    forward_flops_per_token,
    step_flops,
    step_time,
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
    model, hardware = step_flops(spec, wl, global_batch=8, pp=1)
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
        model, hardware = step_flops(spec, wl, global_batch=4, pp=1)
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
    """On a GPU without measured kernel tables (L40S: no sm_89 GEMM or attention table) every
    FLOP runs at the assumed fraction of peak."""
    spec = memplan.load_model("llama-2-7b")
    gpu = memplan.load_gpu("l40s")
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
    the per-byte time rises 9x, the ring factor 15/16 vs 7/8. Each of the 8 ring passes per
    layer pays NCCL's ring latency (src/graph/tuning.cc, Simple): 8.4 us + 3.4 us per NVLink
    step + 9.6 us per network step, 8.4 + 7 * 3.4 = 32.2 us for tp 8 and 8.4 + 14 * 3.4 + 9.6
    = 65.6 us for tp 16, times 8 * 80 layers."""
    spec = memplan.load_model("llama-2-70b")
    gpu = memplan.load_gpu("h100")
    wl = memplan.make_workload(spec, seq_len=4096)
    t8 = comm_seconds(spec, gpu, memplan.make_layout(8, tp=8), wl, 1, 1)["tp"]
    t16 = comm_seconds(spec, gpu, memplan.make_layout(16, tp=16), wl, 1, 1)["tp"]
    lat8, lat16 = 8 * 80 * 32.2e-6, 8 * 80 * 65.6e-6
    bytes8 = 4 * 2 * 7 / 8 * 4096 * 8192 * 2 * 80  # act bytes: 4096 tokens x 8192 x bf16
    assert t8 == pytest.approx(bytes8 / 450e9 + lat8, rel=1e-12)
    assert (t16 - lat16) / (t8 - lat8) == pytest.approx((450e9 / 50e9) * (15 / 16) / (7 / 8))


def test_no_parallelism_no_communication() -> None:
    spec = memplan.load_model("tiny")
    comm = comm_seconds(spec, memplan.load_gpu("h100"), memplan.make_layout(1),
                        memplan.make_workload(spec), 1, spec.num_params)
    assert set(comm) == set(OVERLAP)
    assert all(v == 0 for v in comm.values())


def test_data_parallel_all_reduce_volume() -> None:
    """dp 64 across nodes: 2 * 63/64 of the bf16 gradients over the 50 GB/s network, in one
    all-reduce per unit (32 layers, the embedding, the head), each 2 ring passes of NCCL's
    latency over 8 nodes: 8.4 us + 56 NVLink steps * 3.4 us + 7 network steps * 9.6 us."""
    spec = memplan.load_model("llama-2-7b")
    comm = comm_seconds(spec, memplan.load_gpu("h100"), memplan.make_layout(64),
                        memplan.make_workload(spec), 1, spec.num_params)
    latency = 34 * 2 * (8.4e-6 + 56 * 3.4e-6 + 7 * 9.6e-6)
    assert comm["dp"] == pytest.approx(2 * 63 / 64 * spec.num_params * 2 / 50e9 + latency,
                                       rel=1e-12)


LLAMA2_7B_LAYER_FWD = 2 * 202_383_360 + 2 * 4096 * 4096  # one token, one layer: 438,321,152


def test_recompute_layers_count_per_pipeline_stage() -> None:
    """llama-2-7b at pp 4 (8 layers per stage), global batch 64 x 4096 = 262,144 tokens.
    Model FLOPs 3 * (13,214,679,040 + 1,073,741,824) * 262,144 = 1.1236871396917248e16.
    Full recompute of k of each stage's layers reruns the first k of every stage, 4k layers,
    each 2 * 202,383,360 + 2 * 4096 * 4096 = 438,321,152 FLOPs per token: k = 2 adds
    8 * 438,321,152 * 262,144 = 9.19e14; k = 8 (every layer of each stage) adds all 32,
    3.677e15, the same as full recompute (1.4913775719153664e16 in all, where counting k over
    the whole model gave 1.2156e16)."""
    spec = memplan.load_model("llama-2-7b")
    tokens = 64 * 4096
    model = 3 * (13_214_679_040 + 1_073_741_824) * tokens
    full = memplan.make_workload(spec, seq_len=4096, recompute="full")
    assert step_flops(spec, full, 64, pp=4) == (model, model + 32 * LLAMA2_7B_LAYER_FWD * tokens)
    for k, layers in ((0, 0), (2, 8), (5, 20), (8, 32)):
        wl = memplan.make_workload(spec, seq_len=4096, recompute="full", recompute_layers=k)
        assert step_flops(spec, wl, 64, pp=4) == (model, model + layers * LLAMA2_7B_LAYER_FWD
                                                  * tokens), k
    every = memplan.make_workload(spec, seq_len=4096, recompute="full", recompute_layers=8)
    assert step_flops(spec, every, 64, pp=4) == step_flops(spec, full, 64, pp=4)
    assert step_flops(spec, every, 64, pp=4)[1] == 14_913_775_719_153_664
    # with one stage, 8 of 32 layers are a quarter of the model
    assert step_flops(spec, every, 64, pp=1)[1] == model + 8 * LLAMA2_7B_LAYER_FWD * tokens


def test_step_time_reads_the_layout_pipeline() -> None:
    """``step_time`` takes pp from the layout: at pp 4, k = 8 of each stage costs what full
    recompute costs."""
    spec = memplan.load_model("llama-2-7b")
    gpu = memplan.load_gpu("h100")
    par = memplan.make_layout(8, pp=4)
    times = [step_time(spec, gpu, par, memplan.make_workload(spec, seq_len=4096, **fields),
                       64, 32, spec.num_params // 4)
             for fields in ({"recompute": "full"}, {"recompute": "full", "recompute_layers": 8})]
    assert times[0] == times[1]
    assert times[0].hardware_flops == 14_913_775_719_153_664


@pytest.mark.parametrize(("num_layers", "pp", "vpp", "k"), [
    (8, 2, 2, 3), (8, 4, 1, 1), (12, 2, 3, 5), (16, 4, 2, 4), (4, 1, 1, 2)])
def test_recomputed_layers_are_the_ones_memory_recomputes(num_layers: int, pp: int, vpp: int,
                                                          k: int) -> None:
    """The layers timing reruns are those ``memplan.model.stage_parts.layer_keys`` marks full on each
    stage's layer list (chunks in order): e.g. 8 layers, pp 2, vpp 2, k 3: stage 0 holds
    [0, 1] + [4, 5] and reruns 0, 1, 4; stage 1 holds [2, 3] + [6, 7] and reruns 2, 3, 6."""
    from memplan.model.pipeline import stage_layers
    from memplan.model.stage_parts import layer_keys
    from memplan.planning.timing import recomputed_layers
    from memplan.workload import Recompute

    spec = memplan.load_model("tiny").model_copy(update={"num_layers": num_layers})
    wl = memplan.make_workload(spec, recompute="full", recompute_layers=k)
    par = memplan.ParallelConfig(pp=pp, vpp=vpp)
    memory = set()
    for stage in range(pp):
        layers = [i for chunk in stage_layers(num_layers, par, stage) for i in chunk]
        memory |= {i for i, (_, policy) in zip(layers, layer_keys(spec, wl, layers))
                   if policy is Recompute.FULL}
    assert set(recomputed_layers(num_layers, k, pp, vpp)) == memory
    assert len(memory) == k * pp
    if (num_layers, pp, vpp, k) == (8, 2, 2, 3):
        assert recomputed_layers(8, 3, 2, 2) == (0, 1, 2, 3, 4, 6)


def test_every_nth_layer_reruns_what_memory_recomputes() -> None:
    """Full recompute of every 2nd layer, 8 layers on pp 2, vpp 2: stage 0's list [0, 1, 4, 5]
    reruns its 2nd and 4th, 1 and 5; stage 1's [2, 3, 6, 7] reruns 3 and 7. The extra FLOPs of
    a step are those four layers' forwards (all layers alike: half of full recompute's)."""
    from memplan.planning.timing import recomputed_layers, step_flops

    assert recomputed_layers(8, None, 2, 2, every=2) == (1, 3, 5, 7)
    spec = memplan.load_model("tiny").model_copy(update={"num_layers": 8})
    every = memplan.make_workload(spec, recompute="full", recompute_every=2, seq_len=64)
    full = memplan.make_workload(spec, recompute="full", seq_len=64)
    none = memplan.make_workload(spec, recompute="none", seq_len=64)
    base = step_flops(spec, none, 8, pp=2, vpp=2)[1]
    half = (step_flops(spec, full, 8, pp=2, vpp=2)[1] - base) / 2
    assert step_flops(spec, every, 8, pp=2, vpp=2)[1] - base == pytest.approx(half)


def test_moe_recompute_reruns_the_layers_of_each_stage() -> None:
    """An MoE layer every second layer (1, 3, 5, 7 of 8): at pp 2, vpp 2, k 1 the first layer of
    each stage's list reruns, layers 0 and 2, both dense, so the extra FLOPs are two dense
    layers' (per token 2 * weights + 2 * s * q_size) times the tokens."""
    from memplan.planning.timing import layer_forward_flops
    from memplan.spec import MoESpec

    tiny = memplan.load_model("tiny")
    spec = tiny.model_copy(update={"num_layers": 8, "moe": MoESpec(
        num_experts=4, top_k=2, expert_ffn_hidden_size=96, layer_freq=2)})
    counts = memplan.param_counts(spec)
    dense = counts.layers[0].tp_sharded + counts.layers[0].replicated
    per_token = layer_forward_flops(spec, 128)
    assert per_token[0] == per_token[2] == 2 * dense + 2 * 128 * spec.q_size
    assert per_token[1] > per_token[0]  # the MoE layer adds its two visited experts
    wl = memplan.make_workload(spec, seq_len=128, recompute="full", recompute_layers=1)
    model, hardware = step_flops(spec, wl, 4, pp=2, vpp=2)
    assert hardware - model == 2 * per_token[0] * 4 * 128


def test_a_measured_mfu_stands_for_the_attention_kernel_too() -> None:
    """A calibration's measured MFU times every kernel it timed: the fused attention then runs
    at that rate (its time over the flat rate's is 1 without context parallelism), where the
    uncalibrated model takes FlashAttention-2's published H100 rates (a factor other than 1:
    0.4 x 989.4 TFLOP/s against 298-335 TFLOP/s forward, 291-322 backward at 4k tokens)."""
    from memplan.planning.timing import _attention_time

    spec = memplan.load_model("llama-7b")
    wl = memplan.make_workload(spec, seq_len=4096, attention="flash")
    h100 = memplan.load_gpu("h100-sxm")
    assert _attention_time(h100, wl, 1, 0.4, measured=True) == 1.0
    assert _attention_time(h100, wl, 1, 0.4) != pytest.approx(1.0, rel=0.05)


def test_full_recompute_reruns_the_forwards_tensor_parallel_collectives():
    """A layer's tensor-parallel traffic is 8 collective units: two forward and two backward,
    each an all-reduce (2 ring passes) or an all-gather + reduce-scatter pair (1 + 1); full
    recompute reruns the forward's two, 4 units (Megatron-LM's CheckpointFunction.backward and
    torch.utils.checkpoint rerun the layer's forward, RowParallelLinear's all-reduces or the
    sequence-parallel gathers and scatters included): 12 units, 1.5 x the bytes and the
    latency. Recomputing the first 16 of the rank's 32 layers: 1 + 0.5 x 16 / 32 = 1.25.
    Selective recompute reruns the attention core, between the column- and row-parallel
    projections, with no collective: 1.0."""
    import memplan
    from memplan.hardware import load_gpu
    from memplan.planning.timing import comm_seconds

    H100 = load_gpu("h100-sxm")
    spec = memplan.load_model("llama-3.1-8b")
    par = memplan.make_layout(8, tp=8, sequence_parallel=True)
    base = comm_seconds(spec, H100, par, memplan.make_workload(spec, seq_len=4096), 1,
                        spec.num_params)["tp"]

    def tp(**kw):
        wl = memplan.make_workload(spec, seq_len=4096, **kw)
        return comm_seconds(spec, H100, par, wl, 1, spec.num_params)["tp"]

    assert tp(recompute="full") == pytest.approx(1.5 * base)
    assert tp(recompute="full", recompute_layers=16) == pytest.approx(1.25 * base)
    assert tp(recompute="selective") == pytest.approx(base)


def test_float8_all_gather_moves_the_converted_linears_in_one_byte() -> None:
    """FSDP2's float8 all-gather (torchao fsdp_pre_all_gather sends the float8 data): Llama
    3.1 8B's decoder linears, per layer q and o 4096 x 4096, k and v 4096 x 1024, gate, up and
    down 4096 x 14336, = 218,103,808 elements, travel in 1 byte instead of bf16's 2: 32 layers
    x 218,103,808 = 6,979,321,856 bytes fewer per gather. ZeRO-3 on 8 GPUs (NVLink, 450 GB/s)
    gathers forward and backward of each of 4 micro-batches: 2 x 4 x 7/8 of those bytes fewer
    over 450 GB/s; the gradients' reduce-scatter unchanged."""
    spec = memplan.load_model("llama-3.1-8b")
    gpu = memplan.load_gpu("h100")
    par = memplan.make_layout(8, zero=3)
    kw = dict(seq_len=8192, micro_batch_size=1, precision="fsdp-bf16", float8="tensorwise")
    plain = comm_seconds(spec, gpu, par, memplan.make_workload(spec, **kw), 4, spec.num_params)
    fp8 = comm_seconds(spec, gpu, par, memplan.make_workload(spec, float8_all_gather=True, **kw),
                       4, spec.num_params)
    assert plain["dp"] - fp8["dp"] == pytest.approx(2 * 4 * 7 / 8 * 6_979_321_856 / 450e9,
                                                    rel=1e-9)
    assert {k: v for k, v in plain.items() if k != "dp"} == \
        {k: v for k, v in fp8.items() if k != "dp"}
