"""The calibration grid: which short runs of the reference model to measure.

Torch-free, so the grid can be listed (and resumed) without starting a device. A point is one
(layout, micro-batch, sequence, recompute, precision, attention) run of the reference model; its
key names exactly those choices and is the record's file name.

The grid varies one thing at a time around a base and crosses the ones whose interaction is in
question: micro-batch x sequence x recompute (the saved activations and their s-squared part),
eager attention (the score matrix), fp32 (the dtype of every activation; eager, since the flash
kernel takes no fp32 on CUDA), and the recipes whose dtypes differ by tensor: bf16-pure (bf16
optimizer states, no master copy) and amp-bf16 (fp32 weights under autocast: weight casts,
fp32 residual stream and norms).
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.errors import MemplanError
from memplan.model.estimate import estimate
from memplan.overheads import no_overheads
from memplan.parallel import GradBuffers, ParallelConfig, TpStyle, ZeroStage
from memplan.spec import ModelSpec
from memplan.workload import Attention, Precision, Recompute, Workload

# Sequence lengths of the grid: CPU runs real tensors, so they are kept small there.
CPU_SEQS = (32, 64, 128)
CUDA_SEQS = (512, 1024, 2048)
MBS = (1, 2, 4)
# The reference model on CUDA is as deep as fits this share of the device at the grid's
# largest point, so the allocator is measured under realistic pressure, not an empty device.
CUDA_FILL = 0.5
MAX_CUDA_LAYERS = 32


@dataclass(frozen=True)
class Point:
    key: str
    spec: ModelSpec
    layout: ParallelConfig
    workload: Workload


def point_key(par: ParallelConfig, wl: Workload) -> str:
    """``tp1-dp1-z0-mbs2-seq64-none-bf16-mixed-flash``: every choice the grid varies."""
    recompute = wl.recompute.label + (f"{wl.recompute_layers}" if wl.recompute_layers else "")
    return (f"tp{par.tp}-dp{par.dp}-z{int(par.zero)}-mbs{wl.micro_batch_size}-seq{wl.seq_len}-"
            f"{recompute}-{wl.precision.value}-{wl.attention.value}")


def reference_spec(device: str, *, num_layers: int = 2) -> ModelSpec:
    """The Llama-style model the grid runs. CPU: small enough for real CPU tensors; its head
    counts divide by 1, 2 and 4 so the same model runs under TP on up to 4 ranks. CUDA: a
    ~0.1B-parameter-per-4-layers model (hidden 2048, GQA 16/4, SwiGLU 5632, vocab 32000)."""
    if device == "cpu":
        return ModelSpec(name="calib-cpu", source="memplan calibration reference (CPU)",
                         num_layers=num_layers, hidden_size=128, ffn_hidden_size=352,
                         num_attention_heads=8, num_kv_heads=4, head_dim=16, vocab_size=256,
                         max_seq_len=max(CPU_SEQS), norm="rmsnorm", mlp="swiglu",
                         position="rope", tied_embeddings=False)
    return ModelSpec(name=f"calib-cuda-{num_layers}l", source="memplan calibration reference "
                     "(CUDA; depth sized for the device)", num_layers=num_layers,
                     hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16,
                     num_kv_heads=4, head_dim=128, vocab_size=32000, max_seq_len=max(CUDA_SEQS),
                     norm="rmsnorm", mlp="swiglu", position="rope", tied_embeddings=False)


def cuda_spec_for(total_bytes: int, points: list[tuple[ParallelConfig, Workload]]) -> ModelSpec:
    """The deepest CUDA reference model whose analytic peak over ``points`` stays within
    ``CUDA_FILL`` of ``total_bytes`` (even layer counts, 2 to MAX_CUDA_LAYERS)."""
    from memplan.hardware import DEFAULT_GPU, load_gpu

    gpu = load_gpu(DEFAULT_GPU)  # only its capacity would be read; the tensor peak is asked
    best = None
    for layers in range(2, MAX_CUDA_LAYERS + 1, 2):
        spec = reference_spec("cuda", num_layers=layers)
        peak = max(estimate(spec, gpu, par, wl, overheads=no_overheads()).peak_bytes
                   for par, wl in points)
        if peak > CUDA_FILL * total_bytes:
            break
        best = spec
    if best is None:
        raise MemplanError(f"device memory ({total_bytes:,} bytes) is too small for the CUDA "
                           "calibration grid's 2-layer reference model")
    return best


def _wl(mbs: int, seq: int, recompute: Recompute = Recompute.NONE,
        precision: Precision = Precision.BF16_MIXED,
        attention: Attention = Attention.FLASH) -> Workload:
    return Workload(micro_batch_size=mbs, seq_len=seq, recompute=recompute, precision=precision,
                    attention=attention)


def single_workloads(seqs: tuple[int, int, int], *, quick: bool) -> list[Workload]:
    """Quick: 10 runs; full: 42 (see the module docstring for the design)."""
    s0, s1, s2 = seqs
    none, sel, full = Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL
    eager, fp32 = Attention.EAGER, Precision.FP32
    if quick:
        out = [_wl(b, s, r) for b in (1, 2) for s in (s0, s1) for r in (none, full)]
        return out + [_wl(1, s0, attention=eager), _wl(2, s1, attention=eager)]
    out = [_wl(b, s, r) for b in MBS for s in seqs for r in (none, sel, full)]
    out += [_wl(b, s, r, attention=eager) for b in (1, 2) for s in (s0, s1) for r in (none, sel)]
    out += [_wl(b, s, precision=fp32, attention=eager) for b, s in ((1, s0), (2, s1), (1, s2))]
    out += [_wl(b, s, r, precision=p) for p in (Precision.BF16_PURE, Precision.AMP_BF16)
            for b, s, r in ((1, s1, none), (2, s2, full))]
    return out


def device_grid(device: str, *, quick: bool, total_bytes: int | None = None,
                spec: ModelSpec | None = None) -> list[Point]:
    """Single-process points on ``device`` (``cpu`` or ``cuda``)."""
    seqs = CPU_SEQS if device == "cpu" else CUDA_SEQS
    layout = ParallelConfig()
    wls = single_workloads(seqs, quick=quick)
    if spec is None:
        if device == "cpu":
            spec = reference_spec("cpu")
        else:
            if total_bytes is None:
                raise MemplanError("the CUDA grid needs the device's total memory")
            spec = cuda_spec_for(total_bytes, [(layout, wl) for wl in wls])
    wls = [wl for wl in wls if wl.seq_len <= spec.max_seq_len]
    return [Point(point_key(layout, wl), spec, layout, wl) for wl in wls]


def parallel_layouts(nproc: int) -> list[tuple[ParallelConfig, Precision]]:
    """FSDP2 (ZeRO-3 over ``nproc`` ranks, torchtitan's bf16 mixed precision) and tensor
    parallelism with sequence parallelism, as ``memplan.profile.distributed`` builds them: DTensor
    style with the embedding and head replicated."""
    fsdp = ParallelConfig(dp=nproc, zero=ZeroStage.PARAMETERS)
    tp = ParallelConfig(tp=nproc, sequence_parallel=True, vocab_parallel=False,
                        tp_style=TpStyle.DTENSOR, grad_buffers=GradBuffers.VIEW)
    return [(fsdp, Precision.FSDP_BF16), (tp, Precision.BF16_MIXED)]


def parallel_grid(device: str, nproc: int, *, quick: bool,
                  spec: ModelSpec | None = None) -> list[Point]:
    """Multi-rank points: per layout, mbs x seq (quick: 3 runs; full: 9)."""
    if nproc < 2:
        raise MemplanError(f"nproc ({nproc}) must be at least 2 for a multi-rank grid")
    seqs = CPU_SEQS if device == "cpu" else CUDA_SEQS
    spec = spec or reference_spec(device, num_layers=2 if device == "cpu" else 8)
    sizes = [(1, seqs[0]), (2, seqs[0]), (1, seqs[1])] if quick else \
        [(b, s) for b in MBS for s in seqs]
    out = []
    for par, precision in parallel_layouts(nproc):
        for b, s in sizes:
            if par.sequence_parallel and s % par.tp:
                continue
            wl = _wl(b, s, precision=precision)
            out.append(Point(point_key(par, wl), spec, par, wl))
    return out
