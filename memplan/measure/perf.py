"""Where a training step's time goes, from ``torch.profiler`` data reduced to plain rows.

torch-free. ``memplan.profile.perf`` runs the profiler and hands over:
- ``ops``: one row per operator (``name``, ``calls``, ``self_us`` on the device that ran it,
  ``flops`` as counted by ``with_flops=True``: matmuls, convolutions and some elementwise
  ops; attention kernels may count none);
- ``kernels``: one row per GPU kernel name (``name``, ``calls``, ``time_us``), empty on CPU;
- ``trace``: ``memplan.measure.profiler_traces.analyze`` of the exported chrome trace (the split
  of the profiled steps into compute, exposed communication, exposed copies and idle);
- ``bytes_per_step``: the bytes the step's aten ops read and write (each op's input and output
  tensors, once each; views move nothing), counted in one step outside the profiler.

Achieved FLOP/s = counted FLOPs per step / mean step time, achieved bytes/s likewise. MFU =
achieved / the catalog's peak dense bf16 FLOP/s of the GPU. The step is called
- communication-bound when exposed communication takes at least as long as compute (on any
  device: both are measured time);
- else, on CUDA, by the roofline (Williams, Waterman, Patterson, CACM 52(4), 2009): its
  arithmetic intensity (FLOPs per byte) against the GPU's ridge point (peak FLOP/s over HBM
  bytes/s, from the GPU catalog): compute-bound at or above it, memory-bound below, with the
  achieved FLOP/s as a share of what the roofline allows at that intensity;
- on CPU, "not classified": the catalog has no peak FLOP/s or memory bandwidth for a host CPU,
  and the ops of a small model on a CPU are bound by dispatch overhead as often as by either.
The share of operator time in matmul-like ops (``MATMUL_OPS``) is reported beside it.
"""

from __future__ import annotations

import re
from typing import Any

# matmul-like operators: their time is what tensor cores / FMA units are for
MATMUL_OPS = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_?convolution|conv\w*|"
                        r"cudnn_convolution\w*|_scaled_dot_product\w*|scaled_dot_product\w*|"
                        r"_flash_attention\w*|_efficient_attention\w*)$")
NOT_CLASSIFIED = "not classified"


def top(rows: list[dict[str, Any]], key: str, n: int) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (-r[key], r["name"]))[:n]


def matmul_share(ops: list[dict[str, Any]]) -> float:
    """The share of operator self time spent in ``MATMUL_OPS``."""
    total = sum(r["self_us"] for r in ops)
    return sum(r["self_us"] for r in ops if MATMUL_OPS.match(r["name"])) / total if total else 0.0


def bound(split: dict[str, float], *, device: str, flops_per_s: float,
          bytes_per_s: float | None, peak_flops: float | None = None,
          peak_bytes_per_s: float | None = None, gpu_name: str | None = None
          ) -> dict[str, Any]:
    """The limiting resource and the measured figures that decided it (module docstring)."""
    if split["exposed_comm"] > 0 and split["exposed_comm"] >= split["compute"]:
        return {"bound": "communication",
                "why": (f"exposed communication {split['exposed_comm']:.0f} us >= compute "
                        f"{split['compute']:.0f} us")}
    if device != "cuda" or not peak_flops or not peak_bytes_per_s:
        where = "a CPU" if device != "cuda" else "this GPU (no catalog peaks: pass --gpu)"
        return {"bound": NOT_CLASSIFIED,
                "why": f"no roofline on {where}: the GPU catalog's peak FLOP/s and memory "
                       "bandwidth are what a roofline needs"}
    if not bytes_per_s:
        return {"bound": NOT_CLASSIFIED, "why": "no bytes were counted for the step"}
    intensity = flops_per_s / bytes_per_s
    ridge = peak_flops / peak_bytes_per_s
    roof = min(peak_flops, intensity * peak_bytes_per_s)
    kind = "compute" if intensity >= ridge else "memory"
    return {"bound": kind, "arithmetic_intensity": intensity, "ridge_point": ridge,
            "roofline_flops_per_s": roof, "of_roofline": flops_per_s / roof,
            "why": (f"arithmetic intensity {intensity:.1f} FLOP/byte is "
                    f"{'at or above' if kind == 'compute' else 'below'} the ridge point "
                    f"{ridge:.1f} FLOP/byte of {gpu_name} (peak bf16 {peak_flops:.3g} FLOP/s "
                    f"over HBM {peak_bytes_per_s:.3g} bytes/s); achieved "
                    f"{100 * flops_per_s / roof:.1f}% of the {roof:.3g} FLOP/s the roofline "
                    "allows there")}


def summarize(ops: list[dict[str, Any]], kernels: list[dict[str, Any]],
              trace: dict[str, Any], *, device: str, bytes_per_step: int | None = None,
              peak_flops: float | None = None, peak_bytes_per_s: float | None = None,
              gpu_name: str | None = None, n: int = 10) -> dict[str, Any]:
    """Top ops and kernels, the time split, FLOP/s, bytes/s and MFU, and the bound."""
    steps = trace["steps"]
    step_us = sum(s["duration_us"] for s in steps) / len(steps) if steps else trace["window_us"]
    flops_per_step = sum(r["flops"] for r in ops) / max(len(steps), 1)
    achieved = flops_per_step / (step_us * 1e-6) if step_us else 0.0
    moved = bytes_per_step / (step_us * 1e-6) if step_us and bytes_per_step else None
    out: dict[str, Any] = {
        "device": device, "num_steps": len(steps), "mean_step_us": step_us,
        "top_ops": top(ops, "self_us", n), "top_kernels": top(kernels, "time_us", n),
        "split_us": trace["split_us"], "collectives": trace["collectives"],
        "flops_per_step": flops_per_step, "achieved_flops_per_s": achieved,
        "flops_source": "torch.profiler with_flops (matmuls, convolutions, some elementwise "
                        "ops; attention may count none)",
        "bytes_per_step": bytes_per_step, "achieved_bytes_per_s": moved,
        "bytes_source": "each aten op's input and output tensors, read and written once (views "
                        "move nothing), counted in one step before the profiled ones",
        "matmul_ops_share": matmul_share(ops),
        **bound(trace["split_us"], device=device, flops_per_s=achieved, bytes_per_s=moved,
                peak_flops=peak_flops, peak_bytes_per_s=peak_bytes_per_s, gpu_name=gpu_name),
    }
    if peak_flops and device == "cuda":
        out["mfu"] = achieved / peak_flops
        out["mfu_source"] = f"peak dense bf16 FLOP/s of {gpu_name} in the GPU catalog"
    else:
        out["mfu"] = None
        out["mfu_source"] = "no catalog peak for this device"
    return out


__all__ = ["MATMUL_OPS", "NOT_CLASSIFIED", "bound", "matmul_share", "summarize", "top"]
