"""Precision recipes as policies of dtypes: the bytes each copy takes, by hand."""

from __future__ import annotations

import pytest

import memplan
from memplan.errors import MemplanError
from memplan.model.optimizer import optimizer_policy
from memplan.overheads import no_overheads
from memplan.units import DType
from memplan.workload import Optimizer, Precision

# (weights, gradients, master, AdamW states) bytes per parameter of each recipe
TABLE = {
    Precision.BF16_MIXED: (2, 2, 4, 8),
    Precision.BF16_FP32_GRADS: (2, 4, 4, 8),
    Precision.FP16_MIXED: (2, 2, 4, 8),
    Precision.FP32: (4, 4, 0, 8),
    Precision.FSDP_BF16: (4, 4, 0, 8),
    Precision.BF16_PURE: (2, 2, 0, 4),
    Precision.AMP_BF16: (4, 4, 0, 8),
    Precision.AMP_FP16: (4, 4, 0, 8),
}


@pytest.mark.parametrize("precision", list(Precision))
def test_policy_bytes(precision: Precision) -> None:
    """AdamW's two states are in the dtype of what it updates: fp32 with a master copy or fp32
    weights, bf16 for bf16-pure (torch.optim's zeros_like(param))."""
    policy = precision.policy
    assert (policy.param_bytes, policy.grad_bytes, policy.master_bytes,
            optimizer_policy(Optimizer.ADAMW).state_bytes_per_param(policy)) == TABLE[precision]
    assert (optimizer_policy(Optimizer.SGD).state_bytes_per_param(policy)
            == TABLE[precision][3] // 2)


def test_bf16_pure_states_by_hand() -> None:
    """tiny (108,864 parameters) on one GPU: weights and gradients 2 B each, AdamW moments
    2 * 2 B, no master; the foreach step's temporary one bf16 copy of the parameters. bf16-mixed
    beside it: 4 B master + 8 B fp32 moments, and the step's fp32 temporary plus the fp32 copy
    of the bf16 gradients the master copy is updated from (8 B)."""
    est = memplan.estimate("tiny", gpus=1, precision="bf16-pure", seq_len=64,
                           overheads=no_overheads())
    s = est.worst
    n = 108_864
    assert (s.params_bytes, s.grads_bytes, s.optimizer_bytes) == (2 * n, 2 * n, 4 * n)
    assert s.optimizer_temp_bytes == 2 * n
    mixed = memplan.estimate("tiny", gpus=1, precision="bf16-mixed", seq_len=64,
                             overheads=no_overheads()).worst
    assert mixed.optimizer_bytes == 12 * n and mixed.optimizer_temp_bytes == 8 * n
    # the activations are the same recipe's: bf16 compute either way
    assert s.activations_bytes == mixed.activations_bytes


def test_bf16_pure_sharded_by_zero() -> None:
    """llama-2-7b (6,738,415,616 parameters: 32 layers of 4 h^2 attention + 3 h f SwiGLU + 2 h
    norms = 202,383,360 with h 4096, f 11008, two 32000 x 4096 embeddings = 262,144,000 and
    the final norm 4096), ZeRO-1 over 8 GPUs: the bf16 moments of 1/8 of the parameters,
    6,738,415,616 / 8 = 842,301,952 (exact), 2 x 2 B each = 3,369,207,808 B; bf16 weights
    unsharded, 2 x 6,738,415,616 = 13,476,831,232 B."""
    est = memplan.estimate("llama-2-7b", gpus=8, zero=1, precision="bf16-pure")
    s = est.worst
    assert s.num_params == 32 * 202_383_360 + 2 * 131_072_000 + 4096 == 6_738_415_616
    assert s.optimizer_bytes == 4 * 842_301_952 == 3_369_207_808
    assert s.params_bytes == 13_476_831_232


def test_bf16_pure_with_offload_is_refused() -> None:
    with pytest.raises(MemplanError, match="offload optimizer with precision bf16-pure"):
        memplan.estimate("llama-2-7b", gpus=8, zero=1, precision="bf16-pure",
                         offload="optimizer")


def test_compute_dtype() -> None:
    assert Precision.FSDP_BF16.policy.compute is DType.BF16
    assert Precision.FSDP_BF16.policy.updated is DType.FP32
    assert Precision.BF16_PURE.policy.updated is DType.BF16


# tiny: 2 layers, h 64, 4 heads / 2 KV heads of 16 (q 64, kv 32), f 176, V 128
H, Q, KV, F, V = 64, 64, 32, 176, 128


def _amp_layer_bytes(t: int) -> int:
    """One tiny layer under autocast (flash attention, upcast RMSNorm), T tokens, by hand:
    each norm saves its fp32 input (the stream), an fp32 rstd per token, the fp32 normed
    tensor, and its consumers' bf16 casts of its output (q, k, v: 3; gate, up: 2); attention
    saves bf16 q, k, v as SDPA reads them, its output, an fp32 logsumexp per head and token
    and the bf16 casts of its 4 weights; the MLP its 4 intermediates and 3 weight casts."""
    norms = 2 * (t * H * 4 + t * 4 + t * H * 4) + (3 + 2) * t * H * 2
    attention = t * (Q + 2 * KV + Q) * 2 + 4 * t * 4 + (H * Q + 2 * H * KV + Q * H) * 2
    mlp = 4 * t * F * 2 + 3 * H * F * 2
    return norms + attention + mlp


def test_amp_saved_activations_by_hand() -> None:
    """tiny at b 2, s 128 under amp-bf16: two layers, fp32 RoPE tables (2*s*d*4), the ids,
    and the head: the final norm (input, rstd, normed, one cast), the head weight's bf16 cast,
    the fp32 log-softmax, the targets and two fp32 loss scalars. 2,298,888 B is also what the
    reference model saves traced under CUDA's autocast rules (tests/traced)."""
    t = 2 * 128
    head = (t * H * 4 + t * 4 + t * H * 4 + t * H * 2 + V * H * 2 + t * V * 4 + t * 8 + 2 * 4)
    expected = 2 * _amp_layer_bytes(t) + 2 * 128 * 16 * 4 + t * 8 + head
    assert expected == 2_298_888
    for precision in ("amp-bf16", "amp-fp16"):
        s = memplan.estimate("tiny", gpus=1, precision=precision, seq_len=128,
                             micro_batch_size=2, overheads=no_overheads()).worst
        assert s.activations_bytes == expected


def test_amp_states_by_hand() -> None:
    """fp32 weights, gradients and AdamW moments (4 + 4 + 8 B per parameter), no master copy,
    the foreach step's fp32 temporary; amp-fp16 adds GradScaler's fp32 scale and int32
    growth tracker (8 B) and, at the step, its fp32 found-inf flag (4 B)."""
    n = 108_864
    bf16 = memplan.estimate("tiny", gpus=1, precision="amp-bf16", seq_len=64,
                            overheads=no_overheads()).worst
    assert (bf16.params_bytes, bf16.grads_bytes, bf16.optimizer_bytes) == (4 * n, 4 * n, 8 * n)
    assert bf16.optimizer_temp_bytes == 4 * n
    fp16 = memplan.estimate("tiny", gpus=1, precision="amp-fp16", seq_len=64,
                            overheads=no_overheads()).worst
    assert fp16.optimizer_bytes == 8 * n + 8
    assert fp16.optimizer_temp_bytes == 4 * n + 4
    fused = memplan.estimate("tiny", gpus=1, precision="amp-fp16", seq_len=64,
                             optimizer_impl="fused", overheads=no_overheads()).worst
    # fused: no parameter-sized temporary; unscale_'s two fp64 scalars are the step's largest
    assert fused.optimizer_temp_bytes == 16


def test_amp_full_recompute_holds_the_weight_casts_through_forward() -> None:
    """With every layer checkpointed nothing is saved but each layer's input (fp32), yet
    autocast's cache keeps every weight cast until the forward ends: the forward peak is
    above the same run's with the casts left out by exactly the casts of the layers before
    the head (2 x layer weights x 2 B)."""
    from memplan.api import make_layout, make_workload
    from memplan.model.dims import Dims
    from memplan.model.layer import layer_kind
    from memplan.spec import load_model
    from memplan.workload import Recompute

    spec = load_model("tiny")
    wl = make_workload(spec, precision="amp-bf16", seq_len=128, micro_batch_size=2,
                       recompute="full")
    kind = layer_kind(spec, wl, Dims.of(spec, make_layout(1), wl), False, Recompute.FULL)
    assert kind.saved_bytes == 2 * 128 * H * 4
    assert kind.cached_bytes == (H * Q + 2 * H * KV + Q * H + 3 * H * F) * 2


@pytest.mark.parametrize(("field", "value", "message"), [
    ("offload", "optimizer", "offload optimizer with precision amp-bf16"),
])
def test_amp_refusals(field: str, value: str, message: str) -> None:
    with pytest.raises(MemplanError, match=message):
        memplan.estimate("llama-2-7b", gpus=8, zero=1, precision="amp-bf16", **{field: value})


def test_amp_with_moe_is_refused() -> None:
    with pytest.raises(MemplanError, match="precision amp-fp16 with MoE layers"):
        memplan.estimate("mixtral-8x7b", gpus=8, precision="amp-fp16")


def test_amp_gathers_fp32_weights_under_fsdp() -> None:
    """FSDP2 without a MixedPrecisionPolicy gathers the fp32 weights; autocast casts them
    after. llama-2-7b: the root (embedding 131,072,000 + final norm and head 131,076,096) and
    two blocks of 202,383,360 gathered, in fp32 (4 B) where fsdp-bf16 gathers bf16 (2 B); the
    unsharded fp32 gradient of a block is the same for both."""
    amp = memplan.estimate("llama-2-7b", gpus=8, zero=3, precision="amp-bf16").worst
    fsdp = memplan.estimate("llama-2-7b", gpus=8, zero=3, precision="fsdp-bf16").worst
    gathered = 131_072_000 + 131_076_096 + 2 * 202_383_360
    block_grad = 202_383_360 * 4
    assert amp.sharding_buffers_bytes == gathered * 4 + block_grad
    assert fsdp.sharding_buffers_bytes == gathered * 2 + block_grad
    assert Precision.AMP_BF16.policy.unsharded is DType.FP32
    assert Precision.FSDP_BF16.policy.unsharded is DType.BF16
