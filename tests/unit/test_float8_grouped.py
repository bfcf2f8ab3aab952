"""torchao's float8 grouped GEMM for routed experts (``memplan.model.float8_grouped``), with
bytes derived by hand from torchao 0.18's ``prototype/moe_training/fp8_grouped_mm.py``
(``_Float8GroupedMM``) and the shapes its kernels' ``register_fake`` functions give:

- forward, at ``_scaled_grouped_mm``: ``A`` (M x K) cast to float8 with (M, 1) fp32 scales,
  ``B_t`` (E x K x N) cast with (E, 1, N) fp32 scales, both scales' reciprocals;
- backward, at the weight-gradient ``_scaled_grouped_mm``: ``grad_output`` (M x N) in float8
  with (M, 1) scales, ``B_t`` transposed in float8 with (E, K) scales (their reciprocals, call
  arguments, already freed), ``grad_output``'s and ``A``'s column-wise float8 copies with
  G*N and G*K scales (G = E groups) and those two reciprocals.

The same numbers are the traced ones (tests/traced/test_torchao_float8_grouped.py, torchao on CPU).
"""

from __future__ import annotations

from memplan import api
from memplan.model import float8_grouped


def test_forward_bytes_by_hand() -> None:
    """M 256, K 128, N 64, E 4: A's cast 256 * 128 = 32,768 and 256 * 4 scales + 256 * 4
    reciprocals = 2,048; B's cast 4 * 128 * 64 = 32,768 and 4 * 64 * 8 = 2,048: 69,632."""
    assert float8_grouped.forward_bytes(256, 128, 64, 4) == 69_632


def test_backward_bytes_by_hand() -> None:
    """M 256, K 128, N 64, E 4: grad_output's rows 256 * 64 = 16,384 + 1,024 scales; B's
    transposed cast 32,768 + 4 * 128 * 4 = 2,048 scales (52,224); then grad_output's and A's
    columns 256 * (64 + 128) = 49,152 and 4 * (64 + 128) * 8 = 6,144 scales and
    reciprocals (55,296): 107,520."""
    assert float8_grouped.backward_bytes(256, 128, 64, 4) == 107_520


def test_grouped_experts_keep_their_saved_activations() -> None:
    """``_Float8GroupedMM`` saves ``A`` and a view of the weight, as a bf16 ``_grouped_mm``
    does: the saved activations are those of the bf16 run, byte for byte; the backward peak
    is the bf16 one or more (the casts are transients)."""
    kw = dict(gpus=8, zero=3, ep=8, micro_batch_size=1, seq_len=1024, moe_impl="grouped",
              framework="torchtitan", recompute="full")
    plain = api.estimate("mixtral-8x7b", **kw)
    f8 = api.estimate("mixtral-8x7b", float8="rowwise", **kw)
    assert f8.stages[0].activations_bytes == plain.stages[0].activations_bytes
    assert f8.stages[0].steady.backward >= plain.stages[0].steady.backward


def test_down_projection_backward_moment_by_hand() -> None:
    """Mixtral 8x7B (h 4096, expert FFN 14336, top-2 of 8), ep 8 (one local expert), 1,024
    tokens: the down projection's grouped matmul runs over M = 2,048 routed rows, K 14,336,
    N 4,096, E 1. Its weight-gradient instant holds beyond the bf16 run's: grad_output's rows
    2,048 * 4,096 = 8,388,608 + 8,192 scales, the weight's transposed cast 14,336 * 4,096 =
    58,720,256 + 57,344 scales, the column-wise casts 2,048 * 18,432 = 37,748,736 and
    18,432 * 8 = 147,456 scales and reciprocals: 105,070,592 bytes."""
    from memplan.model.dims import Dims
    from memplan.model.moe import MoE

    moments = {}
    for recipe in ("none", "rowwise"):
        est = api.estimate("mixtral-8x7b", gpus=8, zero=3, ep=8, micro_batch_size=1,
                           seq_len=1024, moe_impl="grouped", framework="torchtitan",
                           float8=recipe)
        dm = Dims.of(est.spec, est.parallel, est.workload)
        moments[recipe] = {m.name: m.transient_bytes for m in MoE().backward_moments(
            est.spec, est.workload, dm, est.workload.recompute)}
    assert moments["rowwise"]["mlp"] - moments["none"]["mlp"] == 105_070_592
    assert moments["rowwise"]["mlp_act"] == moments["none"]["mlp_act"]
