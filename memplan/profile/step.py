"""Profile the memory of a user's own training step: ``profile_step(model, optimizer, step_fn)``.

``step_fn(model, optimizer, step)`` runs one whole training step (forward, backward, optimizer
step, zero_grad); ``profile_step`` calls it ``steps`` times and returns a
``memplan.measure.timeline.Timeline``. Phases are found without changes to the step
(``memplan.profile.phases``); a step function can also label a region itself:
``with memplan.profile.phase("other"):``.

On CPU (or under ``FakeTensorMode``) bytes come from the exact tensor tracker
(``memplan.profile.tracker``): parameters, gradients (accumulated into ``.grad``), optimizer
states (found in ``optimizer.state`` after each step), activations (born in forward) and
temporaries. On CUDA they come from the caching allocator (see ``memplan.profile.cuda_step``).
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.errors import MemplanError, raise_if_interrupted
from memplan.measure.timeline import Sample, Timeline
from memplan.profile.cuda_step import profile_cuda
from memplan.profile.phases import PhaseDetector, StepFn, phase, phase_hooks, relabel_states
from memplan.profile.tracker import MemoryTracker


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


def _device_of(model: torch.nn.Module) -> str:
    p = next(model.parameters(), None)
    return "cpu" if p is None else p.device.type


def profile_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step_fn: StepFn,
                 *, steps: int = 3, device: str | None = None,
                 context: dict[str, Any] | None = None) -> Timeline:
    """Run ``step_fn`` ``steps`` times and record one rank's memory timeline by phase.

    ``device``: ``"cpu"`` (exact tensor tracker) or ``"cuda"`` (caching allocator); default:
    the device of the model's parameters. Returns bytes per event; see ``memplan.measure.timeline``.
    """
    if steps < 2:
        raise MemplanError(f"steps ({steps}) must be at least 2: the first step and a later one")
    device = device or _device_of(model)
    if device == "cuda":
        return profile_cuda(model, optimizer, step_fn, steps=steps, context=context)
    if device != "cpu":
        raise MemplanError(f"device {device!r}: profile runs on cpu or cuda")
    det = PhaseDetector()
    tracker = StepTracker(det)
    model.train()
    with tracker, phase_hooks(optimizer, det, tracker):
        tracker.register(list(model.parameters()), "parameters")
        tracker.register([p.grad for p in model.parameters() if p.grad is not None],
                         "gradients")
        relabel_states(tracker, optimizer)  # states of a resumed optimizer
        for k in range(1, steps + 1):
            raise_if_interrupted()  # Ctrl-C between steps (memplan.errors)
            det.new_step()
            tracker.set_phase("forward", step=k)
            step_fn(model, optimizer, k)
            tracker._record("step end")
    return from_tracker(tracker, steps, context or {})


TRACKER_SOURCE = ("exact tensor tracker (torch dispatch mode): bytes of live tensor storages "
                  "created by the step plus parameters; no allocator or CUDA context")


def from_tracker(tracker: MemoryTracker, steps: int, context: dict[str, Any]) -> Timeline:
    """The tracker's timeline as torch-free samples."""
    t0 = tracker.timeline[0].time_s if tracker.timeline else 0.0
    samples = [Sample(index=p.op_index, step=p.step, phase=p.phase, total_bytes=p.total_bytes,
                      by_category=p.by_category, op=p.op, time_s=p.time_s - t0)
               for p in tracker.timeline]
    return Timeline(device="cpu-tracker", source=TRACKER_SOURCE, num_steps=steps,
                    samples=samples, context=context)


# PhaseDetector, StepFn, phase and relabel_states live in memplan.profile.phases (shared with
# the CUDA sampler); they stay importable from here.
__all__ = ["PhaseDetector", "StepFn", "StepTracker", "from_tracker", "phase", "profile_step",
           "relabel_states"]
