"""The optimizer and trainable-parameter policies (``memplan.model.optimizer``,
``memplan.model.trainable``), and the states read through them, by hand."""

from __future__ import annotations

from memplan.model.model_states import StageParams, optimizer_step_temp_bytes, state_bytes
from memplan.model.optimizer import POLICIES, StepTemps, optimizer_policy
from memplan.model.trainable import ALL, ParamGroup, Trained, TrainablePolicy
from memplan.parallel import ParallelConfig, ZeroStage
from memplan.workload import Optimizer, OptimizerImpl, Precision, Workload

# One stage holding everything: an embedding of 100 (one tensor), a layer of 500 + 300 and
# the final norm (10) and head (90): 1,000 dense parameters in 5 tensors.
PARAMS = StageParams(dense=1000, expert=0, layers=(800,), embedding=100, head=100,
                     tensor_sizes=(100, 500, 300, 10, 90), largest_unit=800, num_tensors=5,
                     embedding_tensors=1, head_tensors=2)
ADAMW, SGD = optimizer_policy(Optimizer.ADAMW), optimizer_policy(Optimizer.SGD)


def test_every_optimizer_has_a_policy() -> None:
    assert set(POLICIES) == set(Optimizer)


def test_states_per_parameter() -> None:
    """AdamW's two moments in the updated dtype: 8 B with an fp32 master copy (bf16-mixed), 4 B
    updating bf16 weights directly (bf16-pure); SGD's one momentum buffer 4 B and 2 B. On the
    host an offloaded optimizer keeps fp32 states: 8 B and 4 B."""
    mixed, pure = Precision.BF16_MIXED.policy, Precision.BF16_PURE.policy
    assert (ADAMW.state_bytes_per_param(mixed), ADAMW.state_bytes_per_param(pure)) == (8, 4)
    assert (SGD.state_bytes_per_param(mixed), SGD.state_bytes_per_param(pure)) == (4, 2)
    assert (ADAMW.host_state_bytes_per_param(), SGD.host_state_bytes_per_param()) == (8, 4)


def test_step_temporaries_per_implementation() -> None:
    """Tensors of 10, 30 and 20 elements, 60 in all. foreach: one copy of all, 60. for-loop:
    a tensor's two intermediates beside the previous one's denominator: 2*10 = 20, 10 + 2*30
    = 70, 30 + 2*20 = 70: 70. fused: none, and 3 fp32 step counts (12 B). SGD: none."""
    sizes = (10, 30, 20)
    assert ADAMW.step(OptimizerImpl.FOREACH).elements(60, sizes) == 60
    assert ADAMW.step(OptimizerImpl.FORLOOP).elements(60, sizes) == 70
    assert ADAMW.step(OptimizerImpl.FUSED).elements(60, sizes) == 0
    assert ADAMW.step_counter_bytes(OptimizerImpl.FUSED, 3) == 12
    assert ADAMW.step_counter_bytes(OptimizerImpl.FOREACH, 3) == 0
    assert all(SGD.step(impl) == StepTemps() for impl in OptimizerImpl)


def test_fused_adamw_states_by_hand() -> None:
    """bf16-mixed, fused AdamW, one rank: weights 1,000 * 2 = 2,000 B, gradients 2,000 B;
    optimizer 1,000 * (4 master + 8 moments) = 12,000 B plus 5 step counts of 4 B: 12,020."""
    st = state_bytes(PARAMS, ParallelConfig(),
                     Workload(precision=Precision.BF16_MIXED, optimizer_impl=OptimizerImpl.FUSED))
    assert (st.params_bytes, st.grads_bytes, st.optimizer_bytes) == (2000, 2000, 12020)


def test_forloop_step_under_zero_by_hand() -> None:
    """bf16-mixed for-loop AdamW under ZeRO-1 at dp 2: tensors sharded to 50, 250, 150, 5, 45;
    the largest pair 50 + 2*250 = 550 (also 250 + 2*150 = 550) fp32 elements: 2,200 B, plus
    the fp32 copy of the 500 bf16 gradients of the shard: 2,000 B. 4,200 in all."""
    par = ParallelConfig(dp=2, zero=ZeroStage.OPTIMIZER)
    wl = Workload(precision=Precision.BF16_MIXED, optimizer_impl=OptimizerImpl.FORLOOP)
    st = state_bytes(PARAMS, par, wl)
    assert st.num_optimizer_params == 500
    assert optimizer_step_temp_bytes(PARAMS, st, par, wl) == 4200


def test_trainable_groups() -> None:
    """Every group trains by default; freezing the layers leaves the embedding (100) and the
    head (10 + 90); freezing the embedding and the head leaves the layer's 800."""
    assert ALL.trained(PARAMS) == Trained(1000, 0, (100, 500, 300, 10, 90))
    layers = TrainablePolicy(frozenset({ParamGroup.LAYERS}))
    assert layers.trained(PARAMS) == Trained(200, 0, (100, 10, 90))
    ends = TrainablePolicy(frozenset({ParamGroup.EMBEDDING, ParamGroup.HEAD}))
    assert ends.trained(PARAMS) == Trained(800, 0, (500, 300))


def test_frozen_layers_hold_no_gradients_or_states() -> None:
    """bf16-mixed foreach AdamW with the layers frozen: weights all 1,000 (2,000 B); gradients
    of the 200 trained (400 B); master and moments of those 200 (2,400 B); the foreach
    intermediate over 200 fp32 elements (800 B) and the fp32 gradient copy (800 B)."""
    frozen = TrainablePolicy(frozenset({ParamGroup.LAYERS}))
    wl = Workload(precision=Precision.BF16_MIXED)
    st = state_bytes(PARAMS, ParallelConfig(), wl, frozen)
    assert (st.params_bytes, st.grads_bytes, st.optimizer_bytes) == (2000, 400, 2400)
    assert optimizer_step_temp_bytes(PARAMS, st, ParallelConfig(), wl, frozen) == 1600
