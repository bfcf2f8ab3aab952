"""GEMM rates by shape and float8 in the step-time model (``memplan.planning.kernels``).

Expected values are read from XLA's matmul table (openxla/xla
``xla/backends/gpu/cost_model/matmul_interpolator_data.h``, b=4 m=4096 entries: sm_90 bf16,
sm_100 bf16 and f8e4m3fn) and the H100 and B200 datasheets (989.4 and 2,250 TFLOP/s dense
BF16), and worked by hand below."""

import pytest

from memplan.hardware import load_gpu
from memplan.planning.kernels import (GEMM_SM90_BF16, gemm_rate, gemm_share,
                                      linear_time_factor)
from memplan.spec import ModelSpec

H100 = load_gpu("h100-sxm")


def _wide() -> ModelSpec:
    """Every projection 4096 wide or more at tp 1 (MHA, 32 x 128 heads, ffn 16384)."""
    return ModelSpec(name="wide", source="test", num_layers=2, hidden_size=4096, ffn_hidden_size=16384,
                     num_attention_heads=32, num_kv_heads=32, head_dim=128, vocab_size=1024,
                     max_seq_len=4096, norm="rmsnorm", mlp="swiglu", position="rope",
                     tied_embeddings=False)


def test_table_points_and_ends():
    # n=4096 k=4096: "b: 4 m: 4096 n: 4096 k: 4096 ... bf16xbf16->bf16 788699393418751"
    assert gemm_rate(GEMM_SM90_BF16, 4096, 4096) == 788699393418751
    # beyond the table: held at its last point
    assert gemm_rate(GEMM_SM90_BF16, 53248, 16384) == 788699393418751
    # n=256 k=4096: 611296227725590; n below 256 is held at 256
    assert gemm_rate(GEMM_SM90_BF16, 128, 4096) == 611296227725590


def test_between_points_is_linear_in_log2():
    # n=4096, k=2^11.5 lies halfway between k=2048 (759530558969895) and k=4096
    # (788699393418751): (759530558969895 + 788699393418751) / 2 = 774114976194323
    assert gemm_rate(GEMM_SM90_BF16, 4096, 2 ** 11.5) == pytest.approx(774114976194323)


def test_gemm_share():
    # 0.40 x 989.4e12 / 788699393418751 = 395.76e12 / 788.699e12 = 0.501788
    assert gemm_share(H100, 0.40) == pytest.approx(0.501788, abs=1e-6)
    # no table for sm_80: every FLOP at the flat fraction
    assert gemm_share(load_gpu("a100-80gb"), 0.40) == 1.0


def test_float8_speeds_up_the_gemm_share_only():
    # all shapes at the table's plateau: shape factor 1; float8 divides the GEMMs' share by
    # the H100's measured largest float8 over bf16 matmul rate, 1402.6 / 794.5 = 1.765387
    # (MAMF table): 1 - 0.501788 + 0.501788 / 1.765387 = 0.782449
    assert linear_time_factor(_wide(), H100, 1, False, 0.40) == pytest.approx(1.0)
    assert linear_time_factor(_wide(), H100, 1, True, 0.40) == pytest.approx(0.782449,
                                                                              abs=1e-6)
    # an FP8 GPU without a measured table or ratio keeps the datasheet's 2 (L40S: no GEMM
    # table either, so a factor 1 at the flat fraction)
    assert linear_time_factor(_wide(), load_gpu("l40s"), 1, True, 0.40) == 1.0


def test_float8_on_sm100_runs_at_its_measured_rate():
    """B200 (2.25e15 dense BF16): the GEMMs' share 0.40 x 2.25e15 / 1670467342710337
    (sm_100 bf16, n=k=4096) = 0.538771. float8 at the plateau runs at the table's
    f8e4m3fn x f8e4m3fn -> bf16 rate, 3279676742061148: shape factor 1670467342710337 /
    3279676742061148 = 0.509339 (not the datasheet's 1/2); 1 - 0.538771 + 0.538771 x 0.509339
    = 0.735646."""
    b200 = load_gpu("b200")
    assert linear_time_factor(_wide(), b200, 1, False, 0.40) == pytest.approx(1.0)
    assert linear_time_factor(_wide(), b200, 1, True, 0.40) == pytest.approx(0.735646,
                                                                              abs=1e-6)


