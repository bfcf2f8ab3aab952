"""What bounds a configuration: memory, compute, communication or the pipeline bubble.

From the estimate and the step-time model (``memplan.planning.timing``, whose MFU and overlap
assumptions it inherits). A job is memory-bound when memory, not speed, decides its
configuration: it does not fit within the planner's safety margin, or it spends FLOPs on
recomputation only to save memory. Otherwise the step-time model's largest term bounds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.model.estimate import Estimate
from memplan.planning.planner import DEFAULT_SAFETY
from memplan.planning.timing import Bound, StepTime
from memplan.workload import Recompute

# What moves each communication dimension (memplan.planning.timing.comm_columns says what each
# sends).
_COMM_ADVICE = {
    "tp": "a smaller TP degree, or TP kept inside one node (its collectives are exposed)",
    "dp": "a larger micro-batch or global batch per step (the gradient reduction is paid once "
          "per step), or a lower ZeRO stage (ZeRO-3 gathers weights every micro-batch)",
    "pp": "fewer pipeline stages or a larger micro-batch (fewer, larger sends)",
    "cp": "a smaller CP degree (the KV ring grows with it)",
    "ep": "a smaller EP degree, or experts kept inside one node (all-to-all is exposed)",
    "host_grads": "the optimizer back on the GPU (no offload) where memory allows, or a higher "
                  "ZeRO stage (a smaller shard crosses the host link)",
    "host_step": "the optimizer back on the GPU (no offload) where memory allows, or more "
                 "data-parallel ranks (a smaller shard per CPU step)",
}


_COMM_NAME = {"host_grads": "the gradient copy to the host",
              "host_step": "the host's optimizer step and weight copy back"}


@dataclass(frozen=True)
class Utilisation:
    bound: str  # "memory", "compute", "communication" or "pipeline bubble"
    time: StepTime
    headroom_bytes: int  # capacity - peak_bytes of the most loaded rank
    recompute_share: float  # hardware FLOPs spent on recomputation / model FLOPs
    advice: tuple[str, ...]


def utilisation(est: Estimate, time: StepTime, *, capacity_bytes: int | None = None,
                safety: float = DEFAULT_SAFETY, failed: bool = False) -> Utilisation:
    """The bound of ``est``'s configuration timed as ``time`` (``fixes.time_of``); ``failed``:
    the job ran out of memory (whatever the estimate says)."""
    capacity = est.capacity_bytes if capacity_bytes is None else capacity_bytes
    headroom = capacity - est.peak_bytes
    recompute = time.hardware_flops / time.model_flops - 1.0
    tight = est.peak_bytes > capacity * (1.0 - safety)
    advice: list[str] = []
    if failed or tight or est.workload.recompute > Recompute.NONE:
        bound = "memory"
        if failed and not tight:
            advice.append("it ran out of memory although the estimate leaves room: the "
                          "findings say what the estimate does not count")
        if tight:
            advice.append(f"the peak leaves less than the {safety:.0%} safety margin free: the "
                          "ranked fixes trade step time for memory")
        if recompute > 0:
            advice.append(f"recomputation adds {recompute:.1%} to the FLOPs; memory freed "
                          "elsewhere (ZeRO stage, TP/PP) lets it be lowered")
    else:
        bound = time.bound.value
    if time.bound is Bound.COMMUNICATION or bound == "communication":
        kind = max(time.comm_s, key=lambda k: time.comm_s[k])
        advice.append(f"communication: {_COMM_NAME.get(kind, kind.upper())} is the largest ({time.comm_s[kind]:.3g} s "
                      f"before overlap of a {time.step_s:.3g} s step); {_COMM_ADVICE[kind]}")
    if time.bubble_s > 0:
        advice.append(f"pipeline bubble: {time.bubble_s / time.step_s:.1%} of the step; more "
                      "micro-batches per step (larger global batch or smaller micro-batch) or "
                      "interleaving (--vpp) shrink it")
    if bound == "compute":
        advice.append(f"compute: {time.compute_s / time.step_s:.1%} of the step at the assumed "
                      "MFU (memplan.planning.timing); only faster kernels, less recomputation or "
                      "more GPUs move it")
    return Utilisation(bound=bound, time=time, headroom_bytes=headroom,
                       recompute_share=recompute, advice=tuple(advice))
