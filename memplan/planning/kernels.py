"""Kernel throughput by shape and dtype: how fast a GPU runs a training step's GEMMs relative
to its largest ones.

The step-time model runs compute at a stated fraction of peak (``timing.DEFAULT_MFU``) until
calibration measures it. That fraction stands for the large GEMMs; a GEMM whose per-GPU
dimensions are small (a projection split by tensor parallelism, a short micro-batch) runs its
tensor cores below that rate, and a float8 GEMM on tensor cores with an FP8 mode runs faster
(at its measured float8 rate, else twice the BF16 one). This module gives both as time multipliers on the decoder layers' linears.

GEMM rates by shape are measured numbers: XLA's default matmul performance table,
``kDefaultMatmulPTable`` in openxla/xla ``xla/backends/gpu/cost_model/matmul_interpolator_data.h``
(2025, the version with sm_100 entries; its sm_90 slice below is also that of
``third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h`` in a tensorflow/tensorflow
mirror, punittiwari50/tensorflow-tensorflow at 7cc7ba5522621a48fb6ca2a0e0ffa7804aa695d1), FLOP/s per (b, m, n, k) for sm_100 (Blackwell: B200) and sm_90 (Hopper: H100, H200), bf16 x
bf16 -> bf16 and, on sm_100, f8e4m3fn x f8e4m3fn -> bf16. The slice kept here is b = 4,
m = 4096 (16,384 rows: a training micro-batch's tokens are of that order, and the table's
largest rows), for n and k from 256 to 4096. Other GPUs have no measured table: their GEMMs
run at the flat fraction (a factor 1, the stated fallback). The A100 (sm_80) among them: the
openxla file's table holds two keys, sm_100 and sm_90 (the tensorflow mirror's earlier version
sm_90 only), and the A100's one published measured matmul rate with its shape (271.2 TFLOP/s
at 1024 x 10240 x 5120, stas00/ml-engineering's "Maximum Achievable Matmul FLOPS comparison
table") is a single point, no rate by shape.

Where the step is timed kernel by kernel (``Workload.step_model`` kernels, which the Megatron-LM
preset selects, or kernels-torch with the PyTorch modules' pointwise kernels:
``timing._step_fields``) the GEMMs run at
their measured rates alone (``gemm_time_factor``; the A100 at its one measured rate,
``GEMM_MEASURED_RATE``) and the per-token kernels that are bound by memory, not FLOPs (norms,
bias-dropout-add, the MLP activation, RoPE, the softmax over materialised scores, the loss) take
the bytes they read and write over the HBM's bandwidth (``elementwise_bytes``,
``loss_bytes_per_token``).

The fused attention kernel runs at FlashAttention-2's measured causal forward-and-backward rate
by sequence length and head dimension (64 and 128) on Hopper and Ampere
(``attention_time_factor``), and torchao's float8 casts take their bytes over the HBM's
bandwidth (``float8_cast_seconds``): memory-bound kernels the FLOP count does not see.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

from memplan.hardware import GpuSpec
from memplan.model.layer import layer_linears
from memplan.model.linear import Linear, Split
from memplan.spec import ModelSpec, PositionKind

GEMM_TABLE_SOURCE = ("openxla/xla xla/backends/gpu/cost_model/matmul_interpolator_data.h "
                     "kDefaultMatmulPTable, sm_90 bf16 and sm_100 bf16 / f8e4m3fn, b=4 m=4096")
GEMM_DIMS = (256, 512, 1024, 2048, 4096)
# FLOP/s of a b=4, m=4096 GEMM by (n, k): rows n = 256 .. 4096, columns k = 256 .. 4096.
# sm_90, bf16 x bf16 -> bf16
GEMM_SM90_BF16 = (
    (210702869701726, 341520936386768, 489399190519598, 576970351423965, 611296227725590),
    (304003913929784, 451152026890756, 596192017767906, 710146708994709, 720624539759440),
    (396507320531757, 547548099949005, 677653407384032, 716544427093760, 773519549031967),
    (463419000431592, 612680557907312, 690176329101719, 758158392939099, 804715405124361),
    (505171406257351, 620391058211757, 722328842246888, 759530558969895, 788699393418751),
)
# sm_100, bf16 x bf16 -> bf16
GEMM_SM100_BF16 = (
    (265777679207920, 455602768218945, 683041872773536, 945767640187173, 1152431271775951),
    (402451958020989, 632263697335492, 903775537061392, 1145324612266666, 1322749398213735),
    (536736727818045, 801187762160145, 1060485752098765, 1265225848510513, 1411903819196038),
    (790642421832574, 913239909844779, 1163061297046627, 1345751933573554, 1465710635889068),
    (791826754730025, 1090646850177755, 1350485933693623, 1539854612058775, 1670467342710337),
)
# sm_100, f8e4m3fn x f8e4m3fn -> bf16
GEMM_SM100_F8 = (
    (289808859379217, 504459395818651, 936743139803707, 1343857101376721, 1804608107563025),
    (463619094991364, 798840750674230, 1338830204488778, 1777442365526874, 2274424992917190),
    (670198532573925, 1046340774955843, 1868697360526459, 2422343992950051, 2662049496833175),
    (840666920336660, 1534876189046725, 2400764279485746, 2884888089502739, 3133333032521344),
    (1012754984761399, 1712208215672106, 2651214380246913, 3122477132679026, 3279676742061148),
)
GEMM_TABLES = {"9.0": GEMM_SM90_BF16, "10.0": GEMM_SM100_BF16}
# The same file's sm_90 f8e4m3fn x f8e4m3fn -> bf16 entries are not used: 17 of the slice's 25
# exceed the H100's dense FP8 peak (1,979 TFLOP/s; b=4 m=4096 n=k=4096: 2,593 TFLOP/s), so they
# cannot be rates of the FLOPs memplan counts. sm_90 takes the measured ratio below.
GEMM_F8_TABLES = {"10.0": GEMM_SM100_F8}

# FP8 tensor cores (compute capability 8.9 and later: Ada, Hopper, Blackwell) run dense FP8 at
# twice their dense BF16 rate: NVIDIA H100 datasheet, SXM 1,979 TFLOPS FP8 vs 989.4 BF16
# (dense); L40S 733 vs 362; B200 4.5 PFLOPS vs 2.25. Earlier GPUs have no FP8 mode. The
# fallback where no measured float8 table exists (``GEMM_F8_TABLES``).
FP8_SPEEDUP = 2.0
FP8_MIN_CAPABILITY = (8, 9)
# Measured instead where no float8 table exists: the largest float8_e4m3fn matmul rate over the
# largest bf16 one, H100 SXM 1,402.6 / 794.5 TFLOP/s = 1.765 ("Maximum Achievable Matmul FLOPS
# comparison table", stas00/ml-engineering compute/accelerator/README.md at
# 744d01e18b79512572f64a6bbd8b5f4a725203a7: BF16 794.5 at 2048x2048x13312, "H200 is the same";
# FP8 1,402.6 at 1024x9216x14336, torch 2.7.0+cu126). The bf16 row's 794.5 agrees with XLA's
# sm_90 table (788.7 at n=k=4096) where XLA's float8 entries exceed the FP8 peak.
FP8_MEASURED_SPEEDUP = {"9.0": 1402.6 / 794.5}


def gemm_rate(table: tuple[tuple[int, ...], ...], n: int, k: int) -> float:
    """FLOP/s of a GEMM with output columns ``n`` and inner dimension ``k``: bilinear in
    log2 between the table's points (``_log2_position``), held at its ends beyond them."""
    i, fn = _log2_position(n, GEMM_DIMS)
    j, fk = _log2_position(k, GEMM_DIMS)
    r = table
    return ((1 - fn) * (1 - fk) * r[i][j] + fn * (1 - fk) * r[i + 1][j]
            + (1 - fn) * fk * r[i][j + 1] + fn * fk * r[i + 1][j + 1])