def test_tensor_parallel_shrinks_the_gemms():
    """tp 16 on the wide spec: q, k, v, gate, up 4096 -> 256 outputs; o's input 4096 -> 256;
    down's input 16384 -> 1024. Per GEMM (n, k) and weight d_in x d_out:
    q/k/v (256, 4096) fwd+wgrad, (4096, 256) dgrad, 4096 x 4096 each;
    o (4096, 256) fwd+wgrad, (256, 4096) dgrad, 4096 x 4096;
    gate/up (1024, 4096) fwd+wgrad, (4096, 1024) dgrad, 4096 x 16384 each;
    down (4096, 1024) fwd+wgrad, (1024, 4096) dgrad, 16384 x 4096.
    Rates: (256, 4096) 611296227725590, (4096, 256) 505171406257351,
    (1024, 4096) 773519549031967, (4096, 1024) 722328842246888; best 788699393418751.
    Slow FLOPs over FLOPs: attention 4 weights of 1 unit, MLP 3 of 4 units (16 units):
    q/k/v: 3 x [2 x 788.70/611.30 + 788.70/505.17] = 3 x [2.580 + 1.561] = 12.425
    o: 2 x 788.70/505.17 + 788.70/611.30 = 3.122 + 1.290 = 4.413
    gate/up: 2 x 4 x [2 x 788.70/773.52 + 788.70/722.33] = 8 x [2.039 + 1.092] = 25.049
    down: 4 x [2 x 788.70/722.33 + 788.70/773.52] = 4 x [2.184 + 1.020] = 12.814
    sum 54.70 over 3 x 16 = 48 FLOP units: shape factor 1.1396; linear time
    1 - 0.501788 + 0.501788 x 1.1396 = 1.07004."""
    assert linear_time_factor(_wide(), H100, 16, False, 0.40) == pytest.approx(1.0700,
                                                                               abs=2e-4)


def _where(cond, a, b):
    return a if cond else b


def test_dp_exposed_first_unit_waits_and_compute_is_shared():
    """ZeRO-3 over 34 units (32 layers, embedding, head): gathers of 3.4 s (0.1 s a unit) and
    reduce-scatters of 1.7 s (0.05 s a unit) in every micro-batch. Beside 10 s of compute
    only one unit of each waits: 0.1 + 0.05 = 0.15 s. Beside 4 s the rest, 3.3 + 1.65 =
    4.95 s, shares the 4 s: 0.95 s more, 1.1 s in all (two transfers do not each hide behind
    the same 4 s)."""
    from memplan.planning.timing import dp_exposed

    kw = dict(units=34, per_mb=1.0, backward_share=0.5, where=_where)
    assert dp_exposed(0.0, 1.7, 0.0, 3.4, compute=10.0, **kw) == pytest.approx(0.15)
    assert dp_exposed(0.0, 1.7, 0.0, 3.4, compute=4.0, **kw) == pytest.approx(1.1)


def test_dp_exposed_once_per_step_reduction_hides_behind_the_last_backward():
    """A once-per-step reduce-scatter of 3.4 s over 34 units with 2 s of compute per
    micro-batch, two thirds of it backward (1.333 s): 0.1 s (its last unit) + what the other
    3.3 s exceed the last backward by, 3.3 - 1.333 = 1.967 s: 2.067 s in all."""
    from memplan.planning.timing import dp_exposed

    out = dp_exposed(3.4, 0.0, 0.0, 0.0, units=34, compute=16.0, per_mb=2.0,
                     backward_share=2 / 3, where=_where)
    assert out == pytest.approx(0.1 + 3.3 - 4 / 3)


