"""Kernel throughput by shape and dtype: how fast a GPU runs a training step's GEMMs relative
to its largest ones.

The step-time model runs compute at a stated fraction of peak (``timing.DEFAULT_MFU``) until
calibration measures it. That fraction stands for the large GEMMs; a GEMM whose per-GPU
dimensions are small (a projection split by tensor parallelism, a short micro-batch) runs its
tensor cores below that rate, and a float8 GEMM on tensor cores with an FP8 mode runs at twice
the BF16 peak. This module gives both as time multipliers on the decoder layers' linears.

GEMM rates by shape are measured numbers: XLA's default matmul performance table for sm_90
(Hopper: H100, H200), ``kDefaultMatmulPTable`` in
openxla/xla ``xla/service/gpu/model/matmul_interpolator_data.h`` (2025), bf16 x bf16 -> bf16,
FLOP/s per (b, m, n, k). The slice kept here is b = 4, m = 4096 (16,384 rows: a training
micro-batch's tokens are of that order, and the table's largest rows), for n and k from 256
to 4096. Other GPUs have no measured table: their GEMMs run at the flat fraction (a factor 1,
the stated fallback).
"""

from __future__ import annotations

import math
from functools import lru_cache

from memplan.hardware import GpuSpec
from memplan.model.layer import layer_linears
from memplan.model.linear import Split
from memplan.spec import ModelSpec

GEMM_TABLE_SOURCE = ("openxla/xla xla/service/gpu/model/matmul_interpolator_data.h "
                     "kDefaultMatmulPTable, sm_90, bf16, b=4 m=4096")
GEMM_DIMS = (256, 512, 1024, 2048, 4096)
# FLOP/s of a b=4, m=4096 GEMM on sm_90 by (n, k): rows n = 256 .. 4096, columns k = 256 .. 4096
GEMM_SM90_BF16 = (
    (206488812307692, 335125413233458, 477643160142348, 588674245614035, 622459028405797),
    (298593388209121, 441505684210526, 588997160724081, 703631601572739, 728585722240481),
    (393312023443223, 542037204101593, 673839272969739, 720518760010484, 777585153532370),
    (458472170794193, 607491838189533, 687861993493688, 759301869386266, 808699906572796),
    (503874974234136, 619859436746254, 725508891943538, 764575547036718, 793131337247852),
)
GEMM_TABLES = {"9.0": GEMM_SM90_BF16}

# FP8 tensor cores (compute capability 8.9 and later: Ada, Hopper, Blackwell) run dense FP8 at
# twice their dense BF16 rate: NVIDIA H100 datasheet, SXM 1,979 TFLOPS FP8 vs 989.4 BF16
# (dense); L40S 733 vs 362; B200 4.5 PFLOPS vs 2.25. Earlier GPUs have no FP8 mode.
FP8_SPEEDUP = 2.0
FP8_MIN_CAPABILITY = (8, 9)


def gemm_rate(table: tuple[tuple[int, ...], ...], n: int, k: int) -> float:
    """FLOP/s of a GEMM with output columns ``n`` and inner dimension ``k``: bilinear in
    log2 between the table's points, held at its ends beyond them."""
    def pos(x: int) -> float:
        lo, hi = math.log2(GEMM_DIMS[0]), math.log2(GEMM_DIMS[-1])
        return (min(max(math.log2(max(x, 1)), lo), hi) - lo)  # steps of 1 between points

    pn, pk = pos(n), pos(k)
    i, j = min(int(pn), 3), min(int(pk), 3)
    fn, fk = pn - i, pk - j
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
    the measured rate of the table's largest GEMM (sm_90: 793 TFLOP/s, 0.80 of the H100's
    989.4); the rest is the time of what is not a GEMM (norms, activations, casts, launches).
    1.0 without a table (every FLOP at the flat fraction)."""
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
    table's largest GEMM, weighted by FLOPs, and twice as fast under float8 on FP8 tensor
    cores; the rest is unchanged. 1.0 on a GPU without a table."""
    table = GEMM_TABLES.get(gpu.compute_capability)
    if table is None:
        return 1.0
    fp8 = FP8_SPEEDUP if float8 and fp8_capable(gpu) else 1.0
    best = table[-1][-1]  # the largest GEMM, which the flat fraction of peak stands for
    work = slow = 0.0
    for i in range(spec.num_layers):
        kind = "linear" if spec.is_linear_layer(i) else ""
        for lin in layer_linears(spec, spec.is_moe_layer(i), kind):
            d_out = lin.d_out // tp if lin.split is Split.COLUMN else lin.d_out
            d_in = lin.d_in // tp if lin.split is Split.ROW else lin.d_in
            flops = float(lin.d_in * lin.d_out)
            # forward (n = out, k = in), input gradient (n = in, k = out), weight gradient
            # (an in x out result over the tokens: taken as its two small dimensions)
            for n, k in ((d_out, d_in), (d_in, d_out), (d_out, d_in)):
                work += flops
                slow += flops * best / gemm_rate(table, n, k)
    shape = slow / work if work else 1.0
    share = gemm_share(gpu, mfu)
    return 1.0 - share + share * shape / fp8
