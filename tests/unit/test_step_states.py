"""The optimizer step's own bytes and ZeRO-2's reduce bucket, through ``memplan.estimate``.

Each expected number is derived by hand below from the ``tiny`` spec
(model_specs/models/tiny.toml: L=2, h=64, f=176, a=4 heads and g=2 KV heads of d=16, V=128,
RMSNorm, SwiGLU, untied), read from the per-stage record fields ``optimizer_bytes``,
``optimizer_temp_bytes`` and ``sharding_buffers_bytes``, which survive any restructure of the
walk. Before these tests, only the pinned sweep guarded these formulas.

tiny's parameter tensors on one rank (tp=1, pp=1), in the order the model registers them:

    token embedding      V*h       = 8,192
    per layer (x2)       attn_norm h = 64, q h*a*d = 4,096, k h*g*d = 2,048, v 2,048,
                         o 4,096, mlp_norm 64, gate h*f = 11,264, up 11,264, down 11,264
                         = 46,208 in 9 tensors
    final norm           h         = 64
    head (untied)        V*h       = 8,192
    N = 8,192 + 2*46,208 + 64 + 8,192 = 108,864 elements in 1 + 18 + 2 = 21 tensors

N = 2^6 * 3^5 * 7: it divides by 2 and 3, not by 5, so dp=5 shows a floor-vs-ceil error.
"""

from __future__ import annotations

import memplan
import memplan.spec

N = 108_864
NUM_TENSORS = 21


def _stage(**kwargs):
    est = memplan.estimate("tiny", seq_len=64, **kwargs)
    assert len(est.stages) == 1
    return est.stages[0]


# --- (a) fused AdamW's step counters -----------------------------------------------------------

def test_fused_adamw_keeps_one_fp32_step_per_tensor() -> None:
    """bf16-mixed AdamW: 4 B fp32 master + 2 * 4 B fp32 moments per parameter = 12 * N =
    1,306,368 B; fused AdamW (torch.optim, fused=True) keeps each parameter tensor's ``step``
    as an fp32 tensor on the device: 21 tensors * 4 B = 84 B more, 1,306,452 B. foreach and
    for-loop keep ``step`` on the host: 1,306,368 B."""
    assert _stage(optimizer_impl="fused").optimizer_bytes == 1_306_452
    assert _stage(optimizer_impl="foreach").optimizer_bytes == 1_306_368
    assert _stage(optimizer_impl="forloop").optimizer_bytes == 1_306_368


def test_fused_step_counters_are_per_tensor_not_per_shard() -> None:
    """ZeRO-1 over dp=5: the rank updates ceil(108,864 / 5) = 21,773 parameters (21,772.8
    rounded up), 12 B each = 261,276 B; the step counters stay one per tensor of the rank's
    model, 21 * 4 = 84 B, not divided by dp: 261,360 B."""
    assert _stage(gpus=5, zero=1, optimizer_impl="fused").optimizer_bytes == 261_360


def test_sgd_has_no_step_counters() -> None:
    """SGD with momentum (fused): 4 B master + 4 B momentum = 8 * N = 870,912 B, no step."""
    assert _stage(optimizer="sgd", optimizer_impl="fused").optimizer_bytes == 870_912


# --- (b) the for-loop implementation's temporaries ---------------------------------------------

def test_forloop_temporaries_fp32() -> None:
    """fp32, no master copy, so the step updates the fp32 weights themselves.

    torch.optim's ``_single_tensor_adamw`` makes a tensor's two intermediates while the
    previous tensor's denominator is still referenced: prev + 2 * cur elements. Along the
    registration order (module docstring) the largest is at ``up`` after ``gate``, or at
    ``down`` after ``up``: 11,264 + 2 * 11,264 = 33,792 = 3x the largest tensor;
    33,792 * 4 B = 135,168 B. foreach makes one intermediate of every parameter: 4 * N =
    435,456 B; fused none."""
    assert _stage(precision="fp32", optimizer_impl="forloop").optimizer_temp_bytes == 135_168
    assert _stage(precision="fp32", optimizer_impl="foreach").optimizer_temp_bytes == 435_456
    assert _stage(precision="fp32", optimizer_impl="fused").optimizer_temp_bytes == 0