def test_ring_exposed_per_step():
    """A ring of 14 sends, 0.7 s in all (0.05 s each). Beside blocks of 0.08 s of attention
    each send hides: 0. Beside blocks of 0.02 s each send shows 0.03 s: 14 x 0.03 = 0.42 s,
    = 0.7 x (1 - 0.02 / 0.05)."""
    from memplan.planning.timing import ring_exposed

    assert ring_exposed(0.7, 14, 0.08, _where) == 0.0
    assert ring_exposed(0.7, 14, 0.02, _where) == pytest.approx(0.42)


def test_attention_runs_at_flash_attention_2s_measured_causal_rates():
    """H100 (989.4e12 dense BF16), flat fraction 0.40: 395.76e12 FLOP/s. The step counts a
    forward of F FLOPs and a backward of 2 F; the kernel runs 3.5 F (its backward 2.5 F) at
    FlashAttention-2's measured causal forward-and-backward rate (Dao-AILab/flash-attention
    assets/flash2_h100_fwd_bwd_benchmark.png, causal, head dim 128). At 8192 tokens: 308e12,
    factor 395.76e12 x 3.5 / (3 x 308e12) = 1385.16 / 924 = 1.499091. At 2^12.5 tokens,
    halfway (in log2) between 4096 (294e12) and 8192: 301e12, 1385.16 / 903 = 1.533953.
    Beyond 16384 tokens the 16k rate holds (328e12): 1385.16 / 984 = 1.407683. An A100
    (312e12 dense BF16, 124.8e12 at 0.40) at 8192 tokens: 182e12 (the A100 figure),
    124.8 x 3.5 / (3 x 182) = 436.8 / 546 = 0.8. No table for sm_89 (L40S): None."""
    from memplan.planning.kernels import attention_time_factor

    assert attention_time_factor(H100, 8192, 0.40) == pytest.approx(1.499091, abs=1e-6)
    assert attention_time_factor(H100, 2 ** 12.5, 0.40) == pytest.approx(1.533953, abs=1e-6)
    assert attention_time_factor(H100, 262144, 0.40) == pytest.approx(1.407683, abs=1e-6)
    assert attention_time_factor(load_gpu("a100-80gb"), 8192, 0.40) == pytest.approx(0.8)
    assert attention_time_factor(load_gpu("l40s"), 8192, 0.40) is None


def test_attention_rate_by_head_dimension():
    """The same figures' head-dimension-64 causal panels (H100: 141, 192, 232, 257, 273, 284
    TFLOP/s from 512 to 16k tokens; A100: 88, 119, 140, 156, 165, 171). H100 at 0.40 of peak
    (1385.16e12 = 395.76e12 x 3.5): head dim 64 at 8192 tokens, 273e12: 1385.16 / 819 =
    1.691282. Head dim 96, log2(96) - 6 = 0.584963 of the way (in log2) from 64 to 128:
    273 + 0.584963 x (308 - 273) = 293.473688e12, 1385.16 / 880.421063 = 1.573293. Head dim
    256 holds 128's rate (1.499091), 32 holds 64's. A100 (124.8e12 at 0.40), head dim 64 at
    4096 tokens: 156e12, 436.8 / 468 = 0.933333."""
    from memplan.planning.kernels import attention_time_factor

    assert attention_time_factor(H100, 8192, 0.40, 64) == pytest.approx(1.691282, abs=1e-6)
    assert attention_time_factor(H100, 8192, 0.40, 96) == pytest.approx(1.573293, abs=1e-6)
    assert attention_time_factor(H100, 8192, 0.40, 256) == pytest.approx(1.499091, abs=1e-6)
    assert attention_time_factor(H100, 8192, 0.40, 32) == pytest.approx(1.691282, abs=1e-6)
    assert attention_time_factor(load_gpu("a100-80gb"), 4096, 0.40, 64) == pytest.approx(
        0.933333, abs=1e-6)


