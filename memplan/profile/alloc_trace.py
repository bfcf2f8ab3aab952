"""The allocation sequence of a traced step, as the caching-allocator model replays it.

``AllocationRecorder`` is the exact tracker (``memplan.profile.tracker.MemoryTracker``) that also
writes down, in program order, each storage it starts counting (an allocation of its bytes) and
each one it stops counting (a free). A storage resized in place (FSDP2's ``resize_`` of its
all-gather buffers) is a free of the old size and an allocation of the new one, as
``StorageImpl``'s resize frees and reallocates through the device allocator. Storages of 0 bytes
are left out: ``CUDACachingAllocator``'s ``malloc`` is not called for them (``raw_alloc`` and
``allocate`` return a null pointer for 0 bytes). Every allocation is on the default stream.

The sizes are the CPU run's storage sizes; run it under ``memplan.profile.cuda_rules`` (as
``trace`` does for autocast) so that they are the sizes a CUDA build would allocate.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.model.allocator import Alloc, Free
from memplan.profile.tracker import MemoryTracker


class AllocationRecorder(MemoryTracker):
    """A ``MemoryTracker`` that keeps the allocation and free events it counted, in order."""

    def __init__(self, *, timeline: bool = False) -> None:
        super().__init__(timeline=timeline)
        self.events: list[Alloc | Free] = []
        self._event_id: dict[int, int] = {}  # id(storage) -> id of its live allocation
        self._key_of: dict[int, int] = {}  # id(tracker entry) -> id(storage)
        self._next = 0
        self.marks: list[tuple[int, int, str]] = []  # (event index, step, phase)

    def _alloc(self, key: int, nbytes: int) -> None:
        if nbytes > 0:
            self._event_id[key] = self._next
            self.events.append(Alloc(self._next, nbytes))
            self._next += 1

    def _free(self, key: int) -> None:
        event_id = self._event_id.pop(key, None)
        if event_id is not None:
            self.events.append(Free(event_id))

    def _add(self, st: torch.UntypedStorage, category: str) -> None:
        known = id(st) in self._live
        super()._add(st, category)
        if not known and id(st) in self._live:
            self._key_of[id(self._live[id(st)])] = id(st)
            self._alloc(id(st), self._live[id(st)][0])

    def _resize(self, entry: list[Any], nbytes: int) -> None:
        if nbytes != entry[0]:
            key = self._key_of.get(id(entry))
            if key is not None and self._live.get(key) is entry:
                self._free(key)
                self._alloc(key, nbytes)
        super()._resize(entry, nbytes)

    def _drop(self, key: int) -> None:
        if key in self._live:
            self._key_of.pop(id(self._live[key]), None)
            self._free(key)
        super()._drop(key)

    def set_phase(self, phase: str, step: int | None = None) -> None:
        super().set_phase(phase, step)
        self.marks.append((len(self.events), self.step, self.phase))


__all__ = ["AllocationRecorder"]