def test_forloop_temporaries_beside_the_fp32_gradient_copy() -> None:
    """bf16-mixed: the step updates the fp32 master copy (135,168 B as in fp32 above) and
    reads fp32 copies of the bf16 gradients, one per updated parameter: 4 * N = 435,456 B;
    570,624 B in all."""
    assert _stage(optimizer_impl="forloop").optimizer_temp_bytes == 570_624


def test_forloop_temporaries_of_a_zero1_shard_round_up() -> None:
    """fp32, ZeRO-1 over dp=5: each tensor's shard is ceil(n / 5): gate, up and down
    ceil(11,264 / 5) = 2,253 (2,252.8), so the largest pair is 2,253 * 3 = 6,759 elements
    (the embedding's and head's ceil(8,192 / 5) = 1,639, 1,639 + 2 * 13 or 13 + 2 * 1,639 =
    3,291 less): 6,759 * 4 B = 27,036 B (a floor would give 27,024)."""
    assert _stage(gpus=5, zero=1, precision="fp32",
                  optimizer_impl="forloop").optimizer_temp_bytes == 27_036


# --- (c) ZeRO-2's reduce bucket ----------------------------------------------------------------

def test_zero2_bucket_holds_the_gradients_this_rank_does_not_own() -> None:
    """bf16-mixed (bf16 gradients, 2 B), ZeRO-2 over dp=2: the bucket never holds more than
    the gradients the rank does not own, N - ceil(N / 2) = 54,432 elements, far below
    DeepSpeed's 5e8-element bucket: 108,864 B. dp=5: N - ceil(N / 5) = 108,864 - 21,773 =
    87,091 elements = 174,182 B (a floor shard would give 87,092 and 174,184 B). ZeRO-1
    holds no bucket (its gradients are the DDP buffers, not sharding buffers): 0."""
    assert _stage(gpus=2, zero=2).sharding_buffers_bytes == 108_864
    assert _stage(gpus=5, zero=2).sharding_buffers_bytes == 174_182
    assert _stage(gpus=2, zero=1).sharding_buffers_bytes == 0


def test_zero2_bucket_is_capped_at_deepspeeds_reduce_bucket_size() -> None:
    """llama-2-7b (6,738,415,616 parameters), ZeRO-2 over dp=2, bf16 gradients: the rank
    does not own ~3.37e9 of them, more than DeepSpeed's default ``reduce_bucket_size`` of
    5e8 elements, so the bucket is 500,000,000 * 2 B = 1,000,000,000 B."""
    est = memplan.estimate("llama-2-7b", gpus=2, zero=2, seq_len=512)
    stage = est.stages[0]
    assert stage.num_params == 6_738_415_616  # the catalog model the cap is applied to
    assert stage.sharding_buffers_bytes == 1_000_000_000


# --- FSDP2 on a stage of four blocks ---------------------------------------------------------

def test_fsdp2_units_of_a_four_block_stage_at_dp3() -> None:
    """tiny with 4 layers (N = 8,192 + 4 * 46,208 + 64 + 8,192 = 201,280), fsdp-bf16 (fp32
    weights and gradients, bf16 gathered copies), ZeRO-3 over dp=3.

    params: ceil(201,280 / 3) = 67,094 (67,093.3) * 4 B = 268,376 B; gradients alike.
    sharding buffers: the root (embedding 8,192 + final norm 64 + head 8,192 = 16,448) and
    two blocks (2 * 46,208) gathered in bf16: (16,448 + 92,416) * 2 = 217,728 B; one unit's
    unsharded fp32 gradients, the largest unit a block: 46,208 * 4 = 184,832 B; 402,560 B.
    """
    spec = memplan.spec.load_model("tiny").model_copy(update={"num_layers": 4})
    stage = memplan.estimate(spec, gpus=3, zero=3, precision="fsdp-bf16", seq_len=64).stages[0]
    assert (stage.params_bytes, stage.grads_bytes) == (268_376, 268_376)
    assert stage.sharding_buffers_bytes == 402_560