def test_async_tp_exposes_one_shard_and_what_exceeds_the_matmuls():
    """TP collectives of 0.8 s in all at tp 8, cut into 8 shards of 0.1 s: one shard waits
    (0.1 s); the other 0.7 s hide behind 7/8 of the matmuls beside them. Beside 1.0 s of
    matmuls (0.875 s window) nothing more shows: 0.1 s. Beside 0.4 s (0.35 s window) the rest
    exceeds it by 0.35 s: 0.45 s."""
    from memplan.planning.timing import async_tp_exposed

    assert async_tp_exposed(0.8, 1.0, 8, _where) == pytest.approx(0.1)
    assert async_tp_exposed(0.8, 0.4, 8, _where) == pytest.approx(0.45)


def test_async_tp_needs_compile_and_hides_tp_collectives():
    """torchtitan refuses async TP without torch.compile; with it, the same job's TP
    collectives hide behind the matmuls (fewer exposed seconds), and its compute gains the
    fused ops' reductions and shard copies (``async_tp_copy_seconds``)."""
    import memplan
    from memplan.errors import MemplanError
    from memplan.planning.timing import estimate_step_time

    job = dict(gpus=16, tp=8, zero=3, global_batch_size=16, micro_batch_size=2, seq_len=4096,
               framework="torchtitan", precision="fsdp-bf16", gpu="h100-sxm")
    with pytest.raises(MemplanError, match="async_tp without compile"):
        memplan.estimate("llama-3.1-8b", async_tp=True, **job)
    plain = estimate_step_time(memplan.estimate("llama-3.1-8b", compile=True, **job))
    fused = estimate_step_time(memplan.estimate("llama-3.1-8b", compile=True, async_tp=True,
                                                **job))
    assert fused.compute_s > plain.compute_s
    assert fused.exposed_comm_s < plain.exposed_comm_s
    assert fused.step_s < plain.step_s


def test_float8_cast_bytes_by_recipe_and_layout():
    """torchao's cast kernels (roofline_utils.py) on the wide spec (2 layers; q, k, v, o
    4096 x 4096; gate, up 4096 -> 16384; down 16384 -> 4096), at 0.92 x 3.35e12 B/s.
    Per token and layer, tp 1, tensorwise, compiled (4 B an activation element):
    output gradients 3 x 4096 + 4096 + 2 x 16384 + 4096 = 53,248; inputs, once per shared
    input: 4096 (q/k/v) + 4096 (o) + 4096 (gate/up) + 16384 (down) = 28,672;
    4 x 81,920 = 327,680 B, 655,360 for the 2 layers.
    Eager (6 B, each projection its own input): inputs 3 x 4096 + 4096 + 2 x 4096 + 16384
    = 40,960; 6 x (53,248 + 40,960) x 2 = 1,130,496 B.
    tp 8, tensorwise, sequence parallel: the shared inputs cast on 1/8 of the tokens:
    gradients 3 x 512 + 4096 + 2 x 2048 + 4096 = 13,824; inputs 512 + 512 + 512 + 2048 =
    3,584; 4 x 17,408 x 2 = 139,264 B.
    tp 8, rowwise, compiled (6 B; bf16 gather, the full input cast once per shared input):
    inputs 4096 + 512 + 4096 + 2048 = 10,752; 6 x (13,824 + 10,752) x 2 = 294,912 B; and
    the input gradients' rescale (4 B): 3 x 4096 + 512 + 2 x 4096 + 2048 = 23,040 x 4 x 2
    = 184,320 B; 479,232 in all.
    Weights per micro-batch, tp 1, tensorwise (8 B): (4 x 4096^2 + 3 x 4096 x 16384) x 8 x 2
    = 4,294,967,296 B; rowwise at tp 8, cast (10 B) and the weight gradient's rescale (4 B):
    268,435,456 / 8 x 14 x 2 = 939,524,096 B."""
    from memplan.planning.kernels import float8_cast_seconds

    rate = 0.92 * 3.35e12
    spec = _wide()
    tw = float8_cast_seconds(spec, H100, 1, "tensorwise", True, True)
    assert tw[0] == pytest.approx(655_360 / rate)
    assert tw[1] == pytest.approx(4_294_967_296 / rate)
    eager = float8_cast_seconds(spec, H100, 1, "tensorwise", False, True)
    assert eager[0] == pytest.approx(1_130_496 / rate)
    assert float8_cast_seconds(spec, H100, 8, "tensorwise", True, True)[0] == pytest.approx(
        139_264 / rate)
    rw = float8_cast_seconds(spec, H100, 8, "rowwise", True, True)
    assert rw[0] == pytest.approx(479_232 / rate)
    assert rw[1] == pytest.approx(939_524_096 / rate)
    # no FP8 tensor cores or no GEMM table: float8 runs at the flat fraction, no casts
    assert float8_cast_seconds(spec, load_gpu("a100-80gb"), 1, "rowwise", True, True) == (0, 0)


