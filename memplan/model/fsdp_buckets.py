"""FSDP units as buckets gathered ahead by a window in elements and gradients reduced through
a queue with a capacity in elements (``FsdpUnits.BUCKETS``): how many units' weights are
gathered at once and how many units' unsharded gradient buckets are alive at once, on one rank.

Found in Megatron-FSDP (Megatron-LM 93ebf8d, megatron/core/distributed/fsdp/src/megatron_fsdp/;
megatron-core 0.16.1 the same). Its units are the transformer layers (mcore_fsdp_adapter.py
FullyShardedDataParallel.__init__: fsdp_unit_modules = [TransformerLayer,
MoETransformerLayer, MambaLayer] for every strategy but no_shard):

- ``megatron_fsdp.py MegatronFSDP._init_fsdp_param_and_grad_buffer``: without
  ``--suggested-communication-unit-size`` the unit size is twice the mean elements of a
  transformer layer on the rank under ``optim_grads_params``, raised to at least 1e9
  elements (``max(1_000_000_000, ...)``); the reduce-scatter queue holds that many elements
  (``suggested_RS_queue_capacity``) and the all-gather prefetches half of it
  (``suggested_AG_prefetch_size``).
- ``param_and_grad_buffer.py AllGatherPipeline.all_gather_params``: before a unit's forward
  (backward) the unit is gathered with the next (previous) buckets while the prefetched
  elements are under the prefetch size; each unit is released after its forward
  (``_post_forward``) and after its backward (``_post_backward_release_module``); the other
  modules' weights are gathered at their forward and never released during the step.
- ``GradReducePipeline.reduce_gradients``: after a unit's backward its gradients are copied
  into a new whole bucket (``_grad_acc``, ``fetch_bucket`` through a
  ``TemporaryBucketAllocator``), reduce-scattered and added into the persistent gradient shard;
  the bucket is freed only when the queue of reduced buckets exceeds its capacity
  (``wait_for_previous_grad_reduce``: pop while the queued elements exceed it), the rest at
  ``finish_grad_sync``.

Both are counted in units of the stage's largest layer (bounded by the stage's layers).
"""

from __future__ import annotations

from memplan.units import ceil_div

# Megatron-FSDP's floor on the communication unit size, in elements (megatron_fsdp.py
# _init_fsdp_param_and_grad_buffer: max(1_000_000_000, suggested_communication_unit_size))
UNIT_SIZE_FLOOR = 1_000_000_000


def communication_unit(layers: tuple[int, ...]) -> int:
    """Elements of the communication unit: twice the mean layer (the rank's elements of its
    layers, integer division as Megatron-FSDP's), at least ``UNIT_SIZE_FLOOR``."""
    if not layers:
        return UNIT_SIZE_FLOOR
    return max(UNIT_SIZE_FLOOR, sum(layers) // len(layers) * 2)


def gathered_units(layers: tuple[int, ...]) -> int:
    """Units gathered at once at most (the unit running and those prefetched with it): a unit
    is added while the prefetched elements are under half the communication unit, so
    ceil(half / layer) units follow the running one, at most the stage's other layers."""
    layer = max(layers, default=0)
    if not layer:
        return 0
    ahead = ceil_div(communication_unit(layers) // 2, layer)
    return 1 + min(ahead, len(layers) - 1)


def queued_units(layers: tuple[int, ...]) -> int:
    """Units' gradient buckets alive at once at most: the queue is cut to at most the
    communication unit (floor(unit / layer) buckets) before a reduced bucket joins it, and the
    next unit's bucket is made before the next cut: two more, at most the stage's layers."""
    layer = max(layers, default=0)
    if not layer:
        return 0
    return min(len(layers), communication_unit(layers) // layer + 2)
