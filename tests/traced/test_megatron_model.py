"""megatron-core's GPTModel traced end to end on CPU against ``--framework megatron``.

``memplan.profile.megatron_model`` builds megatron-core 0.16.1's ``GPTModel`` (local layer spec:
megatron's own ``DotProductAttention``, ``torch.nn.RMSNorm``, SwiGLU, RoPE, GQA 4:1), wraps it in
``Float16Module`` (bf16) and megatron-core's ``DistributedDataParallel`` (contiguous fp32 grad
buffer), builds its optimizer with ``get_megatron_optimizer`` and steps it through core's
``forward_backward_no_pipelining`` as ``megatron/training/training.py train_step`` does, on a
one-rank gloo group, under the exact tracker. What a CPU run swaps (CUDA device names, the CUDA
RNG tracker, Apex's FusedAdam by torch's fused AdamW, Apex's in-place gradient scale, no
gradient-accumulation fusion) is listed in that module's docstring.

Style of ``test_frameworks.py``: parameters, gradients and optimizer states to the byte, saved
activations and every phase within 1%; where memplan does not model what Megatron does, the case
is ``xfail(strict=True)`` with the measured difference and its cause in megatron-core's source.
Every case here is such a case today: parameters and gradients agree to the byte, the rest is
off by the Megatron behaviours below (``CAUSES``), which memplan's megatron preset does not
model yet.
"""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from known import Known, check, param  # tests/traced/known.py
from memplan.profile.frameworks import FrameworkCase  # noqa: E402
from memplan.profile.megatron_model import MEGATRON_TOY, compare_megatron  # noqa: E402


PHASE_ROWS = tuple(f"{step}.{phase}_bytes" for step in ("first_step", "steady")
                   for phase in ("forward", "backward", "optimizer"))
# the optimizer phases agree since the global buffer is modelled (within 0.07%: the RoPE table)
KNOWN_ROWS = ("optimizer_bytes", "activations_bytes",
              *(r for r in PHASE_ROWS if not r.endswith(".optimizer_bytes")))




# Megatron behaviours memplan's megatron preset does not model (megatron-core 0.16.1), with
# b micro-batch, s sequence, h hidden, f ffn, np heads, ng query groups, d head dim, L layers,
# T = b*s tokens, c the compute dtype's bytes:
CAUSES = {
    "glu": (
        "MLP.forward's glu (transformer/mlp.py, bias_activation_fusion off): "
        "activation_func(x_glu) * (x_linear + glu_linear_offset) makes a new T*f*c tensor, "
        "saved by the mul, while silu's saved x_glu keeps the whole fc1 output alive: one "
        "more ffn-sized tensor a layer than memplan's SwiGLU (917,504 B / layer fp32)"),
    "small": (
        "per layer a bool s*s causal mask saved by masked_fill_ (transformer/utils.py "
        "get_default_causal_mask), RoPE's cos/sin per q and k saved by the muls "
        "(models/common/embeddings/rope_utils.py _apply_rotary_pos_emb_bshd: 4*s*d*4 B in fp32), "
        "and RotaryEmbedding.forward's lru_cache'd s*d fp32 table (rotary_pos_embedding.py), "
        "kept across steps"),
    "step_counters": (
        "linear_fc1 is one [2f, h] parameter (gate and up fused): torch's fused AdamW (the "
        "stand-in for Apex / TE FusedAdam, which keep no per-tensor step) holds one 4-byte "
        "step counter fewer per layer than memplan's separate gate/up (8 B)"),
}


def _cause(*names: str, measured: str) -> str:
    return "; ".join(CAUSES[n] for n in names) + ". Measured: " + measured


# modelled since (megatron preset): DDP's gradient buffer from the wrap on at any DP size
# (param_and_grad_buffer.py _ParamAndGradBuffer.__init__); the global memory buffer
# DotProductAttention.forward takes baddbmm's input from (b*np*s*s*c, made at the first
# attention and kept: Workload.attention_global_buffer, 1,048,576 B fp32, 524,288 B bf16),
# which moved every phase by that and brought the optimizer phases within 0.07% (the
# RoPE table, 16,384 B, and the step counters). Not in the preset: the fp32 softmax
# of forward_torch_softmax, which the CPU trace runs with masked_softmax_fusion off; on CUDA
# FusedScaleMaskSoftmax (fusions/fused_softmax.py, masked_softmax_fusion=True by default)
# runs the fused scaled-masked-softmax kernel, which saves its low-precision output only
FP32_NONE = _cause("glu", "small", "step_counters", measured=(
    "activations 18,284,840 B, estimated 15,248,648 (-16.6%, the global buffer among the "
    "trace's); forward -2.4% / -1.6% (first / steady), backward -5.3% / -3.6%"))
FP32_SELECTIVE = _cause("glu", "small", "step_counters", measured=(
    "activations 16,023,856 B, estimated 12,430,600 (-22.4%); forward -4.4% / -2.9%, "
    "backward -7.2% / -4.8%"))
FP32_FULL = _cause("small", "step_counters", measured=(
    "activations 3,174,696 B, estimated 2,202,888 (-30.6%: the global buffer and RoPE table "
    "outlive the checkpointed layers, among the trace's activations, memplan's buffers); "
    "forward -6.1% / -3.5%, backward -4.0% / -2.5%"))
