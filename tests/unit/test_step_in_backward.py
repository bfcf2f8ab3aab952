"""``--optimizer-in-backward`` (``memplan.model.step_in_backward``): the per-moment gradient
and step bytes, the per-optimizer states, what it refuses, and the tiny model's phases, each
derived by hand from torch.optim's and bitsandbytes' code (``memplan.model.optimizer``'s
cited temporaries)."""

from __future__ import annotations

import pytest

from memplan.api import estimate, make_workload
from memplan.errors import MemplanError
from memplan.model import step_in_backward
from memplan.model.optimizer import optimizer_policy
from memplan.spec import load_model
from memplan.workload import Optimizer, Precision

TINY = load_model("tiny")


def _wl(**kw):
    return make_workload(TINY, seq_len=128, micro_batch_size=2, precision="bf16-pure",
                         optimizer_in_backward=True, **kw)


def test_moment_bytes_foreach_adamw() -> None:
    """bf16 gradient of 1000 elements (2,000 B) and its own foreach AdamW's one intermediate
    list over that tensor alone (1000 x 2 B = 2,000 B): 4,000 B at its moment, 0 elsewhere."""
    assert step_in_backward.moment_grads(_wl(optimizer="adamw"), (0, 1000, 0)) == (0, 4000, 0)


def test_moment_bytes_forloop_adamw() -> None:
    """The for-loop's two intermediates of the tensor (no previous tensor: one optimizer per
    parameter): 2 x 1000 x 2 B = 4,000 B beside the 2,000 B gradient."""
    wl = _wl(optimizer="adamw", optimizer_impl="forloop")
    assert step_in_backward.moment_grads(wl, (1000,)) == (6000,)


def test_moment_bytes_paged_8bit() -> None:
    """PagedAdamW8bit prefetches the tensor's paged uint8 states (200,000 >= 1e5 elements:
    paged), 2 x 200,000 B, beside its bf16 gradient (400,000 B)."""
    wl = _wl(optimizer="paged-adamw8bit")
    assert step_in_backward.moment_grads(wl, (200_000,)) == (800_000,)


def test_one_optimizer_per_tensor_has_its_own_maps() -> None:
    """AdamW8bit on tensors of 4096 and 8192 elements (both 8-bit): per tensor 2 uint8
    states (n B each) and 2 fp32 absmax per 256 elements; per optimizer that has an 8-bit
    state the two maps (2 x 256 x 4 = 2,048 B). One optimizer: 8192 + 128 + 16384 + 256 +
    2048 = 27,008 B; one per tensor: 10,368 + 18,688 = 29,056 B, none before the first step."""
    opt = optimizer_policy(Optimizer.ADAMW8BIT)
    shapes = ((4096,), (8192,))
    policy = Precision.BF16_PURE.policy
    assert opt.states(policy, 12288, shapes).device_bytes == 27_008
    per = step_in_backward.states(opt, policy, 12288, shapes)
    assert (per.device_bytes, per.setup_bytes) == (29_056, 0)


def test_tiny_holds_no_gradients_and_no_step_phase() -> None:
    """Tiny (108,864 parameters) in bf16 with AdamW: weights 217,728 B, states 2 x 2 B per
    parameter = 435,456 B, no gradient after backward, and the phase after it holds the
    weights and states alone: 653,184 B (the trace measures the same)."""
    rec = estimate(TINY, gpus=1, seq_len=128, micro_batch_size=2, precision="bf16-pure",
                   optimizer="adamw", optimizer_in_backward=True).worst
    assert (rec.params_bytes, rec.grads_bytes, rec.optimizer_bytes) == (217_728, 0, 435_456)
    assert rec.steady.optimizer == 653_184


@pytest.mark.parametrize(("kw", "says"), [
    ({"global_batch_size": 4}, "2 micro-batches per step"),
    ({"gpus": 2}, "dp 2"),
    ({"lora_rank": 8}, "lora_rank 8"),
    ({"optimizer": "adafactor"}, "optimizer adafactor"),
    ({"precision": "bf16-mixed"}, "precision bf16-mixed"),
])
def test_refused_where_not_modelled(kw: dict, says: str) -> None:
    """torchtune refuses gradient accumulation with it; the rest is not modelled."""
    args = {"gpus": 1, "seq_len": 128, "micro_batch_size": 2, "precision": "bf16-pure",
            "optimizer_in_backward": True, **kw}
    with pytest.raises(MemplanError, match=says):
        estimate(TINY, **args)


def test_plan_searches_one_micro_batch_per_step() -> None:
    """``plan`` with the step in backward on one GPU and a global batch of 4: only the layout
    without ZeRO (dp 1, zero 1-3 refused) at micro-batch 4 (4 x 1 = 4: one micro-batch per
    step; 1 and 2 would accumulate)."""
    from memplan.api import plan

    result = plan(TINY, gpus=1, seq_len=128, global_batch_size=4, precision="bf16-pure",
                  optimizer_in_backward=True)
    assert result.candidates
    assert {(int(c.layout.zero), c.micro_batch_size) for c in result.candidates} == {(0, 4)}
