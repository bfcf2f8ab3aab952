"""Where a training step's time goes, from ``torch.profiler`` data reduced to plain rows.

torch-free. ``memplan.profile.perf`` runs the profiler and hands over:
- ``ops``: one row per operator (``name``, ``calls``, ``self_us`` on the device that ran it,
  ``flops`` as counted by ``with_flops=True``: matmuls, convolutions and some elementwise
  ops; attention kernels may count none);
- ``kernels``: one row per GPU kernel name (``name``, ``calls``, ``time_us``), empty on CPU;
- ``trace``: ``memplan.profiler_traces.analyze`` of the exported chrome trace (the split of the
  profiled steps into compute, exposed communication, exposed copies and idle).

Achieved FLOP/s = counted FLOPs per step / mean step time. MFU = achieved / the catalog's
peak dense bf16 FLOP/s of the GPU (none on CPU: no catalog peak). The step is called
- communication-bound when exposed communication takes at least as long as compute;
- compute-bound when matmul, convolution and attention ops (``MATMUL_OPS``) take most of the
  operator self time;
- memory-bound otherwise: most operator time is in elementwise, normalisation and copy ops,
  whose speed is set by memory bandwidth.
"""

from __future__ import annotations

import re
from typing import Any

# matmul-like operators: their time is what tensor cores / FMA units are for
MATMUL_OPS = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_?convolution|conv\w*|"
                        r"cudnn_convolution\w*|_scaled_dot_product\w*|scaled_dot_product\w*|"
                        r"_flash_attention\w*|_efficient_attention\w*)$")


def top(rows: list[dict[str, Any]], key: str, n: int) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (-r[key], r["name"]))[:n]


def bound(ops: list[dict[str, Any]], split: dict[str, float]) -> dict[str, Any]:
    """The limiting resource with the measured shares that decided it."""
    total = sum(r["self_us"] for r in ops)
    matmul = sum(r["self_us"] for r in ops if MATMUL_OPS.match(r["name"]))
    share = matmul / total if total else 0.0
    if split["exposed_comm"] > 0 and split["exposed_comm"] >= split["compute"]:
        kind = "communication"
        why = (f"exposed communication {split['exposed_comm']:.0f} us >= compute "
               f"{split['compute']:.0f} us")
    elif share > 0.5:
        kind, why = "compute", f"matmul and attention ops take {100 * share:.1f}% of op time"
    else:
        kind = "memory"
        why = (f"ops other than matmul and attention (elementwise, norms, copies) take "
               f"{100 * (1 - share):.1f}% of op time")
    return {"bound": kind, "why": why, "matmul_ops_share": share}


def summarize(ops: list[dict[str, Any]], kernels: list[dict[str, Any]],
              trace: dict[str, Any], *, device: str, peak_flops: float | None = None,
              gpu_name: str | None = None, n: int = 10) -> dict[str, Any]:
    """Top ops and kernels, the time split, FLOP/s and MFU, and the bound."""
    steps = trace["steps"]
    step_us = sum(s["duration_us"] for s in steps) / len(steps) if steps else trace["window_us"]
    flops_per_step = sum(r["flops"] for r in ops) / max(len(steps), 1)
    achieved = flops_per_step / (step_us * 1e-6) if step_us else 0.0
    out: dict[str, Any] = {
        "device": device, "num_steps": len(steps), "mean_step_us": step_us,
        "top_ops": top(ops, "self_us", n), "top_kernels": top(kernels, "time_us", n),
        "split_us": trace["split_us"], "collectives": trace["collectives"],
        "flops_per_step": flops_per_step, "achieved_flops_per_s": achieved,
        "flops_source": "torch.profiler with_flops (matmuls, convolutions, some elementwise "
                        "ops; attention may count none)",
        **bound(ops, trace["split_us"]),
    }
    if peak_flops:
        out["mfu"] = achieved / peak_flops
        out["mfu_source"] = f"peak dense bf16 FLOP/s of {gpu_name} in the GPU catalog"
    else:
        out["mfu"] = None
        out["mfu_source"] = "no catalog peak for this device"
    return out


__all__ = ["MATMUL_OPS", "bound", "summarize", "top"]
