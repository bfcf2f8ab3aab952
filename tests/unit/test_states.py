"""Parameters, gradients and optimizer states per rank, exact to the byte.

Every expected number is derived by hand from the spec in the test's docstring. The ``tiny``
spec (model_specs/models/tiny.toml): L=2 layers, h=64, ffn f=176, a=4 query heads and g=2 KV
heads of d=16, V=128, RMSNorm (weight only), SwiGLU, RoPE, untied embeddings, no biases.

    token embedding     V*h = 128*64                          =   8,192
    one layer:
      q and out         2 * h * (a*d) = 2 * 64 * 64           =   8,192   (TP-sharded)
      k and v           2 * h * (g*d) = 2 * 64 * 32           =   4,096   (TP-sharded)
      SwiGLU            3 * h * f = 3 * 64 * 176              =  33,792   (TP-sharded)
      two RMSNorms      2 * h                                 =     128   (replicated)
      layer total       46,080 sharded + 128 replicated       =  46,208
    final RMSNorm       h                                     =      64
    head (untied)       V*h                                   =   8,192
    N = 8,192 + 2*46,208 + 64 + 8,192                         = 108,864
"""

from __future__ import annotations

import pytest

from memplan.model.model_states import StageParams, StateBytes, stage_params, state_bytes
from memplan.parallel import ParallelConfig, ZeroStage
from memplan.spec import ModelSpec, load_model, param_counts
from memplan.units import GB
from memplan.workload import Optimizer, Precision, Workload

TINY = load_model("tiny")
N = 108_864  # tiny's parameter count (module docstring)
LAYER = 46_208
LAYER_SHARDED = 46_080
LAYER_REPLICATED = 128
VOCAB_MATRIX = 8_192
FINAL_NORM = 64


def _states(spec: ModelSpec, par: ParallelConfig, wl: Workload, layers: list[int] | None = None,
            *, first: bool = True, last: bool = True) -> tuple[StageParams, StateBytes]:
    layers = list(range(spec.num_layers)) if layers is None else layers
    sp = stage_params(spec, par, layers, first=first, last=last)
    return sp, state_bytes(sp, par, wl)


def test_tiny_whole_model_on_one_rank() -> None:
    """pp=1, tp=1: the rank holds all N = 108,864 parameters, none of them experts."""
    assert param_counts(TINY).total == N
    sp = stage_params(TINY, ParallelConfig(), [0, 1], first=True, last=True)
    assert (sp.dense, sp.expert, sp.total) == (N, 0, N)


def test_bf16_mixed_zero0() -> None:
    """bf16-mixed, AdamW, ZeRO-0: 2 B weights + 2 B grads + (4 B master + 8 B Adam) per param.

    params     2 * 108,864  =   217,728
    grads      2 * 108,864  =   217,728
    optimizer 12 * 108,864  = 1,306,368
    total     16 * 108,864  = 1,741,824   (the ZeRO paper's 16 B/param)
    """
    _, st = _states(TINY, ParallelConfig(), Workload(precision=Precision.BF16_MIXED))
    assert st.params_bytes == 217_728
    assert st.grads_bytes == 217_728
    assert st.optimizer_bytes == 1_306_368
    assert st.num_optimizer_params == N
    assert st.params_bytes + st.grads_bytes + st.optimizer_bytes == 1_741_824


def test_fp16_mixed_matches_bf16_mixed() -> None:
    """fp16-mixed has the same per-parameter bytes as bf16-mixed: 2 + 2 + 12 = 16."""
    _, bf = _states(TINY, ParallelConfig(), Workload(precision=Precision.BF16_MIXED))
    _, fp = _states(TINY, ParallelConfig(), Workload(precision=Precision.FP16_MIXED))
    assert bf == fp