BF16_NONE = _cause("glu", "small", "step_counters", measured=(
    "activations 11,796,776 B, estimated 8,154,376 (-30.9%; -13.1% with softmax_fp32, the "
    "torch softmax's fp32 copy); forward -8.9% / -5.9%, backward -9.0% / -5.9%"))

# Each known row's size as last measured: (estimated - measured bytes, % of measured)
# (megatron-core 0.16.1, torch 2.13 CPU; ``known.check`` fails when one moves)
FP32_NONE_SIZES = {
    "optimizer_bytes": (8, 0.0000),
    "activations_bytes": (-3_036_192, -16.6050),
    "first_step.forward_bytes": (-880_652, -2.4376),
    "first_step.backward_bytes": (-1_987_616, -5.3103),
    "steady.forward_bytes": (-880_644, -1.6319),
    "steady.backward_bytes": (-1_987_608, -3.5965),
}
FP32_SELECTIVE_SIZES = {
    "optimizer_bytes": (8, 0.0000),
    "activations_bytes": (-3_593_256, -22.4244),
    "first_step.forward_bytes": (-1_503_252, -4.4387),
    "first_step.backward_bytes": (-2_544_680, -7.2357),
    "steady.forward_bytes": (-1_503_244, -2.9075),
    "steady.backward_bytes": (-2_544_672, -4.8009),
}
FP32_FULL_SIZES = {
    "optimizer_bytes": (8, 0.0000),
    "activations_bytes": (-971_808, -30.6111),
    "first_step.forward_bytes": (-1_496_084, -6.0949),
    "first_step.backward_bytes": (-1_184_800, -4.0369),
    "steady.forward_bytes": (-1_496_076, -3.5299),
    "steady.backward_bytes": (-1_184_792, -2.5110),
}
BF16_NONE_SIZES = {  # the distributed optimizer's case measures the same
    "optimizer_bytes": (8, 0.0000),
    "activations_bytes": (-3_642_400, -30.8762),
    "first_step.forward_bytes": (-3_092_492, -8.9318),
    "first_step.backward_bytes": (-3_118_112, -9.0077),
    "steady.forward_bytes": (-3_092_484, -5.8950),
    "steady.backward_bytes": (-3_118_104, -5.9447),
}
BF16_SELECTIVE_SIZES = {
    "optimizer_bytes": (8, 0.0000),
    "activations_bytes": (-1_807_400, -21.1324),
    "first_step.forward_bytes": (-1_290_260, -4.1118),
    "first_step.backward_bytes": (-1_283_112, -4.0900),
    "steady.forward_bytes": (-1_290_252, -2.6216),
    "steady.backward_bytes": (-1_283_104, -2.6075),
}

CASES: list[tuple[FrameworkCase, Known | None]] = [
    (FrameworkCase("megatron", "toy", MEGATRON_TOY, "fp32", 2, 128),
     Known(KNOWN_ROWS, FP32_NONE, FP32_NONE_SIZES)),
    (FrameworkCase("megatron", "toy", MEGATRON_TOY, "fp32", 2, 128,
                   options={"recompute": "selective"}),
     Known(KNOWN_ROWS, FP32_SELECTIVE, FP32_SELECTIVE_SIZES)),
    (FrameworkCase("megatron", "toy", MEGATRON_TOY, "fp32", 2, 128,
                   options={"recompute": "full"}),
     Known(KNOWN_ROWS, FP32_FULL, FP32_FULL_SIZES)),
    (FrameworkCase("megatron", "toy", MEGATRON_TOY, "bf16-fp32-grads", 2, 128),
     Known(KNOWN_ROWS, BF16_NONE, BF16_NONE_SIZES)),
    (FrameworkCase("megatron", "toy", MEGATRON_TOY, "bf16-fp32-grads", 2, 128,
                   options={"recompute": "selective"}),
     Known(KNOWN_ROWS, _cause("glu", "small", "step_counters",
                              measured="activations -21.1%, forward -4.1% / -2.6%, "
                              "backward -4.1% / -2.6%; the softmax is recomputed"),
           BF16_SELECTIVE_SIZES)),
    (FrameworkCase("megatron", "toy", MEGATRON_TOY, "bf16-fp32-grads", 2, 128,
                   options={"distributed_optimizer": True}),
     Known(KNOWN_ROWS, "--use-distributed-optimizer on one rank (memplan's zero 1): the "
           "same bytes as the bf16 case (params views of DDP's param buffer, fp32 master "
           "shards of the whole model), and the same causes", BF16_NONE_SIZES)),
]





@pytest.mark.parametrize(("case", "known"), [param(c, k) for c, k in CASES])
def test_megatron_matches_estimate(case: FrameworkCase, known: Known | None) -> None:
    result = compare_megatron(case)
    check(result.rows, known)


def test_states_and_buffers_to_the_byte() -> None:
    """What memplan already gets right for Megatron: the parameters, DDP's gradient buffer
    (fp32 main grads, no padding on one rank with these sizes) and the fp32 master copy plus
    AdamW's moments of the bf16 recipe, to within the fused step counters."""
    case = FrameworkCase("megatron", "toy", MEGATRON_TOY, "bf16-fp32-grads", 2, 128)
    result = compare_megatron(case)
    assert result.row("params_bytes").diff_bytes == 0
    assert result.row("grads_bytes").diff_bytes == 0
    # one step counter fewer per layer: linear_fc1 is one parameter (CAUSES["step_counters"])
    assert result.row("optimizer_bytes").diff_bytes == 4 * MEGATRON_TOY["num_layers"]
