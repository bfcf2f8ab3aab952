"""The optimizer step run inside backward, one parameter at a time (``Workload.
optimizer_in_backward``).

torchtune's ``optimizer_in_bwd: True`` (recipes/full_finetune_single_device.py
``_setup_optimizer``) builds one optimizer per parameter (``{p: config.instantiate(
cfg_optimizer, [p]) for p in model.parameters()}``) and registers, on every parameter that
requires a gradient, a hook that steps its optimizer and zeroes its gradient
(torchtune/training/memory.py ``register_optim_in_bwd_hooks``: ``optim_step(param)`` ->
``optim_dict[param].step(); optim_dict[param].zero_grad()``, through
``Tensor.register_post_accumulate_grad_hook``). PyTorch runs such a hook right after the
parameter's ``AccumulateGrad`` node has written ``.grad`` (torch/_tensor.py
``register_post_accumulate_grad_hook``), and ``zero_grad`` sets it to None (``set_to_none=
True``, torch/optim/optimizer.py ``Optimizer.zero_grad``). So:

- a weight's gradient exists at the backward moment that makes it, beside its own
  optimizer's step temporaries (the implementation's, over that one tensor), and is freed
  before the next node runs: gradients never accumulate over the backward (the walk's held
  gradients are 0, its moments hold the fresh gradient alone, as ``DataParallel.fresh_only``);
- there is no step after backward: the last gradient made (the embedding's) is stepped when
  every activation is gone, beside the weights and states alone, the largest such moment
  being the largest tensor's gradient and its step temporaries (the "optimizer" phase);
- a tied weight's ``AccumulateGrad`` runs once, after both uses' gradients are summed in its
  input buffer: the head's part waits until the embedding's backward (``HeadBlock.tied_grad``).

The recipe refuses ``gradient_accumulation_steps > 1`` and ``clip_grad_norm`` with it (both
need every gradient at once); memplan also refuses what it does not model with it (data
parallelism, pipeline stages, LoRA, shape-dependent optimizers, weights or states on the
host, a grad scaler or a master copy: ``memplan.parallel.optimizer_in_backward_rule``).
"""

from __future__ import annotations

import math

from memplan.model.optimizer import OptimizerPolicy, Shapes, States, optimizer_policy
from memplan.workload import PrecisionPolicy, Workload


def step_temp_bytes(wl: Workload, numel: int) -> int:
    """The step temporaries of one parameter's own optimizer over its ``numel`` elements
    (``OptimizerPolicy.temp_bytes`` with that tensor alone: a foreach list of one tensor, a
    for-loop over it, bitsandbytes' prefetched pages of it)."""
    if not numel:
        return 0
    policy = wl.precision.policy
    return optimizer_policy(wl.optimizer).temp_bytes(wl.optimizer_impl, numel, ((numel,),),
                                                     policy.updated.itemsize)


def moment_grads(wl: Workload, fresh: tuple[int, ...]) -> tuple[int, ...]:
    """Bytes of gradients and step temporaries at each backward moment of a layer (``fresh``:
    the elements of the weight whose gradient was just made there, 0 where none was): that
    gradient, in the gradients' dtype, and its optimizer's temporaries."""
    grad_bytes = wl.precision.policy.grad_bytes
    return tuple(n * grad_bytes + step_temp_bytes(wl, n) for n in fresh)


def last_step_bytes(wl: Workload, tensor_sizes: tuple[int, ...]) -> int:
    """The largest one-parameter step beside the weights and states alone: its gradient and
    its temporaries (the embedding's, stepped after the backward's last node, is one of
    these; an upper bound on the others, stepped beside activations the walk counts)."""
    grad_bytes = wl.precision.policy.grad_bytes
    return max((n * grad_bytes + step_temp_bytes(wl, n) for n in tensor_sizes), default=0)


def states(optimizer: OptimizerPolicy, policy: PrecisionPolicy, num_params: int,
           shapes: Shapes) -> States:
    """The states of one optimizer per tensor (``shapes``, read by a per-tensor optimizer;
    the others' states are per element): bitsandbytes' quantization maps are one set per
    optimizer that has an 8-bit state (``Optimizer8bit.init_state`` moves its
    ``name2qmap``, made on the host by its constructor, to the parameter's device), so one
    set per such tensor, made at its first step."""
    if not optimizer.shaped:
        return optimizer.states(policy, num_params, ())
    parts = [optimizer.states(policy, math.prod(s), (s,)) for s in shapes]
    # the maps reach the device with the states, at each tensor's first step: none before
    return States(sum(p.device_bytes for p in parts), sum(p.paged_bytes for p in parts))


def refusal(micro_batches: int) -> tuple[str, str] | None:
    """Why ``optimizer_in_backward`` is refused at ``micro_batches`` per step (what, why), or
    None; the layout's and workload's rules: ``memplan.parallel.optimizer_in_backward_rule``."""
    if micro_batches > 1:
        return (f"{micro_batches} micro-batches per step", "gradient accumulation needs every "
                "gradient at once (torchtune refuses gradient_accumulation_steps > 1)")
    return None
