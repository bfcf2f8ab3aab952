"""The CUDA side of ``profile_step``: the caching allocator's bytes at every phase change.

A light dispatch mode only watches for phase changes (no per-tensor bookkeeping). At each
change, at each step start and at each step end it reads, after a synchronize:
- ``torch.cuda.memory_allocated`` (``total_bytes``) and ``torch.cuda.max_memory_allocated``
  since the previous sample (``peak_bytes``; the counter is reset at every sample, so a
  sample's peak belongs to the phase that just ended, which is the sample's phase);
- ``torch.cuda.memory_reserved`` (``reserved_bytes``);
- ``torch.cuda.mem_get_info`` total - free (``device_used_bytes``: every process on the
  device, CUDA context and cuBLAS workspaces included);
- the time since sampling began (``time_s``, after the synchronize).
Step start and end samples also hold ``{"optimizer": bytes of optimizer.state tensors}``.
With ``snapshot_path`` the allocator's history is recorded
(``torch.cuda.memory._record_memory_history``) and dumped there for pytorch.org/memory_viz.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.errors import raise_if_interrupted
from memplan.measure.timeline import Sample, Timeline
from memplan.profile.phases import PhaseDetector, StepFn, phase_hooks

CUDA_SOURCE = ("CUDA caching allocator (torch.cuda.memory_allocated / max_memory_allocated / "
               "memory_reserved) and cudaMemGetInfo, read at every phase change")


class _Sampler(TorchDispatchMode):
    def __init__(self, det: PhaseDetector) -> None:
        super().__init__()
        self.det = det
        self.step = 0
        self.phase = "forward"
        self.samples: list[Sample] = []
        self.t0 = time.perf_counter()

    def sample(self, op: str, by_category: dict[str, int] | None = None) -> None:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        self.samples.append(Sample(
            index=len(self.samples), step=self.step, phase=self.phase,
            total_bytes=torch.cuda.memory_allocated(), op=op, by_category=by_category or {},
            reserved_bytes=torch.cuda.memory_reserved(), device_used_bytes=total - free,
            peak_bytes=torch.cuda.max_memory_allocated(), time_s=time.perf_counter() - self.t0))
        torch.cuda.reset_peak_memory_stats()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        now = self.det.current()
        if now != self.phase:
            self.sample(f"end of {self.phase}")
            self.phase = now
        return func(*args, **(kwargs or {}))


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors on the GPU (distinct storages)."""
    seen: dict[int, int] = {}
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.is_cuda:
                st = v.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def profile_cuda(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step_fn: StepFn,
                 *, steps: int, context: dict[str, Any] | None = None,
                 snapshot_path: Path | None = None) -> Timeline:
    """``steps`` calls of ``step_fn`` on CUDA, sampled at every phase change."""
    det = PhaseDetector()
    sampler = _Sampler(det)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    ctx = dict(context or {})
    ctx["before_first_step"] = {"allocated_bytes": torch.cuda.memory_allocated(),
                                "reserved_bytes": torch.cuda.memory_reserved(),
                                "device_used_bytes": total - free,
                                "device_total_bytes": total}
    if snapshot_path is not None:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    model.train()
    try:
        with phase_hooks(optimizer, det, None), sampler:
            for k in range(1, steps + 1):
                raise_if_interrupted()  # Ctrl-C between steps (memplan.errors)
                det.new_step()
                sampler.step, sampler.phase = k, "forward"
                torch.cuda.reset_peak_memory_stats()
                sampler.sample("step start", {"optimizer": state_bytes(optimizer)})
                step_fn(model, optimizer, k)
                sampler.sample("step end", {"optimizer": state_bytes(optimizer)})
    finally:
        if snapshot_path is not None:
            torch.cuda.memory._dump_snapshot(str(snapshot_path))
            torch.cuda.memory._record_memory_history(enabled=None)
    return Timeline(device="cuda", source=CUDA_SOURCE, num_steps=steps,
                    samples=sampler.samples, context=ctx)


__all__ = ["CUDA_SOURCE", "profile_cuda"]