def test_async_tp_fuses_only_collectives_beside_a_matmul():
    """Inductor's micro-pipeline pass fuses an all-gather feeding a matmul and a
    reduce-scatter fed by one. bf16: all 8 of a layer's collectives. Tensorwise float8: the
    forward's 2 all-gathers move float8 (half: 1 unit), its 2 reduce-scatters and the
    backward's 2 (4 units) fuse; the backward's 2 all-gathers feed a cast: 5 of 7 units.
    Rowwise: only the forward's 2 reduce-scatters: 2 of 8."""
    import memplan
    from memplan.planning.timing import async_tp_fused_share

    spec = memplan.load_model("llama-3.1-8b")
    assert async_tp_fused_share(memplan.make_workload(spec)) == 1.0
    assert async_tp_fused_share(memplan.make_workload(spec, float8="tensorwise")) == 5 / 7
    assert async_tp_fused_share(memplan.make_workload(spec, float8="rowwise")) == 2 / 8


def test_tensorwise_float8_gathers_the_forward_inputs_in_one_byte():
    """llama-3.1-8b at tp 8 with sequence parallelism, one micro-batch of 4096 tokens: TP
    moves 8 collectives x 7/8 (ring) x 4096 x 4096 x 2 B x 32 layers = 7,516,192,768 B over
    NVLink (450e9 B/s). Tensorwise float8 gathers the forward's two inputs in float8: one
    eighth of that less, 939,524,096 B, 2.087831e-3 s (latency unchanged)."""
    import memplan
    from memplan.planning.timing import comm_seconds

    spec = memplan.load_model("llama-3.1-8b")
    par = memplan.make_layout(8, tp=8, sequence_parallel=True)
    plain = memplan.make_workload(spec, seq_len=4096)
    fp8 = memplan.make_workload(spec, seq_len=4096, float8="tensorwise")
    bf16 = comm_seconds(spec, H100, par, plain, 1, spec.num_params)["tp"]
    tw = comm_seconds(spec, H100, par, fp8, 1, spec.num_params)["tp"]
    assert bf16 - tw == pytest.approx(939_524_096 / 450e9)


def test_cp_all_gather_hides_behind_the_first_block_only():
    """PyTorch's context_parallel with rotate method allgather (``CpExchange.ALLGATHER``):
    2 attention calls at cp 4, each all-gathering for 0.4 s (forward 0.8 s in all) and, in
    backward, again 0.4 s plus 4 fp32 gradient sends of 0.1 s (backward 0.8 + 0.8 = 1.6 s).
    Blocks of 0.3 s forward (0.6 s backward): the forward gather shows 0.4 - 0.3 = 0.1, the
    backward's hides behind 0.6; three gradient sends hide behind the next block's backward,
    the last (0.1) waits after the loop: (0.1 + 0.1) x 2 calls = 0.4 s. Blocks of 0.05 s:
    forward 0.35, backward 0.4 - 0.1 = 0.3, sends 3 x max(0, 0.1 - 0.1) + 0.1: 0.75 x 2 =
    1.5 s. At cp 1 nothing is exchanged: 0."""
    from memplan.planning.timing import gather_exposed

    assert gather_exposed(0.8, 1.6, calls=2, cp=4, block=0.3, where=_where) == \
        pytest.approx(0.4)
    assert gather_exposed(0.8, 1.6, calls=2, cp=4, block=0.05, where=_where) == \
        pytest.approx(1.5)
    assert gather_exposed(0.0, 0.0, calls=2, cp=1, block=0.3, where=_where) == 0.0


