"""Profile the memory of a user's own training step: ``profile_step(model, optimizer, step_fn)``.

``step_fn(model, optimizer, step)`` runs one whole training step (forward, backward, optimizer
step, zero_grad); ``profile_step`` calls it ``steps`` times and returns a
``memplan.timeline.Timeline``. Phases are found without changes to the step:
- ``backward``: an op runs inside autograd's engine (``torch._C._current_autograd_node``);
- ``optimizer``: between the optimizer's step pre- and post-hooks;
- ``other``: after backward, outside the optimizer step (clipping, ``zero_grad``);
- ``forward``: everything before the step's first backward op.
A step function can also label a region itself: ``with memplan.profile.phase("other"):``.

On CPU (or under ``FakeTensorMode``) bytes come from the exact tensor tracker
(``memplan.profile.tracker``): parameters, gradients (accumulated into ``.grad``), optimizer
states (found in ``optimizer.state`` after each step), activations (born in forward) and
temporaries. On CUDA they come from the caching allocator (see ``memplan.profile.cuda_step``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memplan.errors import MemplanError
from memplan.profile.tracker import MemoryTracker
from memplan.timeline import PHASES, Sample, Timeline

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


class StepTracker(MemoryTracker):
    """The exact tracker with phases detected per op, and the ``other`` phase."""

    def __init__(self, detector: PhaseDetector) -> None:
        super().__init__(timeline=True)
        self.detector = detector

    def set_phase(self, phase: str, step: int | None = None) -> None:  # type: ignore[override]
        if step is not None:
            self.step = step
        self.phase = phase
        self._record()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        now = self.detector.current()
        if now != self.phase:
            self.set_phase(now)
        return super().__torch_dispatch__(func, types, args, kwargs)


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
def _hooks(model: torch.nn.Module, opt: torch.optim.Optimizer, det: PhaseDetector,
           tracker: MemoryTracker | None) -> Iterator[None]:
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


def _device_of(model: torch.nn.Module) -> str:
    p = next(model.parameters(), None)
    return "cpu" if p is None else p.device.type


def profile_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step_fn: StepFn,
                 *, steps: int = 3, device: str | None = None,
                 context: dict[str, Any] | None = None) -> Timeline:
    """Run ``step_fn`` ``steps`` times and record one rank's memory timeline by phase.

    ``device``: ``"cpu"`` (exact tensor tracker) or ``"cuda"`` (caching allocator); default:
    the device of the model's parameters. Returns bytes per event; see ``memplan.timeline``.
    """
    if steps < 2:
        raise MemplanError(f"steps ({steps}) must be at least 2: the first step and a later one")
    device = device or _device_of(model)
    if device == "cuda":
        from memplan.profile.cuda_step import profile_cuda

        return profile_cuda(model, optimizer, step_fn, steps=steps, context=context)
    if device != "cpu":
        raise MemplanError(f"device {device!r}: profile runs on cpu or cuda")
    det = PhaseDetector()
    tracker = StepTracker(det)
    model.train()
    with tracker, _hooks(model, optimizer, det, tracker):
        tracker.register(list(model.parameters()), "parameters")
        tracker.register([p.grad for p in model.parameters() if p.grad is not None],
                         "gradients")
        relabel_states(tracker, optimizer)  # states of a resumed optimizer
        for k in range(1, steps + 1):
            det.new_step()
            tracker.set_phase("forward", step=k)
            step_fn(model, optimizer, k)
            tracker._record("step end")
    return from_tracker(tracker, steps, context or {})


TRACKER_SOURCE = ("exact tensor tracker (torch dispatch mode): bytes of live tensor storages "
                  "created by the step plus parameters; no allocator or CUDA context")


def from_tracker(tracker: MemoryTracker, steps: int, context: dict[str, Any]) -> Timeline:
    """The tracker's timeline as torch-free samples."""
    samples = [Sample(index=p.op_index, step=p.step, phase=p.phase, total_bytes=p.total_bytes,
                      by_category=p.by_category, op=p.op) for p in tracker.timeline]
    return Timeline(device="cpu-tracker", source=TRACKER_SOURCE, num_steps=steps,
                    samples=samples, context=context)


__all__ = ["PhaseDetector", "StepTracker", "from_tracker", "phase", "profile_step",
           "relabel_states"]
