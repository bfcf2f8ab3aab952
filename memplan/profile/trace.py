"""Run real training steps of the reference model under the exact tracker.

``trace(spec, layout, workload)`` builds the reference model (fake tensors on device cpu by
default, so a 7B model traces in seconds without memory), runs ``steps`` training steps with the
precision recipe and optimizer of the workload, and returns measured bytes per category and per
phase for each step: step 1 is the first step (no optimizer states yet), the last step is the
steady state.

Precision recipes are implemented as the frameworks do:
- fp32: fp32 weights, the optimizer updates them.
- bf16-mixed / fp16-mixed: low-precision weights and grads; the optimizer owns fp32 master
  copies; before its step it makes fp32 copies of the grads (Megatron-LM's
  ``_copy_model_grads_to_main_grads``) and after it copies the masters back into the weights.
- bf16-fp32-grads: as above, but every grad is accumulated into an fp32 ``main_grad`` as soon as
  autograd produces it (Megatron-LM's gradient accumulation into main grads).
- bf16-pure: bf16 weights, the optimizer updates them (its states in bf16).
- amp-bf16 / amp-fp16: fp32 weights; forward and loss under autocast as CUDA runs it
  (``memplan.profile.cuda_rules``), as Hugging Face Trainer's ``autocast_smart_context_manager``
  and Lightning's ``MixedPrecision.forward_context`` wrap them; backward outside it (a
  checkpointed region's rerun restores the autocast state it was saved under). amp-fp16 scales
  the loss with ``torch.amp.GradScaler`` and unscales the gradients before the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from memplan.errors import MemplanError, raise_if_interrupted
from memplan.model.optimizer import optimizer_policy
from memplan.parallel import ParallelConfig
from memplan.profile.cuda_rules import autocast_rules
from memplan.profile.reference import ReferenceModel, RefOptions
from memplan.profile.tracker import (CATEGORIES, CompiledTracker, MemoryTracker, PhasePeak,
                                     inductor_buffers_seen)
from memplan.spec import ModelSpec
from memplan.units import PHASES
from memplan.workload import LossImpl, OptimizerImpl, Precision, Recompute, Workload

_TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepMeasure:
    """What one traced step held, in bytes."""

    step: int
    phases: dict[str, PhasePeak]
    saved_activations_bytes: int  # born in forward, alive when backward starts
    grads_bytes: int  # gradients alive when the optimizer step starts
    optimizer_bytes: int  # optimizer states after the step


@dataclass
class TraceResult:
    spec: ModelSpec
    params_bytes: int
    steps: list[StepMeasure] = field(default_factory=list)
    timeline: list = field(default_factory=list)

    @property
    def first(self) -> StepMeasure:
        return self.steps[0]

    @property
    def steady(self) -> StepMeasure:
        return self.steps[-1]


def _optimizer(params: list[torch.Tensor], wl: Workload) -> torch.optim.Optimizer:
    impl, policy = wl.optimizer_impl, optimizer_policy(wl.optimizer)
    if "." in policy.torch_class:  # another library's optimizer (bitsandbytes')
        from memplan.profile.bnb import bnb_optimizer

        return bnb_optimizer(policy.torch_class, params)
    flags = {"foreach": impl is OptimizerImpl.FOREACH}
    if policy.fused_on_cpu:
        flags["fused"] = impl is OptimizerImpl.FUSED
    elif impl is OptimizerImpl.FUSED:
        raise MemplanError(f"optimizer_impl: torch.optim.{policy.torch_class} has no fused CPU "
                           "implementation")
    if policy.torch_class == "Muon+AdamW":
        from memplan.profile.chained import muon_and_adamw

        return muon_and_adamw(params, flags)
    optimizer = getattr(torch.optim, policy.torch_class)
    return optimizer(params, lr=1e-4, **dict(policy.torch_kwargs), **flags)


class _InBackward:
    """torchtune's ``optimizer_in_bwd``: one optimizer per parameter (recipes/
    full_finetune_single_device.py ``_setup_optimizer``), stepped and zeroed in the
    parameter's post-accumulate-grad hook as torchtune/training/memory.py
    ``register_optim_in_bwd_hooks`` registers it (after the recipe's own hook, which labels
    the gradient); its states labelled as the optimizer's once made. ``step`` after backward
    does nothing: there is no gradient left."""

    def __init__(self, params: list[torch.Tensor], wl: Workload,
                 tracker: MemoryTracker) -> None:
        self.optim_dict = {p: _optimizer([p], wl) for p in params}
        self.tracker = tracker
        for opt in self.optim_dict.values():
            # bitsandbytes' constructor makes its quantization maps on the host (the default
            # device); ``init_state`` moves them to an 8-bit state's device, where a state
            # refers to them (counted with the states then): on the CPU here, so uncounted
            # until then
            for qmap in getattr(opt, "name2qmap", {}).values():
                tracker.forget(qmap)

        def optim_step(param: torch.Tensor) -> None:
            self.optim_dict[param].step()
            self.optim_dict[param].zero_grad()
            _label_states(self.optim_dict[param], wl, tracker)

        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(optim_step)

    @property
    def state(self) -> dict:
        return {p: st for opt in self.optim_dict.values() for p, st in opt.state.items()}

    def step(self) -> None:
        pass


class _Recipe:
    """Weights the model computes with, the tensors the optimizer updates, and the glue."""

    def __init__(self, model: torch.nn.Module, precision: Precision,
                 tracker: MemoryTracker, *, keep_grads: bool = False) -> None:
        self.params = [p for p in model.parameters()]
        self.precision = precision
        # zero_grad(set_to_none=False): the gradients stay allocated, zeroed, between steps
        self.keep_grads = keep_grads
        policy = precision.policy
        # autocast on the weights' device: on CUDA its own, on CPU (a trace) CPU autocast,
        # which ``autocast_rules`` makes follow CUDA's lists
        self.device = self.params[0].device.type if self.params else "cpu"
        self.autocast = _TORCH_DTYPE[policy.autocast.value] if policy.autocast else None
        # the scaler's scale and growth tracker are made at its first scale(), in the forward
        self.scaler = torch.amp.GradScaler(self.device) if policy.grad_scaler else None
        self.masters: list[torch.Tensor] | None = None
        self.tracker = tracker
        if precision is Precision.BF16_FP32_GRADS:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._to_main_grad)
        else:
            for p in self.params:
                p.register_post_accumulate_grad_hook(
                    lambda q: tracker.relabel(q.grad, "gradients"))

    def _to_main_grad(self, p: torch.Tensor) -> None:
        main = getattr(p, "main_grad", None)
        if main is None:
            p.main_grad = p.grad.float()
            self.tracker.relabel(p.main_grad, "gradients")
        else:
            main.add_(p.grad)
        p.grad = None

    def updated(self) -> list[torch.Tensor]:
        if self.precision.policy.master is None:  # the optimizer updates the weights
            return self.params
        if self.masters is None:  # created with the optimizer, as frameworks do at setup
            self.masters = []
            for p in self.params:  # each counted as optimizer bytes from the op that made it
                self.masters.append(p.detach().float().requires_grad_())
                self.tracker.relabel(self.masters[-1], "optimizer")
        return self.masters

    def forward(self):
        """The context the forward and the loss run in."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=self.autocast)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the scale; the scaler's own state (an fp32 scale and an int32
        growth tracker, made at its first call) is training state like the optimizer's."""
        if self.scaler is None:
            return loss
        loss = self.scaler.scale(loss)
        for state in (self.scaler._scale, self.scaler._growth_tracker):
            self.tracker.relabel(state, "optimizer")
        return loss

    def unscale(self, opt: torch.optim.Optimizer) -> None:
        """GradScaler.unscale_: the gradients divided by the scale in place, with a found-inf
        flag per device. (GradScaler.step would then read that flag on the host, which fake
        tensors cannot; the step runs unconditionally, as it does when no inf is found.)"""
        if self.scaler is not None:
            self.scaler.unscale_(opt)

    def step(self, opt: torch.optim.Optimizer) -> None:
        """The optimizer step; with a scaler on real tensors through ``GradScaler.step``, which
        skips it when an inf was found (fake tensors have no values to check)."""
        from torch._subclasses.fake_tensor import is_fake  # sees into DTensor shards too

        if self.scaler is not None and not is_fake(self.params[0]):
            self.scaler.step(opt)
        else:
            opt.step()

    def update(self) -> None:
        if self.scaler is not None:
            self.scaler.update()

    def before_step(self) -> None:
        if self.masters is None:
            return
        for p, m in zip(self.params, self.masters):
            m.grad = p.main_grad if self.precision is Precision.BF16_FP32_GRADS else p.grad.float()

    def after_step(self) -> None:
        if self.masters is not None:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)
                    m.grad = None
        for p in self.params:
            if self.keep_grads:
                for grad in (p.grad, getattr(p, "main_grad", None)):
                    if grad is not None:
                        grad.zero_()
                if hasattr(p, "main_grad"):  # the bf16 gradient became the main one
                    p.grad = None
                continue
            p.grad = None
            if hasattr(p, "main_grad"):
                del p.main_grad