def test_bf16_fp32_grads() -> None:
    """bf16 weights, fp32 main grads (Megatron-LM default): 2 + 4 + 12 = 18 B/param.

    params     2 * 108,864  =   217,728
    grads      4 * 108,864  =   435,456
    optimizer 12 * 108,864  = 1,306,368
    total     18 * 108,864  = 1,959,552
    """
    _, st = _states(TINY, ParallelConfig(), Workload(precision=Precision.BF16_FP32_GRADS))
    assert st.params_bytes == 217_728
    assert st.grads_bytes == 435_456
    assert st.optimizer_bytes == 1_306_368
    assert st.params_bytes + st.grads_bytes + st.optimizer_bytes == 1_959_552


def test_fp32() -> None:
    """fp32 everything, no master copy: 4 + 4 + 8 (Adam moments) = 16 B/param.

    params     4 * 108,864  =   435,456
    grads      4 * 108,864  =   435,456
    optimizer  8 * 108,864  =   870,912
    total     16 * 108,864  = 1,741,824
    """
    _, st = _states(TINY, ParallelConfig(), Workload(precision=Precision.FP32))
    assert (st.params_bytes, st.grads_bytes, st.optimizer_bytes) == (435_456, 435_456, 870_912)
    assert st.params_bytes + st.grads_bytes + st.optimizer_bytes == 1_741_824


def test_fsdp_bf16_zero3_dp4() -> None:
    """FSDP2 bf16 policy (fp32 sharded weights and grads, fp32 Adam, no master) over dp=4.

    shard = ceil(108,864 / 4) = 27,216 (exact: 4 * 27,216 = 108,864)
    params     4 * 27,216 = 108,864
    grads      4 * 27,216 = 108,864
    optimizer  8 * 27,216 = 217,728
    """
    par = ParallelConfig(dp=4, zero=ZeroStage.PARAMETERS)
    _, st = _states(TINY, par, Workload(precision=Precision.FSDP_BF16))
    assert st.num_optimizer_params == 27_216
    assert (st.params_bytes, st.grads_bytes, st.optimizer_bytes) == (108_864, 108_864, 217_728)


def test_fsdp_bf16_zero3_dp5_ceil() -> None:
    """dp=5 does not divide 108,864 (5 * 21,772 = 108,860, remainder 4): the most loaded rank
    holds ceil(108,864 / 5) = 21,773.

    params 4 * 21,773 = 87,092; grads 87,092; optimizer 8 * 21,773 = 174,184.
    """
    par = ParallelConfig(dp=5, zero=ZeroStage.PARAMETERS)
    _, st = _states(TINY, par, Workload(precision=Precision.FSDP_BF16))
    assert st.num_optimizer_params == 21_773
    assert (st.params_bytes, st.grads_bytes, st.optimizer_bytes) == (87_092, 87_092, 174_184)


def test_sgd_bf16_mixed() -> None:
    """SGD with momentum keeps one fp32 buffer (4 B) besides the fp32 master copy (4 B).

    optimizer (4 + 4) * 108,864 = 870,912; params and grads unchanged (217,728 each).
    """
    wl = Workload(precision=Precision.BF16_MIXED, optimizer=Optimizer.SGD)
    _, st = _states(TINY, ParallelConfig(), wl)
    assert (st.params_bytes, st.grads_bytes, st.optimizer_bytes) == (217_728, 217_728, 870_912)


def test_sgd_fp32() -> None:
    """fp32 SGD: no master copy, momentum only: optimizer 4 * 108,864 = 435,456."""
    wl = Workload(precision=Precision.FP32, optimizer=Optimizer.SGD)
    _, st = _states(TINY, ParallelConfig(), wl)
    assert st.optimizer_bytes == 435_456


