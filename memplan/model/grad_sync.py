"""Gradient accumulation without a reduce on every micro-batch (``Workload.grad_sync`` "last"):
what a loop that syncs gradients only in the last micro-batch's backward holds, for one rank
of one stage, in bytes.

What each data-parallel mechanism does when it is not told to sync (torch 2.13):

- FSDP2 (``FSDPModule.set_requires_gradient_sync(False)``): a unit's ``post_backward``
  (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py ``FSDPParamGroup.post_backward``,
  ``if not self.reduce_grads``) reshards the weights as usual but skips the reduce-scatter:
  each parameter keeps its *unsharded* gradient, converted to the reduce dtype where it
  differs from the weights' (``FSDPParam.to_accumulated_grad_if_needed``, _fsdp_param.py:
  ``unsharded_accumulated_grad = unsharded_grad.to(reduce_dtype)``); the next micro-batch's
  new gradient, made in the weights' dtype, is added into it at the unit's post_backward
  (``accumulate_unsharded_grad_if_needed``). Those accumulators (every parameter of the stage,
  unsharded across data parallelism, ``params/TP x reduce-dtype bytes``) live from the first
  micro-batch's backward until the last micro-batch's reduce-scatter of each unit, where
  ``foreach_reduce`` copies them into its input and drops them. No sharded gradient exists
  before that reduce.
- DDP (``no_sync()``, torch/nn/parallel/distributed.py): ``_post_forward`` calls
  ``reducer.prepare_for_backward`` only while ``require_backward_grad_sync``, so the reducer's
  autograd hooks do nothing; gradients accumulate into ``param.grad`` as with a sync, and the
  flat buckets (allocated at the wrap) are left as they are: the same bytes as "every".
- ZeRO-1: gradients are unsharded in every micro-batch anyway: the same bytes as "every".
- ZeRO-2 (DeepSpeed's partitioned gradients): refused in ``memplan.parallel.validate``.

So only FSDP2 (not under pipeline parallelism, where torch's pipeline stage already runs
this way: ``memplan.model.model_states.ShardingBuffers.kept_gathered``) changes, and only
with more than one micro-batch per step.
"""

from __future__ import annotations

from fractions import Fraction

from memplan.model.dims import exact_ratio
from memplan.model.model_states import StageParams, StateBytes
from memplan.model.sharding import DataParallel
from memplan.model.walk import Walk, backward_peak
from memplan.workload import GradSync, Workload


def accumulates_unsharded(wl: Workload, dp: DataParallel, kept_gathered: bool, m: int) -> bool:
    """FSDP2 units that keep unsharded accumulated gradients across this step's ``m``
    micro-batches (``grad_sync`` last, more than one micro-batch, not already kept so by the
    pipeline stage)."""
    return wl.grad_sync is GradSync.LAST and dp.per_unit and not kept_gathered and m > 1


def accumulator_bytes(params: StageParams, wl: Workload, flat: bool = False) -> int:
    """FSDP2's unsharded gradient accumulators on one rank of a stage: every parameter of
    the stage (``params``, unsharded across data parallelism) in the reduce dtype, as this
    module's docstring and ``ShardingBuffers.kept_gathered`` describe. FSDP1's are each
    unit's flat gradient in the dtype autograd makes it in, the gathered weights'
    (``flat``: ``memplan.model.fsdp1``)."""
    if flat:
        return params.total * wl.precision.policy.unsharded.itemsize
    return params.total * wl.precision.policy.grad_bytes


def unsynced(dp: DataParallel, root_new: int = 0) -> DataParallel:
    """FSDP2's mechanism in a micro-batch whose gradients are plain unsharded accumulators:
    the weights gathered and resharded as with a sync, no gradient waiting unsharded beside
    its shard and no reduce-scatter input held (the accumulators are the walk's gradients).
    Beside every block's and the embedding's backward, the root's new gradients
    (``root_new``: ``new_grads``)."""
    return DataParallel(flat=dp.flat, at_reduce=dp.at_reduce + root_new,
                        in_block=dp.in_block + root_new,
                        in_first_block=dp.in_first_block + root_new,
                        at_head=dp.at_head, head_prefetch=dp.head_prefetch,
                        head_regather=dp.head_regather,
                        at_embedding=dp.at_embedding + root_new,
                        in_block_forward=dp.in_block_forward,
                        at_loss_forward=dp.at_loss_forward, block_start=dp.block_start,
                        first_block_start=dp.first_block_start)