def trace(spec: ModelSpec, par: ParallelConfig, wl: Workload, *, steps: int = 2,
          fake: bool = True, timeline: bool = False) -> TraceResult:
    """Trace ``steps`` training steps of the reference model on one process."""
    if par.world_size != 1:
        raise MemplanError("trace: layouts with more than one rank need trace_parallel")
    if wl.precision is Precision.FSDP_BF16:
        raise MemplanError("precision: fsdp-bf16 needs an FSDP layout (zero 3, dp > 1)")
    if spec.moe is not None and fake:
        raise MemplanError("trace: MoE routing depends on the data, which fake tensors do not "
                           "have; trace a small MoE with --real")
    if wl.mtp_layers:  # megatron-core's own MTP is traced (tests/traced/test_megatron_mtp.py)
        raise MemplanError(f"trace: mtp_layers ({wl.mtp_layers}): the reference model has no "
                           "multi-token prediction")
    if wl.compile_loss:
        return _compiled_loss_trace(spec, wl, steps, fake, timeline)
    mode = _fake_mode() if fake else contextlib.nullcontext()
    with mode:
        torch.manual_seed(0)
        opts = ref_options(wl)
        if wl.recompute is Recompute.OPS:  # the policy --emit-policy torch prints
            from memplan.profile.sac_policy import emitted_policy_fns

            opts = dataclasses.replace(opts, policy_fns=emitted_policy_fns(spec, wl))
        model = ReferenceModel(spec, opts)
        return run_steps(model, spec, wl, MemoryTracker(timeline=timeline), steps=steps)