def test_cp_exchange_seconds_by_schedule():
    """Llama 3.1 8B (8 KV heads of 128: 1,024 K or V values a token) at cp 4, tp 1, one
    micro-batch of 131,072 tokens: each rank holds 32,768, its K and V chunk
    2 x 32,768 x 1,024 x 2 B = 134,217,728 B; 32 layers; the 4 ranks share a node (NVLink
    450e9 B/s, NCCL's ring step 3.4 us, its base latency 8.4 us).
    ring: 3 sends each way per layer: 96 x (134,217,728 / 450e9 + 3.4e-6) forward, the same
    backward. allgather: per layer 3 chunks arrive in one ring all-gather,
    3 x 134,217,728 / 450e9 + 8.4e-6 + 3 x 3.4e-6 forward; backward the same plus 4 fp32
    gradient sends of 2 x 134,217,728 B, each 268,435,456 / 450e9 + 3.4e-6."""
    import memplan
    from memplan.parallel import ParallelConfig
    from memplan.planning.timing import Columns, cp_parts
    from memplan.workload import CpExchange

    est = memplan.estimate("llama-3.1-8b", gpus=4, cp=4, seq_len=131072,
                           global_batch_size=1, micro_batch_size=1)
    c = Columns.one(ParallelConfig(cp=4, dp=1), 1, 1, 0, num_layers=32)
    kv = 134_217_728
    ring = 96 * (kv / 450e9 + 3.4e-6)
    assert cp_parts(est.spec, H100, est.workload, c) == pytest.approx((ring, ring))
    wl = est.workload.model_copy(update={"cp_exchange": CpExchange.ALLGATHER})
    gather = 32 * (3 * kv / 450e9 + 8.4e-6 + 3 * 3.4e-6)
    grads = 32 * 4 * (2 * kv / 450e9 + 3.4e-6)
    assert cp_parts(est.spec, H100, wl, c) == pytest.approx((gather, gather + grads))


def test_async_tp_adds_its_reductions_and_shard_copies():
    """Llama 3.1 8B (hidden 4,096) at tp 8 with sequence parallelism, one micro-batch of
    12 x 8,192 tokens in bf16: each collective's full activation is
    98,304 x 4,096 x 2 B = 805,306,368 B (``act``). Each of the 4 fused reduce-scatters per
    layer sums the stacked partials: act read, act / 8 written, 1.125 act; each of the 4
    fused all-gathers copies the local shard twice (read and write): 4 / 8 act. Per layer
    4 x 1.125 + 4 x 0.5 = 6.5 act; 32 layers: 208 act = 167,503,724,544 B at 92% of the
    H100's 3.35e12 B/s. Rowwise float8 fuses only the forward's two reduce-scatters:
    2 x 1.125 x 32 = 72 act."""
    import memplan
    from memplan.parallel import ParallelConfig
    from memplan.planning.timing import Columns, async_tp_copy_seconds
    from memplan.workload import Float8Recipe

    spec = memplan.load_model("llama-3.1-8b")
    wl = memplan.make_workload(spec, seq_len=8192, micro_batch_size=12)
    c = Columns.one(ParallelConfig(tp=8, dp=1, sequence_parallel=True), 12, 1, 0,
                    num_layers=32)
    act = 805_306_368
    rate = 3.35e12 * 0.92
    assert async_tp_copy_seconds(spec, H100, wl, c) == pytest.approx(208 * act / rate)
    rowwise = wl.model_copy(update={"float8": Float8Recipe.ROWWISE})
    assert async_tp_copy_seconds(spec, H100, rowwise, c) == pytest.approx(72 * act / rate)