def new_grads(params: StageParams, wl: Workload, separate_units: bool,
              flat: bool = False) -> tuple[int | Fraction, int, int]:
    """How a later micro-batch's new gradients sit beside FSDP2's accumulators: (their bytes
    per accumulator byte made, at each of a block's moments; the root's, held through the
    backward; bytes per parameter of a weight whose gradient a moment just made), in bytes;
    the first an exact ratio of itemsizes, so bytes made from it are whole without rounding.

    With a reduce dtype other than the weights' (``to_accumulated_grad_if_needed`` moved the
    accumulator off ``.grad``) autograd makes a new ``.grad`` in the weights' dtype that the
    unit's post_backward adds in and drops: a block's exist during its own backward; with the
    root unit (embedding, final norm and head in one unit, whose post_backward runs after the
    embedding's backward) the head's and the final norm's are made at the head's backward and
    held to the end. In one dtype autograd adds each new gradient into ``.grad`` in place
    (``AccumulateGrad``): the weight's new gradient a moment just made
    (``LayerMoment.fresh_params``) in flight."""
    policy = wl.precision.policy
    e = policy.unsharded.itemsize
    if flat:
        # FSDP1: the views' new gradients (one per parameter) wait for the flat gradient
        # that autograd's split backward concatenates them into once the unit's backward is
        # done (``memplan.model.sharding``, ``flat``): in the accumulators' dtype; the root's
        # head and final norm's from the head's backward to the end
        return 1, params.head * e, 0
    if e == policy.grad_bytes:
        return 0, 0, e
    return exact_ratio(e, policy.grad_bytes), (0 if separate_units else params.head * e), 0


def with_new_grads(walk: Walk, ratio: int | Fraction, fresh: int = 0) -> Walk:
    """``walk`` with each block's new gradients in flight at each of its moments: ``ratio`` x
    the accumulator bytes its moments made by then (whole bytes, rounded down), and
    ``fresh`` bytes per parameter of the weight whose gradient the moment just made."""
    if not (ratio or fresh):
        return walk
    runs = [(kind._replace(moments=tuple(
                m._replace(transient_bytes=m.transient_bytes + int(g * ratio)
                           + m.fresh_params * fresh)
                for m, g in zip(kind.moments, grads))), layer, grads, n)
            for kind, layer, grads, n in walk.runs]
    return walk._replace(runs=runs)


def accumulated_gradients(walk: Walk, st: StateBytes, accum: int,
                          reduce: tuple[int, int, int],
                          keep_grads: bool) -> tuple[int, int, int, int]:
    """Gradient bytes alive through the forward and the backward's tensor peak, in step 1 and
    in the steady state (``memplan.model.stage._gradients``'s tuple), when the walk's
    gradients are the stage's unsharded accumulators (``accum`` bytes, all of them made by
    the first micro-batch's backward) and its mechanism is ``unsynced``.

    From the second micro-batch on the accumulators exist through forward and backward. The
    last micro-batch reduce-scatters each unit after its backward (``_sync_moments``).
    ``keep_grads``: the sharded gradients the reduce makes stay allocated from step 2;
    ``reduce``: (the bytes made beside the accumulators at a unit's reduce, its output shard,
    the accumulator bytes the reduce itself drops), ``memplan.model.fsdp1.last_reduce``."""
    first = backward_peak(walk, 0, accum)
    later = backward_peak(walk, accum, accum)
    bwd = max(first, later, *_sync_moments(walk, accum, *reduce))
    kept = st.grads_bytes if keep_grads else 0
    return accum, bwd, accum + kept, bwd + kept


def _sync_moments(walk: Walk, accum: int, reduce_input: int,
                  output_shard: int, freed: int = 0) -> tuple[int, ...]:
    """The last micro-batch's reduce-scatters, at the first blocks walked, where the most
    activations are alive (``foreach_reduce``, _fsdp_collectives.py): at the first block's,
    its weights resharded, the accumulators (its own copied from, not yet dropped) beside the
    reduce-scatter input (``reduce_input``: the largest unit's, in the reduce dtype), the
    root's weights and the block prefetched, and every other block's saved activations; at
    the next block's backward, that input has replaced the block's accumulator and its
    output shard (``output_shard``) is made, beside the next block's own peak."""
    dp, kinds = walk.sharding, [kind for kind, _, _, n in reversed(walk.runs)
                                for _ in range(min(n, 2))]
    if not kinds:
        return ()
    # the logits the loop keeps from the loss (``HeadBlock.backward_held``) too
    held = walk.rest_saved + walk.other_bytes + walk.head.backward_held() + sum(
        k.saved_bytes * n for k, _, _, n in walk.runs)
    rest = held - kinds[0].saved_bytes
    # after the first block's reshard: the root and the block its backward prefetched
    # (FSDP1: ``at_reduce``, the root alone without a backward prefetch)
    moments = [accum + reduce_input + (dp.at_reduce if dp.flat else dp.in_first_block) + rest]
    if len(kinds) > 1:
        local = max(m.alive_bytes + m.transient_bytes for m in kinds[1].moments)
        layers = sum(n for _, _, _, n in walk.runs)
        gathered = dp.in_first_block if layers == 2 else dp.in_block
        moments.append(accum - freed + output_shard + gathered + rest - kinds[1].saved_bytes
                       + local)
    return tuple(moments)


__all__ = ["accumulated_gradients", "accumulates_unsharded", "accumulator_bytes", "new_grads",
           "unsynced", "with_new_grads"]
