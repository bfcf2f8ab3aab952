"""Trace one rank of FSDP1 (``FullyShardedDataParallel``, flat parameters) as Accelerate and the
Trainer wrap a model: every block its own unit (``ModuleWrapPolicy``, as Accelerate's
``transformer_layer_cls_to_wrap`` does for the decoder layer), the root unit holding the
embedding, the final norm and the head.

FSDP1 runs on CPU with ``device_id=torch.device("cpu")`` over torch's fake process group with
real tensors (its ``_init_utils`` reads parameter data, so fake tensors do not work): the
collectives return at once, every tensor has the shape and dtype it has on a real rank.
FSDP1 frees and re-allocates its padded unsharded flat parameter (``_full_param_padded``) and
its low-precision shard (``_mp_shard``) with ``torch.distributed.utils._alloc_storage`` /
``_free_storage`` (``untyped_storage().resize_()``, which no dispatch mode sees); we wrap the
names ``torch/distributed/fsdp/_flat_param.py`` imported so the tracker follows them when they
happen, the gathered flat parameter under ``gathered``.

On CPU there are no streams: ``limit_all_gathers`` (``_limiter_utils._FreeEventQueue``, at most
two all-gathers in flight ahead of the frees) and ``record_stream`` on the reduce-scatter's
input change nothing here, as on a GPU they change when a free becomes reusable, not the
order of allocations and frees the caching allocator sees from the CPU thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from memplan.parallel import ParallelConfig
from memplan.profile.reference import Block, ReferenceModel
from memplan.profile.trace import ref_options
from memplan.profile.tracker import MemoryTracker
from memplan.spec import ModelSpec
from memplan.workload import BackwardPrefetch, Precision, Workload

GATHERED = "gathered"

_PREFETCH = {BackwardPrefetch.PRE: "BACKWARD_PRE", BackwardPrefetch.POST: "BACKWARD_POST",
             BackwardPrefetch.NONE: None}


# FullyShardedDataParallel keyword arguments a trace may set beyond the workload's (a test's
# ``with extra_options(use_orig_params=True)``): knobs the estimate holds the same bytes for
EXTRA: dict = {}


@contextlib.contextmanager
def extra_options(**kwargs) -> Iterator[None]:
    EXTRA.update(kwargs)
    try:
        yield
    finally:
        EXTRA.clear()


def fsdp1_model(spec: ModelSpec, par: ParallelConfig, wl: Workload,
                device: str = "cpu") -> nn.Module:
    """The reference model under ``FullyShardedDataParallel``: fp32 weights with
    ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)`` for ``fsdp-bf16``, bf16 weights
    for ``bf16-pure``, fp32 otherwise; ``FULL_SHARD``, or ``SHARD_GRAD_OP`` where the
    workload does not reshard after forward; ``EXTRA`` keyword arguments on top."""
    from torch.distributed.fsdp import (
        BackwardPrefetch as Prefetch,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    weights = torch.bfloat16 if wl.precision is Precision.BF16_PURE else torch.float32
    model = ReferenceModel(spec, ref_options(wl, weights), device=device)
    model.opts = ref_options(wl)
    mp = (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if wl.precision is Precision.FSDP_BF16 else None)
    strategy = (ShardingStrategy.FULL_SHARD if wl.reshard_after_forward
                else ShardingStrategy.SHARD_GRAD_OP)
    prefetch = _PREFETCH[wl.backward_prefetch]
    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device(device),
        sharding_strategy=strategy, mixed_precision=mp,
        backward_prefetch=Prefetch[prefetch] if prefetch else None,
        forward_prefetch=wl.forward_prefetch, use_orig_params=wl.use_orig_params,
        **{"limit_all_gathers": True, **EXTRA})


@contextlib.contextmanager
def follow_flat_storage(tracker: MemoryTracker) -> Iterator[None]:
    """Make FSDP1's storage resizes visible to the tracker while they happen, and count each
    flat parameter's sharded gradient as a gradient once FSDP1 hands it to the optimizer
    (``FlatParamHandle.prepare_gradient_for_optim``)."""
    from torch.distributed.fsdp import _flat_param

    alloc, free = _flat_param._alloc_storage, _flat_param._free_storage
    prepare = _flat_param.FlatParamHandle.prepare_gradient_for_optim

    def alloc_tracked(tensor: torch.Tensor, size: torch.Size) -> None:
        alloc(tensor, size)
        tracker.relabel(tensor, GATHERED)
        tracker.resync(tensor, "fsdp1._alloc_storage")  # type: ignore[attr-defined]

    def free_tracked(tensor: torch.Tensor) -> None:
        free(tensor)
        tracker.resync(tensor, "fsdp1._free_storage")  # type: ignore[attr-defined]

    def prepare_tracked(handle) -> None:
        prepare(handle)
        if handle.flat_param.grad is not None:
            tracker.relabel(handle.flat_param.grad, "gradients")

    _flat_param._alloc_storage, _flat_param._free_storage = alloc_tracked, free_tracked
    _flat_param.FlatParamHandle.prepare_gradient_for_optim = prepare_tracked
    try:
        yield
    finally:
        _flat_param._alloc_storage, _flat_param._free_storage = alloc, free
        _flat_param.FlatParamHandle.prepare_gradient_for_optim = prepare
