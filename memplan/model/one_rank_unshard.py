"""FSDP2's unshard of a unit at shard degree 1 with a cast to the compute dtype: the instant
a block's gather reaches in forward, on one rank, in bytes.

torch 2.13's ``FSDPParamGroup.wait_for_unshard`` (torch/distributed/fsdp/_fully_shard/
_fsdp_param_group.py), ``world_size == 1`` branch, fills each parameter's unsharded storage
from its shard directly, in the unit's registration order::

    for fsdp_param in self.fsdp_params:
        all_gather_input = fsdp_param.all_gather_inputs[0]
        fsdp_param.init_all_gather_outputs(...); alloc_storage(tensor)
        tensor.copy_(all_gather_input)

``FSDPParam.all_gather_inputs`` (_fsdp_param.py) is ``_to_dtype_if_needed(sharded_param_data,
param_dtype)``: with ``MixedPrecisionPolicy.param_dtype`` below the shard's dtype a new
tensor, the parameter's cast, as large as its unsharded storage; with the same dtype the
shard itself (nothing made). The loop variable keeps the previous parameter's cast bound
until the next cast exists, and the last one until the function returns. So the instant at
parameter i holds the unsharded storages of the parameters before it, the previous cast and
its own; the end holds them all and the last cast. Traced: torchtitan's Qwen3 MoE toy at
256 experts (tests/traced/test_frameworks.py), the forward's peak at the second block's
gather, at the router gate's cast: the block's unsharded bytes but the gate's and the
norms', w3's cast and the gate's, 12,747,392 + 4,193,792 B.

With a flat all-gather (shard degree above 1) the casts are the copy-in's, counted by
``memplan.model.model_states`` (``forward_start_bytes``); under autocast FSDP2 gathers the
weights' own dtype (``PrecisionPolicy.unsharded``) and casts nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from memplan.model import moe_titan
from memplan.model.layer import layer_blocks
from memplan.model.norm import Norm, StreamInput
from memplan.model.model_states import separate_units
from memplan.model.moe import MoE
from memplan.parallel import ExpertSplit, ParallelConfig
from memplan.spec import ModelSpec
from memplan.workload import MoeImpl, Workload


def gather_peak(sizes: Sequence[int], itemsize: int) -> int:
    """The most bytes alive during one unit's unshard at shard degree 1 with each parameter
    cast (module docstring): ``sizes`` the elements of its tensors in registration order,
    ``itemsize`` the bytes of the compute dtype (of an unsharded element and of a cast one).
    At least the unit's unsharded bytes (the end, the last cast beside them)."""
    made = prev = peak = 0
    for n in sizes:
        peak = max(peak, made + prev + n)  # its cast beside the previous cast, before the copy
        made, prev = made + n, n
    return max(peak, made + prev) * itemsize


def unit_tensor_sizes(spec: ModelSpec, t: int, split: ExpertSplit, moe_layer: bool,
                      titan_moe: bool) -> list[int]:
    """Elements of a decoder block's tensors on one rank in torchtitan's registration order
    (models/llama3/model.py, models/qwen3/model.py ``TransformerBlock.__init__``: attention,
    then the feed-forward or the MoE, then ``attention_norm`` and ``ffn_norm``), each
    mixer's own in memplan's order (``tensor_shapes``) but torchtitan's MoE block's
    (``titan_moe``: ``moe_titan.unit_tensor_sizes``)."""
    blocks = layer_blocks(spec, moe_layer)
    norms = [b for b in blocks if isinstance(b, (Norm, StreamInput))]
    sizes: list[int] = []
    for block in blocks:
        if isinstance(block, MoE) and titan_moe:
            sizes += moe_titan.unit_tensor_sizes(spec, t, split.ep, split.etp)
        elif block not in norms:
            sizes += [math.prod(s) for s in block.tensor_shapes(spec, t, split)]
    return sizes + [math.prod(s) for b in norms for s in b.tensor_shapes(spec, t, split)]


def one_rank_gather_bytes(spec: ModelSpec, par: ParallelConfig, wl: Workload,
                          layers: Sequence[int]) -> int:
    """The largest of the stage's blocks' gathers (``gather_peak``) where torchtitan's units
    are unsharded at shard degree 1 with a cast (FSDP2's ``param_dtype`` below the weights'
    dtype), else 0 (not modelled: a flat all-gather, no cast, FSDP2's float8 all-gather,
    whose ``fsdp_pre_all_gather`` casts otherwise)."""
    policy = wl.precision.policy
    if (not separate_units(wl) or par.dense_shard_degree != 1 or wl.float8_all_gather
            or policy.unsharded == policy.params):
        return 0
    titan = wl.moe_impl is MoeImpl.TITAN
    kinds = {spec.is_moe_layer(i) for i in layers}
    return max((gather_peak(unit_tensor_sizes(spec, par.tp, par.experts, moe, titan),
                            policy.unsharded.itemsize) for moe in kinds), default=0)
