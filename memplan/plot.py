"""A PNG of a memory timeline: phases shaded, step boundaries marked, the predicted peak drawn.

Needs matplotlib (the ``plot`` extra); without it ``plot_timeline`` returns ``None`` and draws
nothing. Bytes become GiB (``memplan.report.sizes``) on an axis labelled GiB.
"""

from __future__ import annotations

import io
from pathlib import Path


from memplan.report.sizes import in_gib
from memplan.timeline import Timeline

_SHADE = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868",
          "other": "#8c8c8c"}


def _spans(tl: Timeline) -> list[tuple[int, int, str]]:
    """(first index, last index, phase) of each run of samples in one phase."""
    spans: list[tuple[int, int, str]] = []
    for k, s in enumerate(tl.samples):
        key = f"{s.step}/{s.phase}"
        if spans and spans[-1][2] == key:
            spans[-1] = (spans[-1][0], k, key)
        else:
            spans.append((k, k, key))
    return spans


def plot_timeline(tl: Timeline, path: Path, *, predicted_peak_bytes: int | None = None,
                  ) -> Path | None:
    """Write ``path`` (PNG); ``None`` when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    xs = list(range(len(tl.samples)))
    fig, ax = plt.subplots(figsize=(12, 5))
    try:
        ax.plot(xs, [in_gib(s.total_bytes) for s in tl.samples], lw=1.2, color="black",
                label="allocated" if tl.device == "cuda" else "live tensors")
        if tl.device == "cuda":
            ax.plot(xs, [in_gib(s.reserved_bytes or 0) for s in tl.samples], lw=1,
                    label="reserved")
            ax.plot(xs, [in_gib(s.device_used_bytes or 0) for s in tl.samples], lw=1,
                    label="device used")
        seen: set[str] = set()
        for lo, hi, key in _spans(tl):
            phase = key.split("/", 1)[1]
            ax.axvspan(lo - 0.5, hi + 0.5, color=_SHADE.get(phase, "#cccccc"), alpha=0.18,
                       lw=0, label=None if phase in seen else phase)
            seen.add(phase)
        for step in range(2, tl.num_steps + 1):
            first = next(k for k, s in enumerate(tl.samples) if s.step == step)
            ax.axvline(first - 0.5, color="black", ls=":", lw=1)
            ax.text(first, ax.get_ylim()[1], f" step {step}", va="top", fontsize=8)
        if predicted_peak_bytes is not None:
            ax.axhline(in_gib(predicted_peak_bytes), color="red", ls="--", lw=1,
                       label="predicted peak (memplan estimate)")
        ax.set_xlabel("event (op under the CPU tracker; phase change on CUDA)")
        ax.set_ylabel("GiB")
        ax.set_title(f"{tl.context.get('model', 'step')}: memory by phase ({tl.device})")
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        from memplan.outputs import write_atomic  # whole or not at all

        png = io.BytesIO()
        fig.savefig(png, dpi=110, format="png")
        write_atomic(path, png.getvalue())

    finally:
        plt.close(fig)
    return path


__all__ = ["plot_timeline"]
