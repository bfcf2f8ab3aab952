"""A plot of an estimate: one stacked bar per pipeline stage (one rank of it) against the GPU.

Each bar is the rank's predicted peak, ``StageMemory.peak_bytes``, split exactly: the model
states resident in the peak phase at their full size (parameters and registered buffers;
optimizer states from the first optimizer step on; gradients in the optimizer phase, when
micro-batches accumulate them or when ``zero_grad`` keeps them), the rest of the tensor peak
(saved activations, the gradients backward is producing, loss logits, ZeRO/DDP buffers,
temporaries), a calibration's correction when one is applied, and the fixed overheads (CUDA
context, cuBLAS workspace, the allocator's share). The GPU's capacity is a line across.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memplan.report.plot import figure
from memplan.report.sizes import axis_unit, format_gib

PARTS = {"parameters and buffers": "#4c72b0", "optimizer states": "#55a868",
         "gradients": "#dd8452", "rest of the tensor peak (activations, temporaries, ...)":
         "#c44e52", "calibration correction": "#937860", "CUDA context and workspace": "#8c8c8c",
         "allocator share": "#bcbcbc"}


def stage_parts(est: Any, s: Any) -> dict[str, int]:
    """The split of stage ``s``'s peak bytes (see the module docstring); sums to
    ``s.peak_bytes``."""
    steady = s.steady.peak >= s.first_step.peak
    phase = (s.steady if steady else s.first_step).peak_phase
    states = {"parameters and buffers": s.params_bytes + s.buffers_bytes}
    if steady or phase == "optimizer":
        states["optimizer states"] = s.optimizer_bytes
    if phase == "optimizer" or est.num_microbatches > 1 or (
            steady and getattr(est.workload, "keep_grads", False)):
        states["gradients"] = s.grads_bytes
    rest = s.tensor_peak_bytes - sum(states.values())
    if rest < 0:  # the states are not all alive at the peak: show the tensor peak whole
        states, rest = {}, s.tensor_peak_bytes
    parts = {**states, "rest of the tensor peak (activations, temporaries, ...)": rest,
             "calibration correction": s.calibration_bytes,
             "CUDA context and workspace": s.cuda_context_bytes + s.workspace_bytes,
             "allocator share": s.allocator_bytes}
    assert sum(parts.values()) == s.peak_bytes, (parts, s.peak_bytes)
    return parts


def plot_estimate(est: Any, path: Path) -> Path:
    """Write ``path`` (PNG or SVG) for ``memplan.model.estimate.Estimate`` ``est``."""
    with figure(path, figsize=(max(5.0, 2.2 + 0.9 * len(est.stages)), 4.8)) as fig:
        ax = fig.add_subplot()
        unit, label = axis_unit(max(est.capacity_bytes, *(s.peak_bytes for s in est.stages)))
        xs = list(range(len(est.stages)))
        bottoms = [0.0] * len(xs)
        for name, colour in PARTS.items():
            values = [stage_parts(est, s).get(name, 0) / unit for s in est.stages]
            if not any(values):
                continue
            ax.bar(xs, values, 0.6, bottom=bottoms, color=colour, label=name)
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
        capacity = f"{est.gpu.name} capacity ({format_gib(est.capacity_bytes)})"
        ax.axhline(est.capacity_bytes / unit, color="black", lw=1.2, ls="--", label=capacity)
        for x, s in zip(xs, est.stages, strict=True):
            fits = "fits" if s.peak_bytes <= est.capacity_bytes else "does not fit"
            ax.text(x, s.peak_bytes / unit, f"{format_gib(s.peak_bytes)}\n{fits}",
                    ha="center", va="bottom", fontsize=7)
        ax.set_xticks(xs, [f"stage {s.stage}\n{s.num_layers} layers" for s in est.stages],
                       fontsize=8)
        ax.set_ylabel(label)
        ax.set_ylim(0, max(bottoms + [est.capacity_bytes / unit]) * 1.15)
        par, wl = est.parallel, est.workload
        ax.set_title(f"{est.spec.name} on {par.world_size} x {est.gpu.name}: tp "
                     f"{par.tp}, pp {par.pp}, dp {par.dp}, zero {int(par.zero)}; mbs "
                     f"{wl.micro_batch_size} x seq {wl.seq_len}; peak per rank of each stage",
                     fontsize=9)
        handles, names = ax.get_legend_handles_labels()  # the capacity, then the stack top down
        cap = names.index(capacity)
        order = [cap, *(k for k in range(len(names) - 1, -1, -1) if k != cap)]
        ax.legend([handles[k] for k in order], [names[k] for k in order], loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return path


__all__ = ["PARTS", "plot_estimate", "stage_parts"]