def test_tp2_shards_matrices_and_replicates_norms() -> None:
    """TP=2, pp=1 (one TP rank holds the whole depth):

    one layer: 46,080 / 2 = 23,040 sharded + 128 norm weights replicated = 23,168
    embedding  ceil(128 / 2) * 64 = 64 * 64                        = 4,096
    head       ceil(128 / 2) * 64                                  = 4,096
    final norm replicated                                          =    64
    total      2 * 23,168 + 4,096 + 4,096 + 64                     = 54,592
    bf16-mixed bytes: params 2 * 54,592 = 109,184; grads 109,184; optimizer 12 * 54,592 = 655,104
    """
    par = ParallelConfig(tp=2)
    sp, st = _states(TINY, par, Workload())
    assert sp.dense == 2 * (LAYER_SHARDED // 2 + LAYER_REPLICATED) + 4_096 + 4_096 + FINAL_NORM
    assert sp.dense == 54_592
    assert (st.params_bytes, st.grads_bytes, st.optimizer_bytes) == (109_184, 109_184, 655_104)


def test_tp2_vocab_is_ceil_split() -> None:
    """tiny with V=131 (odd), TP=2: each vocab matrix holds ceil(131 / 2) = 66 rows of 64.

    embedding 66 * 64 = 4,224; head 4,224; layers 2 * 23,168 = 46,336; final norm 64
    total 46,336 + 2 * 4,224 + 64 = 54,848 (the unsplit model has 2*46,208 + 2*8,384 + 64 = 109,248)
    """
    spec = TINY.model_copy(update={"vocab_size": 131})
    assert param_counts(spec).total == 109_248
    sp, _ = _states(spec, ParallelConfig(tp=2), Workload())
    assert sp.dense == 54_848


def test_tp2_gpt2_biases() -> None:
    """GPT-2 small (h=768, f=3072, V=50257, 1024 learned positions, tied, all biases), TP=2.

    one layer, sharded: 4h^2 = 2,359,296 + qkv bias 3h = 2,304 + MLP 8h^2 = 4,718,592
                        + up bias 4h = 3,072                                  = 7,083,264
    one layer, replicated: out bias h + down bias h + 2 LayerNorms 2*2h = 4,608
    per TP rank: 7,083,264 / 2 + 4,608                                        = 3,546,240
    12 layers                                                                 = 42,554,880
    embedding ceil(50,257 / 2) * 768 = 25,129 * 768                           = 19,299,072
    learned positions, replicated 1024 * 768                                  =    786,432
    final LayerNorm 2h                                                        =      1,536
    tied and pp=1: no separate head
    total                                                                     = 62,641,920
    """
    spec = load_model("gpt2")
    layer = param_counts(spec).layers[0]
    assert (layer.tp_sharded, layer.replicated) == (7_083_264, 4_608)
    sp, _ = _states(spec, ParallelConfig(tp=2), Workload())
    assert sp.dense == 62_641_920


def test_pp2_untied() -> None:
    """PP=2: stage 0 holds layer 0 and the embedding, stage 1 layer 1, final norm and head.

    stage 0: 46,208 + 8,192       = 54,400
    stage 1: 46,208 + 64 + 8,192  = 54,464
    the two stages sum to N = 108,864
    """
    par = ParallelConfig(pp=2)
    s0 = stage_params(TINY, par, [0], first=True, last=False)
    s1 = stage_params(TINY, par, [1], first=False, last=True)
    assert s0.dense == LAYER + VOCAB_MATRIX == 54_400
    assert s1.dense == LAYER + FINAL_NORM + VOCAB_MATRIX == 54_464
    assert s0.dense + s1.dense == N


def test_tied_pp1_counts_the_embedding_once() -> None:
    """Tied tiny, pp=1: the head is the embedding: 108,864 - 8,192 = 100,672."""
    tied = TINY.model_copy(update={"tied_embeddings": True})
    assert param_counts(tied).total == 100_672
    sp = stage_params(tied, ParallelConfig(), [0, 1], first=True, last=True)
    assert sp.dense == 100_672


def test_tied_pp2_holds_the_embedding_on_both_stages() -> None:
    """Tied tiny, PP=2: Megatron-LM keeps a copy of the tied embedding on the last stage.

    stage 0: 46,208 + 8,192            = 54,400
    stage 1: 46,208 + 64 + 8,192 (copy) = 54,464
    sum 108,864 = the tied count 100,672 + one extra 8,192 copy
    """
    tied = TINY.model_copy(update={"tied_embeddings": True})
    par = ParallelConfig(pp=2)
    s0 = stage_params(tied, par, [0], first=True, last=False)
    s1 = stage_params(tied, par, [1], first=False, last=True)
    assert (s0.dense, s1.dense) == (54_400, 54_464)
    assert s0.dense + s1.dense == 100_672 + VOCAB_MATRIX == 108_864


def test_pp2_tp2_tied() -> None:
    """Tied tiny, PP=2, TP=2: stage 0 = 23,168 + 4,096 = 27,264; stage 1 = 23,168 + 64 + 4,096
    = 27,328."""
    tied = TINY.model_copy(update={"tied_embeddings": True})
    par = ParallelConfig(pp=2, tp=2)
    assert stage_params(tied, par, [0], first=True, last=False).dense == 27_264
    assert stage_params(tied, par, [1], first=False, last=True).dense == 27_328


@pytest.mark.parametrize(
    ("zero", "expected"),
    [
        # ceil(108,864 / 5) = 21,773 (5 * 21,773 = 108,865 >= 108,864 > 5 * 21,772)
        # ZeRO-1: params 2N = 217,728, grads 2N = 217,728, optimizer 12 * 21,773 = 261,276
        (ZeroStage.OPTIMIZER, (217_728, 217_728, 261_276)),
        # ZeRO-2: grads 2 * 21,773 = 43,546 as well
        (ZeroStage.GRADIENTS, (217_728, 43_546, 261_276)),
        # ZeRO-3: params 2 * 21,773 = 43,546 as well
        (ZeroStage.PARAMETERS, (43_546, 43_546, 261_276)),
    ],
)
def test_zero_stages_dp5_ceil(zero: ZeroStage, expected: tuple[int, int, int]) -> None:
    """bf16-mixed over dp=5, which does not divide N = 108,864: the most loaded rank holds the
    ceil, 21,773 parameters' worth of each sharded state (numbers in the parametrize comments)."""
    _, st = _states(TINY, ParallelConfig(dp=5, zero=zero), Workload())
    assert (st.params_bytes, st.grads_bytes, st.optimizer_bytes) == expected
    assert st.num_optimizer_params == 21_773


def test_zero_shards_over_dp_times_cp() -> None:
    """ZeRO-1 with dp=5, cp=2 shards over 10 ranks: ceil(108,864 / 10) = 10,887 (10,886.4).
    optimizer 12 * 10,887 = 130,644."""
    _, st = _states(TINY, ParallelConfig(dp=5, cp=2, zero=ZeroStage.OPTIMIZER), Workload())
    assert st.num_optimizer_params == 10_887
    assert st.optimizer_bytes == 130_644


def test_zero1_on_a_pipeline_stage() -> None:
    """PP=2 stage 0 (54,400 params), ZeRO-1 over dp=3: ceil(54,400 / 3) = 18,134 (18,133.3).
    optimizer 12 * 18,134 = 217,608; params and grads 2 * 54,400 = 108,800."""
    par = ParallelConfig(pp=2, dp=3, zero=ZeroStage.OPTIMIZER)
    _, st = _states(TINY, par, Workload(), [0], first=True, last=False)
    assert (st.params_bytes, st.grads_bytes, st.optimizer_bytes) == (108_800, 108_800, 217_608)


def test_mixtral_ep_shards_experts_by_the_expert_data_parallel_group() -> None:
    """Mixtral-8x7B, ep=8, dp=8, ZeRO-1. Per layer: attention 41,943,040 (sharded), router
    4096*8 = 32,768 and norms 8,192 (replicated), experts 8 * 3*4096*14336 = 1,409,286,144.

    dense  32 * (41,943,040 + 40,960) + 2 * 131,072,000 + 4,096  = 1,605,636,096
    expert 32 * 1,409,286,144 / ep 8                             = 5,637,144,576
    ZeRO-1 optimizer params: dense over dp*cp = 8 -> 200,704,512; experts over the
    expert-data-parallel group dp*cp/ep = 1 -> 5,637,144,576; sum 5,837,849,088
    """
    spec = load_model("mixtral-8x7b")
    par = ParallelConfig(dp=8, ep=8, zero=ZeroStage.OPTIMIZER)
    sp, st = _states(spec, par, Workload())
    assert (sp.dense, sp.expert) == (1_605_636_096, 5_637_144_576)
    assert st.num_optimizer_params == 200_704_512 + 5_637_144_576 == 5_837_849_088
    assert st.optimizer_bytes == 12 * 5_837_849_088


# --- ZeRO paper, Table 1 (Rajbhandari et al. 2020, arXiv 1910.02054) ------------------------

def _zero_paper_spec() -> ModelSpec:
    """A dense Llama-style model with exactly Psi = 7,500,000,000 parameters.

    h = 3840 (30 heads of 128), f = 12,288, L = 34, V = 88,720, untied, RMSNorm, no biases.
    one layer: q,k,v,o 4h^2 = 4 * 14,745,600         =    58,982,400
               SwiGLU 3hf = 3 * 3840 * 12,288        =   141,557,760
               two norms 2h                          =         7,680
               layer                                 =   200,547,840
    34 layers                                        = 6,818,626,560
    embedding and head 2 * V*h = 2 * 340,684,800     =   681,369,600
    final norm h                                     =         3,840
    Psi                                              = 7,500,000,000  (= 3840 * 5^9 * 1)
    """
    return ModelSpec(
        name="zero-paper-7.5b", source="test: sized to the ZeRO paper's Psi = 7.5B",
        num_layers=34, hidden_size=3840, ffn_hidden_size=12_288, num_attention_heads=30,
        num_kv_heads=30, head_dim=128, vocab_size=88_720, max_seq_len=4096, norm="rmsnorm",
        mlp="swiglu", position="rope", tied_embeddings=False,
    )


PSI = 7_500_000_000
ND = 64
K = 12


@pytest.mark.parametrize(
    ("zero", "formula", "table_gb"),
    [
        # baseline (2 + 2 + K) * Psi = 16 * 7.5e9 = 120e9
        (ZeroStage.NONE, (2 + 2 + K) * PSI, "120"),
        # ZeRO-1: 2Psi + 2Psi + K*Psi/Nd = 30e9 + 1.40625e9 = 31.40625e9
        (ZeroStage.OPTIMIZER, 2 * PSI + 2 * PSI + K * PSI // ND, "31.4"),
        # ZeRO-2: 2Psi + (2 + K)*Psi/Nd = 15e9 + 1.640625e9 = 16.640625e9
        (ZeroStage.GRADIENTS, 2 * PSI + (2 + K) * PSI // ND, "16.6"),
        # ZeRO-3: (2 + 2 + K)*Psi/Nd = 1.875e9
        (ZeroStage.PARAMETERS, (2 + 2 + K) * PSI // ND, "1.88"),
    ],
)
def test_zero_paper_table1(zero: ZeroStage, formula: int, table_gb: str) -> None:
    """Psi = 7.5e9, Nd = 64, mixed-precision Adam (K = 12): 120, 31.4, 16.6, 1.88 GB (1e9 B).

    Psi / Nd = 117,187,500 exactly, so every shard is exact and memplan must match the paper's
    formula to the byte; the rounded GB must print as in the table.
    """
    spec = _zero_paper_spec()
    assert param_counts(spec).total == PSI
    par = ParallelConfig(dp=ND, zero=zero)
    sp = stage_params(spec, par, list(range(spec.num_layers)), first=True, last=True)
    assert sp.total == PSI
    st = state_bytes(sp, par, Workload(precision=Precision.FP16_MIXED))
    got = st.params_bytes + st.grads_bytes + st.optimizer_bytes
    assert got == formula
    digits = len(table_gb.split(".")[1]) if "." in table_gb else 0
    assert f"{got / GB:.{digits}f}" == table_gb