def _compiled_loss_trace(spec: ModelSpec, wl: Workload, steps: int, fake: bool,
                         timeline: bool) -> TraceResult:
    """The reference model with torchtune's compiled chunked loss, on real CPU tensors (a
    fake mode would make Dynamo run the loss eagerly), counted by ``CompiledTracker``;
    compiled afresh (no on-disk cache, whose hit would skip the allocator's rerouting)."""
    if fake:
        raise MemplanError("trace: compile_loss runs Inductor's code, which needs real tensors "
                           "(--real)")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ReferenceModel(spec, ref_options(wl))
    no_cache = (torch._functorch.config.patch(enable_autograd_cache=False),
                torch._inductor.config.patch(fx_graph_cache=False))
    try:
        with no_cache[0], no_cache[1], inductor_buffers_seen():
            return run_steps(model, spec, wl, CompiledTracker(timeline=timeline), steps=steps)
    finally:
        torch._dynamo.reset()


def ref_options(wl: Workload, dtype: torch.dtype | None = None) -> RefOptions:
    """The reference model's options for ``wl``; ``dtype`` overrides the weights' dtype (the
    compute dtype, or the weights' own under autocast)."""
    policy = wl.precision.policy
    own = policy.params if policy.autocast else policy.compute
    return RefOptions(dtype=dtype or _TORCH_DTYPE[own.value],
                      norm_impl=wl.norm_impl, attention=wl.attention,
                      logits_fp32=wl.logits_fp32, recompute=wl.recompute,
                      recompute_layers=wl.recompute_layers,
                      recompute_every=wl.recompute_every, loss_chunks=wl.loss_chunks,
                      torchtune_chunks=wl.loss_impl is LossImpl.TORCHTUNE_CHUNKED,
                      compile_loss=wl.compile_loss)