def fp8_capable(gpu: GpuSpec) -> bool:
    if gpu.vendor != "nvidia":
        return gpu.vendor == "amd" and gpu.compute_capability.startswith("gfx94")  # MI300
    major, minor = (int(x) for x in gpu.compute_capability.split(".")[:2])
    return (major, minor) >= FP8_MIN_CAPABILITY


def gemm_share(gpu: GpuSpec, mfu: float) -> float:
    """Of a step's time per FLOP at ``mfu`` of peak, the share its GEMMs take when they run at
    the measured rate of the table's largest GEMM (sm_90: 789 TFLOP/s, 0.80 of the H100's
    989.4; sm_100: 1,670, 0.74 of the B200's 2,250); the rest is the time of what is not a
    GEMM (norms, activations, casts, launches). 1.0 without a table (every FLOP at the flat
    fraction)."""
    table = GEMM_TABLES.get(gpu.compute_capability)
    if table is None:
        return 1.0
    return min(1.0, mfu * gpu.bf16_flops / table[-1][-1])


@lru_cache(maxsize=4096)
def linear_time_factor(spec: ModelSpec, gpu: GpuSpec, tp: int, float8: bool,
                       mfu: float) -> float:
    """The decoder layers' linears' time over their time at the flat fraction ``mfu`` of peak.
    Of that time the GEMMs' share (``gemm_share``) runs each projection's forward, input-
    gradient and weight-gradient GEMM at the measured rate of its per-GPU shape (a column-
    parallel projection's output split by ``tp``, a row-parallel one's input), relative to the
    table's largest GEMM, weighted by FLOPs; under float8 on FP8 tensor cores at the shape's
    measured float8 rate (``GEMM_F8_TABLES``), else its bf16 rate times the measured ratio of
    the largest float8 and bf16 matmuls (``FP8_MEASURED_SPEEDUP``), else the datasheet's 2
    (``FP8_SPEEDUP``); the rest is unchanged. 1.0 on a GPU without a table."""
    table = GEMM_TABLES.get(gpu.compute_capability)
    if table is None:
        return 1.0
    fp8 = float8 and fp8_capable(gpu)
    f8_table = GEMM_F8_TABLES.get(gpu.compute_capability) if fp8 else None
    speedup = (FP8_MEASURED_SPEEDUP.get(gpu.compute_capability, FP8_SPEEDUP)
               if fp8 and f8_table is None else 1.0)
    rates = f8_table or table
    best = table[-1][-1]  # the largest GEMM, which the flat fraction of peak stands for
    work = slow = 0.0
    gemms: dict[tuple[bool, str], list[tuple[float, float]]] = {}  # per kind of layer
    for i in range(spec.num_layers):
        kind = (spec.is_moe_layer(i), "linear" if spec.is_linear_layer(i) else "")
        terms = gemms.get(kind)
        if terms is None:
            terms = gemms[kind] = _gemm_terms(layer_linears(spec, *kind), tp, rates, best)
        for flops, time in terms:  # (summed layer by layer, GEMM by GEMM, as written)
            work += flops
            slow += time
    shape = slow / work if work else 1.0
    share = gemm_share(gpu, mfu)
    return 1.0 - share + share * shape / speedup


