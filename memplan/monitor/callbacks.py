"""``MemoryMonitor`` as a callback of transformers' ``Trainer`` and of Lightning's, importing
neither.

``TrainerHooks`` (a base of ``MemoryMonitor``) answers both callback protocols by name, so
``Trainer(callbacks=[monitor])`` works with either library:
- transformers: ``on_train_begin`` opens the file, ``on_step_end`` records an optimizer step
  (after gradient accumulation), ``on_train_end`` closes it; every other event, those added in
  later releases too, does nothing, and each returns None (the handler would take a returned
  value for its ``control``);
- Lightning: ``on_fit_start`` opens the file (taking the rank from ``trainer.global_rank`` when
  the monitor was given none), ``on_train_batch_end`` records a step when
  ``trainer.global_step`` advanced (once per optimizer step under gradient accumulation),
  ``on_fit_end`` and ``on_exception`` close it; ``state_key``, ``state_dict``,
  ``load_state_dict``, ``setup`` and ``teardown`` are what Lightning asks of every callback.

``lightning_callback(monitor)`` is the same as an instance of a subclass of
``lightning.pytorch.Callback`` (or ``pytorch_lightning.Callback``), made on first use, for code
that checks the type.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from memplan.errors import MemplanError


def _ignore(*_: Any, **__: Any) -> None:
    return None


class TrainerHooks:
    """The callback protocols of transformers and Lightning, on top of ``start``, ``step``,
    ``close`` and ``rank`` (see the module docstring)."""

    _started: bool
    _seen_global_step: int = -1
    rank: int | None

    # what the recorder provides (``MemoryMonitor``); the hooks below only drive these
    def start(self) -> None:
        raise NotImplementedError

    def step(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # transformers (TrainerCallback: args, state, control, **kwargs)
    def on_train_begin(self, *_: Any, **__: Any) -> None:
        if not self._started:
            self.start()

    def on_step_end(self, *_: Any, **__: Any) -> None:
        self.step()

    def on_train_end(self, *_: Any, **__: Any) -> None:  # Lightning's too: it closes
        self.close()

    # Lightning (Callback: trainer, pl_module, ...)
    def on_fit_start(self, trainer: Any, *_: Any) -> None:
        if self.rank is None:
            self.rank = int(trainer.global_rank)
        self._seen_global_step = int(trainer.global_step)
        if not self._started:
            self.start()

    def on_train_batch_end(self, trainer: Any, *_: Any, **__: Any) -> None:
        step = int(trainer.global_step)
        if step != self._seen_global_step:  # an optimizer step ended with this batch
            self._seen_global_step = step
            self.step()

    def on_fit_end(self, *_: Any) -> None:
        self.close()

    def on_exception(self, *_: Any) -> None:
        self.close()

    @property
    def state_key(self) -> str:
        return f"{type(self).__qualname__}[rank={self.rank}]"

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None

    def setup(self, *_: Any, **__: Any) -> None:
        return None

    def teardown(self, *_: Any, **__: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        # every other event of either library (on_init_end, on_log, on_validation_start, ...,
        # and those added later) does nothing
        if name.startswith("on_") and not name.startswith("on__"):
            return _ignore
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def lightning_callback(self) -> Any:
        """This monitor as an instance of a Lightning ``Callback`` subclass."""
        return lightning_callback(self)


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
        """Lightning hooks that drive a ``TrainerHooks`` (a ``MemoryMonitor``)."""

        def __init__(self, monitor: TrainerHooks) -> None:
            self.monitor = monitor

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            self.monitor.on_fit_start(trainer, pl_module)

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            self.monitor.on_train_batch_end(trainer, *args, **kwargs)

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            self.monitor.close()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self.monitor.close()

    return MemoryMonitorCallback


def lightning_callback(monitor: TrainerHooks) -> Any:
    """A Lightning ``Callback`` that records ``monitor`` once per optimizer step."""
    return _callback_class()(monitor)


__all__ = ["TrainerHooks", "lightning_callback"]
