"""Gradient accumulation that syncs only at the last micro-batch (``grad_sync="last"``): the
bytes each data-parallel mechanism holds, derived by hand (``memplan.model.grad_sync``)."""

from __future__ import annotations

import pytest

import memplan
from memplan.errors import LayoutError
from memplan.model.embedding import EmbeddingBlock
from memplan.model.grad_sync import accumulated_gradients, new_grads_beside
from memplan.model.head import HeadBlock
from memplan.model.layer import LayerKind, LayerMoment
from memplan.model.model_states import StageParams, StateBytes
from memplan.model.sharding import DataParallel
from memplan.model.walk import Walk
from memplan.workload import Workload

# A layer that saves 100 B and, in its backward, holds all it saved and 10 B of gradients in
# flight; two of them, each with 50 B of unsharded accumulated gradients.
KIND = LayerKind(terms=(), saved_bytes=100, forward_peak_bytes=120,
                 moments=(LayerMoment("m", 100, 10, ()),))
WALK = Walk(runs=[(KIND, 50, (0,), 2)], other_bytes=0, rest_saved=0, head=HeadBlock(),
            embedding=EmbeddingBlock(), sharding=DataParallel(in_block=40, in_first_block=40))
STATES = StateBytes(params_bytes=0, grads_bytes=25, optimizer_bytes=0, master_bytes=0,
                    num_optimizer_params=0)

# memplan's test model "tiny" (model_specs/models/tiny.toml): 108,864 parameters
TINY_PARAMS = 108_864


def test_accumulated_gradients_by_hand() -> None:
    """Accumulators ``accum`` = 2 x 50 = 100 B; 40 B of weights gathered beside each block's
    backward; 30 B of new gradients beside the accumulators in a later backward; a 50 B
    reduce-scatter input in the last one.

      first micro-batch   start 200 saved; the first layer walked: 200 + 10 in flight + 40
                          gathered = 250; the second: 100 saved + 50 made + 10 + 40 = 200
      later micro-batch   the accumulators under every moment: 250 + 100 = 350, plus the 30 B
                          of new gradients: 380
      at a reduce         100 accumulators + 50 input + 40 gathered + one layer's 100 saved
                          = 290
    Backward 380 in step 1 and the steady state; forward 100 (the accumulators). Keeping the
    25 B of sharded gradients (zero_grad(set_to_none=False)) adds 25 from step 2."""
    assert accumulated_gradients(WALK, STATES, 100, 30, 50, False) == (100, 380, 100, 380)
    assert accumulated_gradients(WALK, STATES, 100, 30, 50, True) == (100, 380, 125, 405)
    # a reduce-scatter input larger than the new gradients: 100 + 200 + 40 + 100 = 440
    assert accumulated_gradients(WALK, STATES, 100, 30, 200, False)[1] == 440


def test_new_gradients_beside_the_accumulators() -> None:
    """fsdp-bf16 (bf16 weights, fp32 reduce): blocks of 1,000 and 1,200 parameters, a head
    (final norm + output) of 500; the largest block's and the root's head made in bf16 beside
    the fp32 accumulators: (1,200 + 500) x 2 = 3,400 B; with the head a unit of its own
    (torchtitan's units, reduced after its own backward) 1,200 x 2 = 2,400. Weights and
    reduce in one dtype (fp32, bf16-pure): each new gradient is added into .grad in place: 0."""
    params = StageParams(dense=2_700, expert=0, layers=(1_000, 1_200), embedding=0, head=500,
                         tensor_sizes=(), largest_unit=1_200, num_tensors=0)
    fsdp = Workload(precision="fsdp-bf16")
    assert new_grads_beside(params, fsdp, separate_units=False) == 3_400
    assert new_grads_beside(params, fsdp, separate_units=True) == 2_400
    assert new_grads_beside(params, Workload(precision="fp32"), separate_units=False) == 0
    assert new_grads_beside(params, Workload(precision="bf16-pure"), separate_units=False) == 0


def _stage(**kwargs: object):
    return memplan.estimate("tiny", gpus=2, seq_len=64, **kwargs).stages[0]


def test_fsdp2_forward_holds_the_unsharded_accumulators() -> None:
    """tiny on 2 ranks, FSDP2 with fsdp-bf16, 4 micro-batches (gbs 8, mbs 1). Syncing every
    micro-batch, the later forwards hold the sharded fp32 gradients: ceil(108,864 / 2) x 4 =
    217,728 B. Syncing at the last only, they hold every parameter's unsharded fp32
    accumulator instead: 108,864 x 4 = 435,456 B, 217,728 more, in the first step and the
    steady state (nothing else in the forward changes: the weights are gathered and resharded
    as before). The stage's held (sharded) gradients are the same."""
    kw = dict(zero=3, precision="fsdp-bf16", micro_batch_size=1, global_batch_size=8)
    every, last = _stage(**kw), _stage(grad_sync="last", **kw)
    assert last.grads_bytes == every.grads_bytes == 217_728
    assert last.steady.forward - every.steady.forward == TINY_PARAMS * 4 - 217_728
    assert last.first_step.forward - every.first_step.forward == TINY_PARAMS * 4 - 217_728
    assert last.steady.backward > every.steady.backward


def test_fsdp2_one_micro_batch_syncs_at_it() -> None:
    """One micro-batch per step (gbs = mbs x dp): its backward is the last, it syncs: the
    same bytes as "every"."""
    kw = dict(zero=3, precision="fsdp-bf16", micro_batch_size=1, global_batch_size=2)
    assert _stage(grad_sync="last", **kw) == _stage(**kw)


@pytest.mark.parametrize("zero", [0, 1])
def test_ddp_no_sync_and_zero1_hold_the_same_bytes(zero: int) -> None:
    """DDP under no_sync(): the reducer's hooks are off (no prepare_for_backward), gradients
    accumulate into param.grad as with a sync and the buckets stay as allocated; ZeRO-1's
    gradients are unsharded in every micro-batch anyway. 4 micro-batches: every byte equal."""
    kw = dict(zero=zero, micro_batch_size=1, global_batch_size=8)
    assert _stage(grad_sync="last", **kw) == _stage(**kw)


def test_zero2_with_last_is_refused() -> None:
    """DeepSpeed's no_sync() asserts unpartitioned gradients: zero 2 with last is refused."""
    with pytest.raises(LayoutError, match="grad_sync last"):
        _stage(zero=2, grad_sync="last", micro_batch_size=1, global_batch_size=8)
