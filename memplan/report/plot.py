"""What every plot shares: the figure written to its file, the file's name checked, colours.

The plots, for a design doc: the step timeline (``memplan.report.plot_timeline``), profiler
traces (``plot_trace``), monitor runs (``plot_monitor``) and estimates (``plot_estimate``).
They need matplotlib (the ``plot`` extra); without it every ``plot_*`` returns ``None`` and
draws nothing. The format follows the file name: ``.png`` (the default) or ``.svg`` (its text
kept as text). Bytes become GiB or MiB (``memplan.report.sizes.axis_unit``) on an axis
labelled with the unit.
"""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.outputs import write_atomic

FORMATS = (".png", ".svg")
# no creation date or tool version in the files, so a plot of the same data is the same file
_METADATA = {".png": {"Software": None}, ".svg": {"Date": None, "Creator": None}}
# Categorical colours (matplotlib's tab10 order), one per memory category and phase.
CATEGORY_COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868",
                    "activations": "#c44e52", "temporaries": "#8172b3"}
# Phases are shaded in greys, so their bands never read as a memory category.
PHASE_SHADES = {"setup": "#9a9a9a", "forward": "#ffffff", "backward": "#e4e4e4",
                "optimizer": "#c8c8c8", "other": "#b0b0b0"}
PHASE_LABELS = {"setup": "setup", "forward": "fwd", "backward": "bwd", "optimizer": "opt",
                "other": "other"}


def check_path(path: Path, what: str = "--plot") -> Path:
    """``path`` as a plot file to write, checked before any work: matplotlib installed, a .png
    or .svg name, not a folder, in a folder that exists or can be made and that this user can
    write."""
    from memplan.outputs import check_out_file

    if importlib.util.find_spec("matplotlib") is None:
        raise MemplanError(f"{what}: matplotlib is not installed (pip install matplotlib); "
                           "nothing was run")
    return check_out_file(path, what, FORMATS, ".png or .svg")


@contextmanager
def figure(path: Path, **kw: Any) -> Iterator[Any]:
    """A matplotlib figure written to ``path`` (PNG or SVG by its suffix) when the block ends,
    whole or not at all (``memplan.outputs.write_atomic``), and closed whatever happens
    (``MemplanError`` without matplotlib, from ``check_path``)."""
    path = check_path(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # spikes one op wide are real peaks: no line simplification may drop them; SVG text stays
    # text (searchable, editable in a doc)
    with plt.rc_context({"path.simplify": False, "svg.fonttype": "none"}):
        fig = plt.figure(**kw)
        try:
            yield fig
            image = io.BytesIO()
            fig.savefig(image, format=path.suffix.lower()[1:], dpi=110, bbox_inches="tight",
                        metadata=_METADATA[path.suffix.lower()])
            write_atomic(path, image.getvalue())
        finally:
            plt.close(fig)


__all__ = ["CATEGORY_COLOURS", "FORMATS", "PHASE_LABELS", "PHASE_SHADES", "check_path",
           "figure"]