def _gemm_terms(linears: tuple[Linear, ...], tp: int, rates: tuple[tuple[int, ...], ...],
                best: float) -> list[tuple[float, float]]:
    """(FLOPs, time relative to the table's largest GEMM) of each GEMM of a layer's
    ``linears`` on one of ``tp`` ranks: forward (n = out, k = in), input gradient (n = in,
    k = out), weight gradient (an in x out result over the tokens: taken as its two small
    dimensions)."""
    out = []
    for lin in linears:
        d_out = lin.d_out // tp if lin.split is Split.COLUMN else lin.d_out
        d_in = lin.d_in // tp if lin.split is Split.ROW else lin.d_in
        flops = float(lin.d_in * lin.d_out)
        for n, k in ((d_out, d_in), (d_in, d_out), (d_out, d_in)):
            out.append((flops, flops * best / gemm_rate(rates, n, k)))
    return out


# torchao's float8 casts are memory-bound kernels: the bytes each moves per element of the
# tensor it casts, from torchao's own roofline model of them (pytorch/ao
# torchao/testing/float8/roofline_utils.py, get_tensor_memory_traffic_ovhd_s; bf16 in,
# float8 out). An activation (a linear's input or its output's gradient): tensorwise reads it
# for its amax (2 B, fused into the op before it when compiled) and writes it twice in float8,
# row- and column-major (2 + 2 x 1 B): 6, compiled 4; rowwise writes a float8 copy and a
# transposed bf16 copy (2 + 1 + 2 B, the first read fused when compiled) and casts the latter
# (2 + 1 B): 8, compiled 6. A weight: tensorwise amax (2) and two casts (3 + 3): 8; rowwise a
# cast (3), a transposed copy (4) and its cast (3): 10. The kernels run at 92% of the HBM's
# peak (the same file: "pct_achievable_mem_bw", measured on pointwise Triton kernels).
CAST_BYTES = {"tensorwise": {"activation": 6, "compiled": 4, "weight": 8},
              "rowwise": {"activation": 8, "compiled": 6, "weight": 10}}
