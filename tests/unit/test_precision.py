"""Precision recipes as policies of dtypes: the bytes each copy takes, by hand."""

from __future__ import annotations

import pytest

import memplan
from memplan.errors import MemplanError
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
}


@pytest.mark.parametrize("precision", list(Precision))
def test_policy_bytes(precision: Precision) -> None:
    """AdamW's two states are in the dtype of what it updates: fp32 with a master copy or fp32
    weights, bf16 for bf16-pure (torch.optim's zeros_like(param))."""
    policy = precision.policy
    assert (policy.param_bytes, policy.grad_bytes, policy.master_bytes,
            Optimizer.ADAMW.state_bytes_per_param(policy)) == TABLE[precision]
    assert Optimizer.SGD.state_bytes_per_param(policy) == TABLE[precision][3] // 2


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
    """llama-2-7b, ZeRO-1 over 8 GPUs: the moments of 1/8 of the parameters, in bf16."""
    est = memplan.estimate("llama-2-7b", gpus=8, zero=1, precision="bf16-pure")
    s = est.worst
    assert s.optimizer_bytes == 4 * -(-s.num_params // 8)
    assert s.params_bytes == 2 * s.num_params


def test_bf16_pure_with_offload_is_refused() -> None:
    with pytest.raises(MemplanError, match="offload optimizer with precision bf16-pure"):
        memplan.estimate("llama-2-7b", gpus=8, zero=1, precision="bf16-pure",
                         offload="optimizer")


def test_compute_dtype() -> None:
    assert Precision.FSDP_BF16.policy.compute is DType.BF16
    assert Precision.FSDP_BF16.policy.updated is DType.FP32
    assert Precision.BF16_PURE.policy.updated is DType.BF16
