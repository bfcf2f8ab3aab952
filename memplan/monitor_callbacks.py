"""``MemoryMonitor`` as a Lightning ``Callback``, built when asked for (Lightning is not imported
before).

transformers' ``Trainer`` needs no adapter: a ``MemoryMonitor`` answers its callback protocol
itself (``on_train_begin`` opens the file, ``on_step_end`` records an optimizer step,
``on_train_end`` closes it, every other event does nothing), so
``Trainer(callbacks=[monitor])`` works.

Lightning calls hooks by name too but also reads a callback's state and checks its type, so
``lightning_callback(monitor)`` returns an instance of a subclass of ``lightning.pytorch.Callback``
(or ``pytorch_lightning.Callback``) made on first use: it records a step when
``trainer.global_step`` advanced (once per optimizer step, also under gradient
accumulation), takes the rank from ``trainer.global_rank`` when the monitor was given none,
and closes the file when fitting ends or fails.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from memplan.errors import MemplanError

if TYPE_CHECKING:
    from memplan.monitor import MemoryMonitor


@cache
def _callback_class() -> type:
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError as err:
            raise MemplanError("lightning_callback needs Lightning: pip install lightning "
                               f"({err})") from err

    class MemoryMonitorCallback(Callback):  # type: ignore[misc, valid-type]
        """Lightning hooks that drive a ``memplan.monitor.MemoryMonitor``."""

        def __init__(self, monitor: MemoryMonitor) -> None:
            self.monitor = monitor
            self._seen_step = -1

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            if self.monitor.rank is None:
                self.monitor.rank = int(trainer.global_rank)
            self._seen_step = int(trainer.global_step)
            self.monitor.start()

        def on_train_batch_end(self, trainer: Any, *_: Any, **__: Any) -> None:
            step = int(trainer.global_step)
            if step != self._seen_step:  # an optimizer step ended with this batch
                self._seen_step = step
                self.monitor.step()

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            self.monitor.close()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self.monitor.close()

    return MemoryMonitorCallback


def lightning_callback(monitor: MemoryMonitor) -> Any:
    """A Lightning ``Callback`` that records ``monitor`` once per optimizer step."""
    return _callback_class()(monitor)


__all__ = ["lightning_callback"]
