"""Which phase of a user's training step an op belongs to, found without changes to the step.

Shared by the CPU tracker (``memplan.profile.step``) and the CUDA sampler
(``memplan.profile.cuda_step``):
- ``backward``: an op runs inside autograd's engine (``torch._C._current_autograd_node``);
- ``optimizer``: between the optimizer's step pre- and post-hooks;
- ``other``: after backward, outside the optimizer step (clipping, ``zero_grad``);
- ``forward``: everything before the step's first backward op.
A step function can also label a region itself: ``with memplan.profile.phase("other"):``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memplan.errors import MemplanError
from memplan.measure.timeline import PHASES
from memplan.profile.tracker import MemoryTracker

StepFn = Callable[[torch.nn.Module, torch.optim.Optimizer, int], Any]

_ACTIVE: list[PhaseDetector] = []


class PhaseDetector:
    """Which phase the current op belongs to, from autograd, optimizer hooks or a label."""

    def __init__(self) -> None:
        self.label: str | None = None
        self.in_optimizer = False
        self.backward_seen = False

    def new_step(self) -> None:
        self.label, self.in_optimizer, self.backward_seen = None, False, False

    def current(self) -> str:
        if self.label is not None:
            return self.label
        if torch._C._current_autograd_node() is not None:
            self.backward_seen = True
            return "backward"
        if self.in_optimizer:
            return "optimizer"
        return "other" if self.backward_seen else "forward"


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label the ops inside as phase ``name`` (no effect outside ``profile_step``)."""
    if name not in PHASES:
        raise MemplanError(f"phase {name!r} must be one of {', '.join(PHASES)}")
    det = _ACTIVE[-1] if _ACTIVE else None
    if det is None:
        yield
        return
    before, det.label = det.label, name
    try:
        yield
    finally:
        det.label = before
        if name == "backward":
            det.backward_seen = True


def _is_fused(opt: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    return any(g.get("fused") and any(q is p for q in g["params"]) for g in opt.param_groups)


def relabel_states(tracker: MemoryTracker, opt: torch.optim.Optimizer) -> None:
    """Count the optimizer's state tensors as ``optimizer``. Adam's 0-dim ``step`` counter
    lives on the host on CUDA unless the implementation is fused, so it is not counted."""
    for p, state in opt.state.items():
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if name == "step" and value.dim() == 0 and not _is_fused(opt, p):
                tracker.forget(value)
            else:
                tracker.relabel(value, "optimizer")


@contextlib.contextmanager
def phase_hooks(opt: torch.optim.Optimizer, det: PhaseDetector,
                tracker: MemoryTracker | None) -> Iterator[None]:
    """While inside: ``det`` sees the optimizer step, ``phase()`` labels go to ``det``, and,
    with a ``tracker``, accumulated gradients and the optimizer's states are relabelled."""
    def pre(*_: Any) -> None:
        det.in_optimizer = True

    def post(*_: Any) -> None:
        if tracker is not None:
            relabel_states(tracker, opt)
        det.in_optimizer = False

    handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
    if tracker is not None:
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        handles += [p.register_post_accumulate_grad_hook(
            lambda q: tracker.relabel(q.grad, "gradients")) for p in params]
    _ACTIVE.append(det)
    try:
        yield
    finally:
        _ACTIVE.remove(det)
        for h in handles:
            h.remove()


__all__ = ["PhaseDetector", "StepFn", "phase", "phase_hooks", "relabel_states"]