ACHIEVABLE_HBM = 0.92
CAST_SOURCE = "pytorch/ao torchao/testing/float8/roofline_utils.py (bytes per cast, 92% of HBM)"
# Rowwise scales in the backward's GEMMs: torchao runs the input- and weight-gradient GEMMs
# without fast accumulation (Float8LinearConfig's gemm_config_grad_input and
# gemm_config_grad_weight default to use_fast_accum=False), and for rowwise scales without it
# runs the tensorwise cuBLAS kernel with unit scales and multiplies the output by the outer
# product of the two scale vectors afterwards (torchao/float8/float8_python_api.py
# addmm_float8_unwrapped: "The rowwise CUTLASS-based kernel is so slow without fast-accum").
# That multiply is one more memory-bound pass over each gradient GEMM's output: compiled, read
# and write it in bf16 (2 + 2 B, the scales broadcast in the fused kernel); eager, the outer
# product written and read in fp32 (4 + 4 B) and the bf16 output read (2 B) into an fp32
# product (4 B, bf16 times fp32 promotes): 14 B.
POST_SCALE_BYTES = {"compiled": 4, "eager": 14}


@lru_cache(maxsize=1024)
def float8_cast_seconds(spec: ModelSpec, gpu: GpuSpec, tp: int, recipe: str, compiled: bool,
                        sp: bool) -> tuple[float, float]:
    """(seconds per token, seconds per micro-batch) of torchao's float8 casts in the decoder
    layers of one rank, summed over all layers; (0, 0) where float8 runs at the flat fraction
    (no GEMM table or no FP8 tensor cores).

    Per token (of the rows the rank's GEMMs run) each linear casts its output's gradient
    (d_out / tp of a column-parallel projection, d_out of a row-parallel one) and its input: a
    row-parallel projection its d_in / tp, a column-parallel one its d_in, once per input its
    projections share when compiled (AOTAutograd merges identical nodes, ``fx_graph_cse``),
    else once each. Tensorwise under sequence parallelism casts the shared input on the
    rank's 1/tp of the tokens before the all-gather (torchao ``PrepareFloat8ModuleInput``,
    ``Float8ColwiseParallel``, which torchtitan's TP plan uses for tensorwise only; rowwise
    gathers in bf16). Per micro-batch each linear casts its weight shard, d_in x d_out / tp.
    Rowwise adds the rescale of each gradient GEMM's output (``POST_SCALE_BYTES``): per token
    the input gradient's local width, per micro-batch the weight gradient's shard."""
    table = GEMM_TABLES.get(gpu.compute_capability)
    if table is None or not fp8_capable(gpu):
        return 0.0, 0.0
    b = CAST_BYTES[recipe]
    act = b["compiled" if compiled else "activation"]
    gathered = recipe == "tensorwise" and tp > 1 and sp
    post = POST_SCALE_BYTES["compiled" if compiled else "eager"] if recipe == "rowwise" else 0
    per_token = per_mb = 0.0
    for i in range(spec.num_layers):
        kind = "linear" if spec.is_linear_layer(i) else ""
        shared: set[str] = set()
        for lin in layer_linears(spec, spec.is_moe_layer(i), kind):
            row = lin.split is Split.ROW
            per_token += act * (lin.d_out if row else lin.d_out // tp)
            per_mb += b["weight"] * lin.d_in * lin.d_out / tp
            # rowwise: the input gradient (d_in local) and weight gradient outputs rescaled
            per_token += post * (lin.d_in // tp if row else lin.d_in)
            per_mb += post * lin.d_in * lin.d_out / tp
            if row:
                per_token += act * lin.d_in // tp
            elif not ((compiled or gathered) and lin.group in shared):
                per_token += act * lin.d_in / (tp if gathered else 1)
                shared.add(lin.group)
    rate = gpu.hbm_bytes_per_s * ACHIEVABLE_HBM
    return per_token / rate, per_mb / rate


# FlashAttention-2 (the kernel PyTorch's SDPA flash backend runs), causal, the forward and
# backward together, TFLOP/s by sequence length at 16k tokens a batch (hidden 2048: 32 heads of
# 64 or 16 of 128), by head dimension: Dao-AILab/flash-attention
# assets/flash2_h100_fwd_bwd_benchmark.png (H100 80GB SXM5) and flash2_a100_fwd_bwd_benchmark.png
# (A100 80GB SXM4), panels (c) "With causal mask, head dimension 64" and (d) "... head dimension
# 128" (the FlashAttention-2 bars; the figures as committed in 4f285b354796fb17df8636485b9a04df3ebbb7dc),
# measured by the repository's benchmarks/benchmark_flash_attention.py, which counts the
# backward as 2.5 forwards (five matmuls to two; Dao 2023, FlashAttention-2, arXiv 2307.08691,
# section 4.1): a step of 3.5 forwards. The FlashAttention-3 paper (Shah et al. 2024, arXiv
# 2407.08608) publishes FlashAttention-2's causal forward on the H100 (its forward-speed figure,
# panel (d): 191, 260, 298, 319, 333, 335 from 512 to 16k) but its backward without the causal
# mask only, which at short sequences is faster than the causal one the training step runs.
ATTENTION_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_HEAD_DIMS = (64, 128)
FA2_SM90_CAUSAL = ((141e12, 192e12, 232e12, 257e12, 273e12, 284e12),   # head dim 64
                   (163e12, 221e12, 265e12, 294e12, 308e12, 328e12))   # head dim 128
FA2_SM80_CAUSAL = ((88e12, 119e12, 140e12, 156e12, 165e12, 171e12),
                   (99e12, 133e12, 155e12, 173e12, 182e12, 189e12))
FA_STEP_FLOPS = 3.5  # forward and backward, in forwards (benchmark_flash_attention.py flops)
ATTENTION_KERNEL_SOURCE = ("FlashAttention-2, causal, head dim 64 and 128, forward + backward: "
                           "Dao-AILab/flash-attention assets/flash2_{h100,a100}_fwd_bwd_benchmark.png")
ATTENTION_TABLES = {"9.0": FA2_SM90_CAUSAL, "8.0": FA2_SM80_CAUSAL}


def _log2_position(x: float, points: tuple[int, ...]) -> tuple[int, float]:
    """(index of the lower point, fraction of the way to the next) of ``x`` among ``points``,
    linear in log2, held at the ends beyond them."""
    lo, hi = math.log2(points[0]), math.log2(points[-1])
    pos = min(max(math.log2(max(x, 1)), lo), hi) - lo  # steps of 1 between points
    i = min(int(pos), len(points) - 2)
    return i, pos - i


def _by_seq(rates: tuple[float, ...], seq_len: int) -> float:
    """``rates`` at ``seq_len`` tokens: linear in log2 of the length between the measured
    lengths, held at the ends beyond them."""
    i, f = _log2_position(seq_len, ATTENTION_SEQS)
    return (1 - f) * rates[i] + f * rates[i + 1]


def attention_rate_measured(table: tuple[tuple[float, ...], ...], seq_len: int,
                            head_dim: int) -> float:
    """FLOP/s of the measured kernel at ``seq_len`` tokens and ``head_dim``: by length
    (``_by_seq``) at each measured head dimension, then linear in log2 of the head dimension
    between them (64 to 128; 96, halfway in log2, near the mean), held at the ends beyond them
    (a head of 256 at 128's rate, one of 32 at 64's)."""
    i, f = _log2_position(head_dim, ATTENTION_HEAD_DIMS)
    return (1 - f) * _by_seq(table[i], seq_len) + f * _by_seq(table[i + 1], seq_len)


@lru_cache(maxsize=1024)
def attention_time_factor(gpu: GpuSpec, seq_len: int, mfu: float,
                          head_dim: int = 128) -> float | None:
    """The fused attention kernel's time for its FLOPs over their time at the flat fraction
    ``mfu`` of peak, on ``seq_len`` tokens a sequence (what one rank's kernel runs: seq / cp
    under context parallelism) with heads of ``head_dim``. The step counts the attention's
    backward as twice its forward (3 F for a forward of F FLOPs); the kernels run 3.5 F
    (``FA_STEP_FLOPS``) at the measured forward-and-backward rate R
    (``attention_rate_measured``): factor = mfu * peak * 3.5 / (3 R). None on a GPU without a
    measured table (the caller keeps its length-relative rate)."""
    table = ATTENTION_TABLES.get(gpu.compute_capability)
    if table is None:
        return None
    rate = attention_rate_measured(table, seq_len, head_dim)
    return mfu * gpu.bf16_flops * FA_STEP_FLOPS / (3.0 * rate)


# The one measured GEMM rate of GPUs without a table by shape (``GEMM_TABLES``): A100 (sm_80)
# 271.2 TFLOP/s bf16 at 1024 x 10240 x 5120 (stas00/ml-engineering compute/accelerator/
# README.md at 744d01e18b79512572f64a6bbd8b5f4a725203a7, "Maximum Achievable Matmul FLOPS
# comparison table"), 0.87 of the 312 TFLOP/s dense peak: every GEMM at that rate, no shape.
GEMM_MEASURED_RATE = {"8.0": 271.2e12}
GEMM_RATE_SOURCE = ("stas00/ml-engineering 'Maximum Achievable Matmul FLOPS': A100 bf16 "
                    "271.2 TFLOP/s at 1024x10240x5120")


def gemm_best_rate(gpu: GpuSpec) -> float | None:
    """FLOP/s of the GPU's largest measured bf16 GEMM: the table's largest (sm_90: 789
    TFLOP/s; sm_100: 1,670), else the single measured rate (``GEMM_MEASURED_RATE``); None
    without a measured GEMM rate (the step then runs every FLOP at the flat fraction)."""
    table = GEMM_TABLES.get(gpu.compute_capability)
    if table is not None:
        return float(table[-1][-1])
    return GEMM_MEASURED_RATE.get(gpu.compute_capability)


@lru_cache(maxsize=4096)
def gemm_time_factor(spec: ModelSpec, gpu: GpuSpec, tp: int, float8: bool,
                     mfu: float) -> float | None:
    """The decoder layers' linears' time over their time at the flat fraction ``mfu`` of peak
    when they are GEMMs alone, at their measured rates: by per-GPU shape relative to the
    largest measured GEMM where the GPU has a table (``linear_time_factor`` without its
    non-GEMM remainder: ``mfu * peak / best * shape / speedup``), else at the single measured
    rate (A100: 271.2 TFLOP/s, float8 without FP8 tensor cores at that rate too). None without
    a measured GEMM rate. The time of what is not a GEMM is the step's memory-bound kernels
    (``elementwise_bytes``), not a share of this one."""
    best = gemm_best_rate(gpu)
    if best is None:
        return None
    if GEMM_TABLES.get(gpu.compute_capability) is None:
        speedup = FP8_SPEEDUP if float8 and fp8_capable(gpu) else 1.0
        return mfu * gpu.bf16_flops / best / speedup
    share = mfu * gpu.bf16_flops / best
    # linear_time_factor = 1 - s + s * shape / speedup, with s = min(1, share)
    s = min(1.0, share)
    return (linear_time_factor(spec, gpu, tp, float8, mfu) - 1.0 + s) / s * share


# Memory-bound per-token kernels of a decoder layer: the bytes each reads and writes over HBM
# per token of the sequence, one rank, in the compute dtype of e bytes (H: the hidden width a
# rank holds per token, h / tp under sequence parallelism, else h; F: the MLP's intermediate
# width per rank, ffn / tp; heads: a / tp query heads; s: the keys a query row sees).
#
# Megatron-LM (megatron/core/transformer/transformer_layer.py TransformerLayer.forward, its
# fused kernels):
# - the two layer norms (apex FusedLayerNormAffineFunction / Transformer Engine LayerNorm,
#   megatron/core/fusions/fused_layer_norm.py): read x, write y, 2 H e; backward reads dy and
#   x, writes dx: 3 H e.
# - the two bias-dropout-adds (megatron/core/fusions/fused_bias_dropout.py
#   bias_dropout_add_fused_train: residual + dropout(x + bias)): read x and the residual,
#   write the sum and, with dropout, its 1-byte mask: (3 e + 1) H; backward reads the output
#   gradient and the mask and writes dx, (2 e + 1) H, and the bias gradient reads dx, e H.
# - the MLP activation: bias_gelu_impl (fused_bias_gelu.py): read and write F, 2 F e;
#   backward (bias_gelu_back) reads the gradient and the input and writes dx, 3 F e, and the
#   fc1 bias gradient reads dx, F e. bias_swiglu_impl (fused_bias_swiglu.py): read 2 F,
#   write F: 3 F e; backward reads the gradient and 2 F, writes 2 F: 5 F e.
# - the softmax over materialised scores (megatron/core/fusions/fused_softmax.py
#   FusedScaleMaskSoftmax, the causal kernel scaled_upper_triang_masked_softmax_cuda): per
#   query row it loads the unmasked keys (s / 2 on average) and writes the whole row: 1.5 s e
#   a head; backward loads the gradient and the output of the unmasked keys and writes the
#   row: 2 s e. The attention dropout after it (CoreAttention / DotProductAttention.forward,
#   torch dropout): read s e, write s e and a 1-byte mask; backward: read s e and the mask,
#   write s e.
# - the residual stream's gradient: where the stream forks (into the norm and around it),
#   autograd sums the two gradients, read 2 H e, write H e, twice a layer.
# - RoPE (where the model has it) rotates q and k: read and write (a + kv) / tp d, forward
#   and backward (apply_rotary_pos_emb, fused under --apply-rope-fusion).
# torchtitan and transformers (torchtitan/models/llama3/model.py TransformerBlock.forward,
# FeedForward.forward: ``w2(F.silu(w1(x)) * w3(x))``; nn.RMSNorm's torch.rms_norm, which on
# CUDA is one kernel, aten::_fused_rms_norm): the norms as above; the residual adds read two
# and write one, 3 H e, no dropout; SwiGLU eager is two kernels, silu (read F, write F) and
# mul (read 2 F, write F), 5 F e, backward mul's two products (read 2 F, write F, twice) and
# silu's (read 2 F, write F): 9 F e; compiled (Inductor fuses the pointwise chain) as
# Megatron's fused kernel, 3 F e and 5 F e. Eager attention's softmax (not Megatron's kernel)
# reads and writes every score: 2 s e, backward 3 s e.
ELEMENTWISE_SOURCE = ("Megatron-LM megatron/core/fusions (fused_layer_norm, fused_bias_dropout, "
                      "fused_bias_gelu, fused_bias_swiglu, fused_softmax); torchtitan "
                      "models/llama3/model.py; bytes over the HBM bandwidth at 92%")


class ElementwiseBytes(NamedTuple):
    """Bytes one layer's memory-bound kernels move per token on one rank: ``forward``,
    ``backward``, and ``core`` (of the forward: the attention core's softmax and dropout,
    what selective recompute reruns)."""

    forward: float
    backward: float
    core: float


@lru_cache(maxsize=4096)
def elementwise_bytes(spec: ModelSpec, tp: int, sp: bool, seq_kv: int, itemsize: int,
                      megatron_kernels: bool, compiled: bool,
                      eager_attention: bool) -> ElementwiseBytes:
    """The memory-bound kernels' bytes of one decoder layer per token (see above), on a rank
    of tensor-parallel degree ``tp`` (``sp``: sequence parallel) whose attention rows see
    ``seq_kv`` keys. MoE layers: the routed experts' top-k intermediate widths and the shared
    experts' (the router's kernels are not counted); every layer is taken as an attention
    layer. ``megatron_kernels``: Megatron-LM's fused kernels (``StepModel.KERNELS``), else
    torchtitan's eager ones or, ``compiled``, Inductor's fused activation
    (``StepModel.KERNELS_TORCH``)."""
    e = float(itemsize)
    hidden = spec.hidden_size / tp if sp else float(spec.hidden_size)
    if spec.moe is not None:
        ffn = (spec.moe.top_k * spec.moe.expert_ffn_hidden_size
               + spec.moe.num_shared_experts * spec.moe.shared_expert_ffn_hidden_size) / tp
    else:
        ffn = spec.ffn_hidden_size / tp
    dropout = megatron_kernels and spec.dropout > 0
    mask = 1.0 if dropout else 0.0
    gated = spec.mlp.gated
    fused = megatron_kernels or compiled
    # norms: 2 H e forward, 3 H e backward, two a layer
    fwd, bwd = 2 * 2 * hidden * e, 2 * 3 * hidden * e
    # the residual junctions: forward the adds (Megatron's with bias and dropout), backward
    # the gradient sums and, in Megatron, dropout's backward and the bias gradient
    if megatron_kernels:
        fwd += 2 * (3 * e + mask) * hidden
        bwd += 2 * ((2 * e + mask) * hidden + (e * hidden if spec.mlp_bias else 0.0))
    else:
        fwd += 2 * 3 * hidden * e
    bwd += 2 * 3 * hidden * e
    # the activation
    if gated:
        fwd += (3 if fused else 5) * ffn * e
        bwd += (5 if fused else 9) * ffn * e
    else:
        fwd += 2 * ffn * e
        bwd += 3 * ffn * e + (ffn * e if megatron_kernels and spec.mlp_bias else 0.0)
    if spec.qkv_bias and megatron_kernels:  # the QKV bias gradient reads the output's gradient
        bwd += (spec.num_attention_heads + 2 * spec.num_kv_heads) * spec.head_dim / tp * e
    if spec.position is PositionKind.ROPE:
        rope = 2 * (spec.num_attention_heads + spec.num_kv_heads) * spec.head_dim / tp * e
        fwd += rope
        bwd += rope
    core = 0.0
    if eager_attention:
        rows = spec.num_attention_heads / tp * seq_kv  # score elements per token
        if megatron_kernels:
            core = rows * (1.5 * e + (2 * e + mask if dropout else 0.0))
            bwd += rows * (2 * e + (2 * e + mask if dropout else 0.0))
        else:
            core = rows * 2 * e
            bwd += rows * 3 * e
        fwd += core
    return ElementwiseBytes(fwd, bwd, core)


# The loss over the vocabulary, per token and vocabulary entry on one rank (v / tp entries):
# the logits cast to fp32 (read e, write 4), the log-softmax's two reads and one write (max,
# then exp-sum and the normalised write: torch's log_softmax, Megatron-LM's
# VocabParallelCrossEntropy.forward the same passes), and backward its gradient (read the
# saved fp32 output and write the gradient: 8, the one-hot subtraction in place) and the cast
# back to the compute dtype (read 4, write e): 2 e + 28 bytes an entry.
def loss_bytes_per_token(spec: ModelSpec, tp: int, itemsize: int) -> float:
    return (2 * itemsize + 28) * spec.vocab_size / tp
