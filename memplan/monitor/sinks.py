"""Where a ``MemoryMonitor``'s records also go, each opt-in: TensorBoard scalars and Weights &
Biases. The JSONL record is written first and is the same with or without them.

``scalars(record)`` names what goes: every number the record carries except its ``rank``,
``step`` and ``time`` (allocated, reserved and peak bytes, fragmentation, headroom, capacity,
the resident set, the tracker's tensor bytes, retries, OOMs, the step time, whatever a reader
adds), as ``memplan/<key>``, plus ``memplan/num_warnings`` (the warnings of the step); the
monitor adds ``memplan/predicted_peak_bytes`` when it was given the estimate. Units stay as in
the record: bytes, seconds.

- ``TensorBoardSink``: a folder (an event file written by TensorBoard's own writer,
  ``tensorboard.summary.writer.event_file_writer.EventFileWriter``, under
  ``<folder>/memplan_rank<R>``, one TensorBoard run per rank; one event a step holding its
  values as float64 scalar tensors of the scalar plugin, so byte counts up to 2**53 stay
  exact; no torch), or a writer the job already has (anything with ``add_scalar(tag, value,
  step)``: torch's or tensorboardX's ``SummaryWriter``; torch's is asked for double
  precision);
- ``WandbSink``: ``run.log`` on the run given, or on the active run (``wandb.run``) at each
  step, skipped while there is none; ``memplan/step`` is logged with the values and declared
  their step metric (``define_metric``), so the job's own ``wandb.log`` steps are left alone.

tensorboard and wandb are imported only when a sink is made (``pip install 'memplan[monitor]'``).
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import time
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError

PREFIX = "memplan/"
# the record's own keys that are not values over steps
_NOT_SCALARS = frozenset({"rank", "step", "time"})


def scalars(rec: dict[str, Any]) -> dict[str, int | float]:
    """``memplan/<key>`` -> value for every finite number of the record but rank, step and
    time, and ``memplan/num_warnings``; values are the record's own (ints stay ints)."""
    out: dict[str, int | float] = {}
    for key, value in rec.items():
        if (key not in _NOT_SCALARS and isinstance(value, int | float)
                and not isinstance(value, bool) and math.isfinite(value)):
            out[PREFIX + key] = value
    out[PREFIX + "num_warnings"] = len(rec.get("warnings") or ())
    return out


def need(module: str, who: str) -> Any:
    """``module`` imported, or one line naming ``who`` needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MemplanError(f"{who} needs {module.split('.')[0]}: pip install "
                           f"'memplan[monitor]' ({err})") from err


# seconds between flushes of the event file (torch's SummaryWriter waits 120); close() flushes
FLUSH_S = 30


def _double(value: float) -> Any:
    """A float64 scalar tensor: what ``tensor_util.make_tensor_proto(np.float64(v))`` gives,
    made directly."""
    from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2

    return tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, double_val=[float(value)],
                                  tensor_shape=tensor_shape_pb2.TensorShapeProto())


class TensorBoardSink:
    """Scalars to TensorBoard: a folder (``<folder>/memplan_rank<R>``) or a writer with
    ``add_scalar``; see the module docstring."""

    def __init__(self, target: Any, who: str = "tensorboard") -> None:
        if isinstance(target, str | os.PathLike) and not isinstance(target, bool):
            if str(target) == "":
                raise MemplanError(f"{who} must be a folder path or a writer with "
                                   "add_scalar, not ''")
            self.folder: Path | None = Path(target)
            self.writer: Any = None
            for part in (self.folder, *self.folder.parents):  # the nearest existing: a folder
                if part.exists():
                    if not part.is_dir():
                        raise MemplanError(f"{who} {self.folder}: {part} is a file, not a "
                                           "folder")
                    break
            need("tensorboard.summary.writer.event_file_writer", who)
        elif callable(getattr(target, "add_scalar", None)):
            self.folder, self.writer = None, target
        else:
            raise MemplanError(f"{who} must be a folder path or a writer with add_scalar "
                               f"(a SummaryWriter), not {target!r}")
        self._output: Any = None
        self._described: set[str] = set()  # tags whose metadata the open file has
        self._exact = False
        if self.writer is not None:
            try:  # torch's SummaryWriter keeps float32 unless asked for a double
                params = inspect.signature(self.writer.add_scalar).parameters
                self._exact = "double_precision" in params and "new_style" in params
            except (TypeError, ValueError):
                self._exact = False

    def run_dir(self, rank: int) -> Path | None:
        """The TensorBoard run folder of ``rank`` (None with a writer of the job's)."""
        return None if self.folder is None else self.folder / f"memplan_rank{rank}"

    def write(self, rank: int, step: int, values: dict[str, int | float],
              wall_time: float | None = None) -> None:
        if self.writer is not None:
            extra = {"new_style": True, "double_precision": True} if self._exact else {}
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step, **extra)
            return
        from tensorboard.compat.proto import event_pb2

        if self._output is None:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self._output = EventFileWriter(str(self.run_dir(rank)), flush_secs=FLUSH_S)
            self._described = set()
        event = event_pb2.Event(wall_time=time.time() if wall_time is None else wall_time,
                                step=step)
        for tag, value in values.items():
            event.summary.value.add(tag=tag, tensor=_double(value),
                                    metadata=self._metadata(tag))
        self._output.add_event(event)

    def _metadata(self, tag: str) -> Any:
        """The scalar plugin's metadata, with a tag's first value in each file (as TensorBoard's
        own writers do: it keeps the first)."""
        if tag in self._described:
            return None
        self._described.add(tag)
        from tensorboard.compat.proto import summary_pb2
        from tensorboard.plugins.scalar import metadata

        out = metadata.create_summary_metadata(display_name=tag, description="")
        out.data_class = summary_pb2.DataClass.DATA_CLASS_SCALAR
        return out

    def flush(self) -> None:
        target = self.writer if self.writer is not None else self._output
        if target is not None and callable(getattr(target, "flush", None)):
            target.flush()

    def close(self) -> None:
        """Close the event file this sink opened (a later write opens a new one); a writer of
        the job's is flushed, not closed."""
        if self._output is not None:
            output, self._output = self._output, None
            output.close()
        else:
            self.flush()


class WandbSink:
    """``run.log`` on the run given or the active ``wandb.run``; see the module docstring."""

    def __init__(self, run: Any = True, who: str = "wandb") -> None:
        if run is True:
            self._wandb = need("wandb", who)
            self.run: Any = None
        elif callable(getattr(run, "log", None)) and not isinstance(run, bool):
            self._wandb, self.run = None, run
        else:
            raise MemplanError(f"{who} must be True (the active wandb run) or a wandb run, "
                               f"not {run!r}")
        self._defined: set[int] = set()

    def current(self) -> Any:
        """The run written to: the one given, else ``wandb.run`` now (None when none)."""
        return self.run if self.run is not None else getattr(self._wandb, "run", None)

    def write(self, rank: int, step: int, values: dict[str, int | float],
              wall_time: float | None = None) -> bool:
        """Log one step's values; False when there is no run to log to."""
        run = self.current()
        if run is None:
            return False
        if id(run) not in self._defined and callable(getattr(run, "define_metric", None)):
            run.define_metric(PREFIX + "step")
            run.define_metric(PREFIX + "*", step_metric=PREFIX + "step")
            self._defined.add(id(run))
        run.log({PREFIX + "step": step, **values})
        return True

    def flush(self) -> None:
        return None

    def close(self) -> None:  # the run is the job's: never finished here
        return None


__all__ = ["PREFIX", "TensorBoardSink", "WandbSink", "need", "scalars"]
