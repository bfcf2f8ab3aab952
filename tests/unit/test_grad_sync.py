"""Gradient accumulation that syncs only at the last micro-batch (``grad_sync="last"``): the
bytes each data-parallel mechanism holds, derived by hand (``memplan.model.grad_sync``)."""

from __future__ import annotations

from fractions import Fraction

import pytest

import memplan
from memplan.errors import LayoutError
from memplan.model.embedding import EmbeddingBlock
from memplan.model.grad_sync import accumulated_gradients, new_grads, with_new_grads
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
    backward; in the last micro-batch a 50 B reduce-scatter input and a 25 B output shard.

      first micro-batch   start 200 saved; the first layer walked: 200 + 10 in flight + 40
                          gathered = 250; the second: 100 saved + 50 made + 10 + 40 = 200
      later micro-batch   the accumulators under every moment: 250 + 100 = 350
      first reduce        100 accumulators + 50 input + 40 gathered + the other layer's 100
                          saved = 290
      second layer        100 accumulators + 25 output shard + 40 gathered + its own 110
                          (100 alive + 10 in flight) = 275
    Backward 350 in step 1 and the steady state; forward 100 (the accumulators). Keeping the
    25 B of sharded gradients (zero_grad(set_to_none=False)) adds 25 from step 2."""
    assert accumulated_gradients(WALK, STATES, 100, (50, 25, 0), False) == (100, 350, 100, 350)
    assert accumulated_gradients(WALK, STATES, 100, (50, 25, 0), True) == (100, 350, 125, 375)
    # a 400 B reduce-scatter input (200 B shard): first reduce 100 + 400 + 40 + 100 = 640;
    # second layer 100 + 200 + 40 + 110 = 450
    assert accumulated_gradients(WALK, STATES, 100, (400, 200, 0), False)[1] == 640
    # a 150 B shard of a 100 B input only (an impossible 2/3 shard, to reach the second
    # layer's moment): 100 + 150 + 40 + 110 = 400 > 290
    assert accumulated_gradients(WALK, STATES, 100, (100, 150, 0), False)[1] == 400


def test_new_gradients_beside_the_accumulators() -> None:
    """fsdp-bf16 (bf16 weights, fp32 reduce): a head (final norm + output) of 500 parameters;
    new bf16 gradients are 2 / 4 = 0.5 B per accumulator byte, and the root's head made at
    the head's backward, held beside every block: 500 x 2 = 1,000 B; with the head a unit of
    its own (torchtitan's units, reduced after its own backward) 0. Weights and reduce in one
    dtype (fp32: 4 B, bf16-pure: 2 B): autograd adds each new gradient into ``.grad`` in place,
    the weight's gradient a moment just made in flight, its parameters x 4 or 2 B."""
    params = StageParams(dense=2_700, expert=0, layers=(1_000, 1_200), embedding=0, head=500,
                         tensor_sizes=(), largest_unit=1_200, num_tensors=0)
    fsdp = Workload(precision="fsdp-bf16")
    assert new_grads(params, fsdp, separate_units=False) == (0.5, 1_000, 0)
    assert new_grads(params, fsdp, separate_units=True) == (0.5, 0, 0)
    assert new_grads(params, Workload(precision="fp32"), separate_units=False) == (0.0, 0, 4)
    assert new_grads(params, Workload(precision="bf16-pure"), separate_units=False) == (0.0, 0, 2)


def test_new_gradients_at_each_moment() -> None:
    """A layer with two moments: 10 B in flight with 0 accumulator bytes made, then 10 B with
    40 made, its second moment just made a 6-parameter weight's gradient. Mixed dtypes (ratio
    0.5): 10 + 0 and 10 + 20 in flight. One dtype (4 B per fresh parameter): 10 and 10 + 24."""
    kind = LayerKind(terms=(), saved_bytes=100, forward_peak_bytes=120,
                     moments=(LayerMoment("a", 100, 10, ()),
                              LayerMoment("b", 100, 10, (), fresh_params=6)))
    walk = WALK._replace(runs=[(kind, 50, (0, 40), 2)])
    mixed = with_new_grads(walk, 0.5, 0).runs[0][0].moments
    same = with_new_grads(walk, 0.0, 4).runs[0][0].moments
    assert [m.transient_bytes for m in mixed] == [10, 30]
    assert [m.transient_bytes for m in same] == [10, 34]
    assert with_new_grads(walk, 0.0, 0) is walk


def test_new_gradient_bytes_are_exact() -> None:
    """The new gradients' share is an exact ratio of itemsizes (fsdp-bf16: 2 / 4), so a
    moment's bytes are whole without float rounding: 2^54 + 2 accumulator bytes make
    2^53 + 1 new ones (a float 0.5 would read 2^54 + 2 as 2^54 and give 2^53)."""
    params = StageParams(dense=0, expert=0, layers=(), embedding=0, head=0, tensor_sizes=(),
                         largest_unit=0, num_tensors=0)
    ratio = new_grads(params, Workload(precision="fsdp-bf16"), separate_units=True)[0]
    assert ratio == Fraction(1, 2)
    kind = LayerKind(terms=(), saved_bytes=0, forward_peak_bytes=0,
                     moments=(LayerMoment("a", 0, 0, ()),))
    walk = WALK._replace(runs=[(kind, 0, (2**54 + 2,), 1)])
    assert with_new_grads(walk, ratio).runs[0][0].moments[0].transient_bytes == 2**53 + 1


def _stage(**kwargs: object):
    return memplan.estimate("tiny", gpus=2, seq_len=64, **kwargs).stages[0]


def test_fsdp2_forward_holds_the_unsharded_accumulators() -> None:
    """tiny on 2 ranks, FSDP2 with fsdp-bf16, 4 micro-batches (gbs 8, mbs 1). Syncing every
    micro-batch, the later forwards hold the sharded fp32 gradients: ceil(108,864 / 2) x 4 =
    217,728 B. Syncing at the last only, they hold every parameter's unsharded fp32
    accumulator instead: 108,864 x 4 = 435,456 B, 217,728 more, in the first step and the
    steady state (nothing else in the forward changes: the weights are gathered and resharded
    as before). The stage's held (sharded) gradients are the same; its gradient and gather
    buffers show the 435,456 B of accumulators."""
    kw = dict(zero=3, precision="fsdp-bf16", micro_batch_size=1, global_batch_size=8)
    every, last = _stage(**kw), _stage(grad_sync="last", **kw)
    assert last.grads_bytes == every.grads_bytes == 217_728
    assert last.steady.forward - every.steady.forward == TINY_PARAMS * 4 - 217_728
    assert last.first_step.forward - every.first_step.forward == TINY_PARAMS * 4 - 217_728
    assert last.steady.backward > every.steady.backward
    # the accumulators are shown with the sharding buffers
    assert last.sharding_buffers_bytes - every.sharding_buffers_bytes == TINY_PARAMS * 4


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


def test_torchtitan_under_pp_already_syncs_at_the_last() -> None:
    """torchtitan under pipeline parallelism: torch's pipeline stage runs every micro-batch's
    backward without a sync (``backward_maybe_with_nosync``), which the estimate models on its
    own (``ShardingBuffers.kept_gathered``): "last" changes no byte of it."""
    kw = dict(gpus=4, pp=2, zero=3, framework="torchtitan", precision="fsdp-bf16",
              micro_batch_size=1, global_batch_size=8)
    every = memplan.estimate("tiny", seq_len=64, **kw)
    last = memplan.estimate("tiny", seq_len=64, grad_sync="last", **kw)
    assert last.stages == every.stages