# A loop's gradient sync per micro-batch: called with whether the micro-batch is the step's
# last, it returns the context its forward and backward run in (``no_sync()``, or a context
# that sets FSDP2's ``set_requires_gradient_sync``)
SyncContext = Callable[[bool], contextlib.AbstractContextManager]


def run_steps(model: torch.nn.Module, spec: ModelSpec, wl: Workload, tracker: MemoryTracker,
              *, steps: int, precision: Precision | None = None, micro_batches: int = 1,
              sync: SyncContext | None = None) -> TraceResult:
    """Run ``steps`` training steps of a built (possibly sharded) model under ``tracker``.
    ``precision`` overrides the workload's recipe (FSDP's own mixed precision runs as fp32).
    ``micro_batches``: forward and backward runs per step, their gradients accumulated;
    ``sync``: the context each runs in (None: the model's own, a sync every micro-batch)."""
    model.train()
    precision = precision or wl.precision
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    rules = (autocast_rules() if precision.policy.autocast and on_cpu
             else contextlib.nullcontext())
    with tracker, rules:
        tracker.register(list(model.parameters()), "parameters")
        recipe = _Recipe(model, precision, tracker, keep_grads=wl.keep_grads)
        opt = (_InBackward(recipe.updated(), wl, tracker) if wl.optimizer_in_backward
               else _optimizer(recipe.updated(), wl))
        tracker.register(recipe.masters or [], "optimizer")
        result = TraceResult(spec=spec, params_bytes=tracker.bytes_in("parameters"))
        for k in range(1, steps + 1):
            raise_if_interrupted()  # Ctrl-C between steps too (memplan.errors)
            result.steps.append(_step(model, opt, recipe, tracker, wl, spec, k,
                                      micro_batches, sync))
    result.timeline = tracker.timeline
    return result


def _micro_batch(model, recipe: _Recipe, tracker: MemoryTracker, wl: Workload,
                 spec: ModelSpec, k: int) -> int:
    """One micro-batch's forward and backward in step ``k``; returns the saved activations
    alive when its backward starts."""
    b, s = wl.micro_batch_size, wl.seq_len
    tracker.set_phase("forward", step=k)
    ids = torch.randint(0, spec.vocab_size, (b, s))
    targets = torch.randint(0, spec.vocab_size, (b, s))
    with recipe.forward():
        loss = model(ids, targets)
    loss = recipe.scale(loss)
    tracker.set_phase("backward")
    saved = tracker.bytes_in("activations")
    loss.backward()
    del loss, ids, targets
    return saved


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def _step(model, opt, recipe: _Recipe, tracker: MemoryTracker, wl: Workload,
          spec: ModelSpec, k: int, micro_batches: int = 1,
          sync: SyncContext | None = None) -> StepMeasure:
    saved = 0
    for i in range(micro_batches):
        last = i == micro_batches - 1
        with sync(last) if sync is not None else contextlib.nullcontext():
            saved = _micro_batch(model, recipe, tracker, wl, spec, k)
    tracker.set_phase("optimizer")
    grads = tracker.bytes_in("gradients")
    recipe.unscale(opt)
    recipe.before_step()
    recipe.step(opt)
    recipe.after_step()
    recipe.update()
    _label_states(opt, wl, tracker)
    tracker.set_phase("optimizer")
    measure = StepMeasure(
        step=k, phases={ph: tracker.peak(k, ph) for ph in PHASES},
        saved_activations_bytes=saved, grads_bytes=grads,
        optimizer_bytes=tracker.bytes_in("optimizer"))
    return measure


def _label_states(opt, wl: Workload, tracker: MemoryTracker) -> None:
    """Count the optimizer's state tensors as ``optimizer``."""
    for state in opt.state.values():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                # AdamW's per-tensor step counter is a 0-dim host tensor on CUDA for the
                # foreach and for-loop implementations: it never occupies GPU memory.
                if name == "step" and wl.optimizer_impl is not OptimizerImpl.FUSED:
                    tracker.forget(value)
                else:
                    tracker.relabel(value, "optimizer")


__all__ = ["CATEGORIES", "StepMeasure", "SyncContext", "TraceResult", "ref_options", "run_steps",
           "trace"]
