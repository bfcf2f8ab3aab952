"""``memplan profile``'s default workload: the reference model's steps, and what was predicted.

On CPU the steps run through ``memplan.profile.trace.run_steps`` (the same phases as
``memplan trace``), so step 1's per-phase peaks are the tracker's and line up with the
estimate's first-step phases. On CUDA the same precision recipe runs as a ``step_fn`` under
``profile_cuda``; ``reference_step`` gives that step for timing with ``profile_perf`` too.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from memplan.errors import MemplanError
from memplan.hardware import GpuSpec
from memplan.measure.timeline import Timeline
from memplan.model.estimate import PHASES, estimate
from memplan.overheads import default_overheads, no_overheads
from memplan.parallel import ParallelConfig
from memplan.profile.reference import ReferenceModel
from memplan.profile.step import StepFn, from_tracker
from memplan.profile.trace import _fake_mode, _optimizer, _Recipe, ref_options, run_steps
from memplan.profile.tracker import MemoryTracker
from memplan.spec import ModelSpec
from memplan.workload import Workload


def predicted(spec: ModelSpec, gpu: GpuSpec, par: ParallelConfig, wl: Workload, *,
              tensors_only: bool) -> dict[str, Any]:
    """``memplan.model.estimate.estimate``'s per-phase peaks for rank 0 (tensor bytes), and its peak
    with fixed overheads unless ``tensors_only`` (the CPU tracker counts tensors only)."""
    est = estimate(spec, gpu, par, wl, overheads=no_overheads() if tensors_only
                   else default_overheads(gpu))
    stage = est.stages[0]
    how = "no fixed overheads (tensors only)" if tensors_only else \
        f"fixed overheads of {gpu.name} included"
    return {"source": f"memplan.model.estimate.estimate for {gpu.name}, rank 0, {how}",
            "first_step": {ph: getattr(stage.first_step, ph) for ph in PHASES},
            "steady": {ph: getattr(stage.steady, ph) for ph in PHASES},
            "peak_bytes": stage.peak_bytes if not tensors_only else stage.tensor_peak_bytes}


def reference_step(spec: ModelSpec, wl: Workload, device: str
                   ) -> tuple[torch.nn.Module, torch.optim.Optimizer, StepFn]:
    """The reference model built on ``device`` with real tensors, its optimizer, and one
    training step of the workload's precision recipe as a ``step_fn``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = ReferenceModel(spec, ref_options(wl))
    recipe = _Recipe(model, wl.precision, MemoryTracker())  # the tracker is never entered
    opt = _optimizer(recipe.updated(), wl)
    b, s = wl.micro_batch_size, wl.seq_len

    def step_fn(model: torch.nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
        ids = torch.randint(0, spec.vocab_size, (b, s), device=device)
        targets = torch.randint(0, spec.vocab_size, (b, s), device=device)
        with recipe.forward():
            loss = model(ids, targets)
        recipe.scale(loss).backward()
        del loss
        recipe.unscale(opt)
        recipe.before_step()
        recipe.step(opt)
        recipe.after_step()
        recipe.update()

    return model, opt, step_fn


def profile_reference(spec: ModelSpec, par: ParallelConfig, wl: Workload, *, steps: int = 3,
                      device: str = "cpu", fake: bool = True,
                      snapshot_path: Path | None = None) -> Timeline:
    """``steps`` training steps of the reference model on one rank."""
    if par.world_size != 1:
        raise MemplanError("profile: one rank only (--gpus 1); use trace for parallel layouts")
    context = {"model": spec.name, "workload": wl.model_dump(mode="json"), "fake": fake}
    if device == "cpu":
        mode = _fake_mode() if fake else contextlib.nullcontext()
        with mode:
            torch.manual_seed(0)
            model = ReferenceModel(spec, ref_options(wl))
            tracker = MemoryTracker(timeline=True)
            run_steps(model, spec, wl, tracker, steps=steps)
        return from_tracker(tracker, steps, context)
    if device != "cuda":
        raise MemplanError(f"device {device!r}: profile runs on cpu or cuda")
    if not torch.cuda.is_available():
        raise MemplanError("device cuda: torch sees no CUDA device")
    from memplan.profile.cuda_step import profile_cuda

    context["fake"] = False
    model, opt, step_fn = reference_step(spec, wl, "cuda")
    return profile_cuda(model, opt, step_fn, steps=steps, context=context,
                        snapshot_path=snapshot_path)


__all__ = ["predicted", "profile_reference", "reference_step"]
