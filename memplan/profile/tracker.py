"""Exact live-tensor bytes of a training step, by category and phase.

A ``TorchDispatchMode`` sees every tensor an aten op returns. Each new storage is counted once
(views share it, so they are free) and uncounted when Python frees it (a weakref finaliser), so
the running total is exactly the bytes of live storages the step created, plus the parameters
registered up front. Storage sizes are re-read whenever an op touches a storage, which follows
FSDP2's ``resize_`` of its all-gather buffers. It runs on CPU, CUDA, and under ``FakeTensorMode``
on device cpu, where full-size models trace without allocating memory.

Categories: a storage is born ``activations`` in the forward phase and ``temporaries`` in the
backward and optimizer phases; it becomes ``gradients`` when autograd accumulates it into a
parameter's ``.grad`` and ``optimizer`` when it is found in the optimizer's state after a step.
The bytes still alive at the end of forward that were born in forward are what autograd saved.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten

from memplan.errors import raise_if_interrupted
from memplan.measure.timeline import CATEGORIES
from memplan.units import PHASES


@dataclass
class PhasePeak:
    """The largest total seen in one phase of one step, with its breakdown."""

    total_bytes: int = 0
    by_category: dict[str, int] = field(default_factory=dict)
    op_index: int = -1


@dataclass
class TimelinePoint:
    op_index: int
    step: int
    phase: str
    total_bytes: int
    by_category: dict[str, int]
    op: str = ""
    time_s: float = 0.0  # time.perf_counter() when recorded


def _storages(obj: Any) -> list[torch.UntypedStorage]:
    out: list[torch.UntypedStorage] = []
    for leaf in _tensors(obj, []):
        out += [t.untyped_storage() for t in _held(leaf)]
    return out


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors among ``tree_flatten(obj)``'s leaves, in its order, without building its
    spec: lists, tuples (named ones and ``torch.return_types`` too) and dicts (values) walked
    here, any other container pytree knows handed to ``tree_flatten``. An operator's
    arguments are these containers; the walk runs twice per operator the tracker sees."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors(x, out)
    elif type(obj) in SUPPORTED_NODES:
        out += [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]
    return out


def _held(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``t``'s memory: ``_local`` of it, or of a DTensor's local shard
    that is torchao's ``Float8TrainingTensor`` its float8 data and scale (an op on one, such
    as tensor parallelism's float8 all-gather, ``float8_ops.allgather_fp8``, runs on
    ``_data`` below this mode and returns a new wrapper around the result)."""
    local = _local(t)
    if local is not None and not _is_wrapper(local):
        return [local]
    # a DTensor whose local shard is itself a wrapper (torchao's float8 tensor under its TP
    # styles): the wrapper's own storage is empty metadata of the high-precision size, so
    # the memory is its data and scale's
    inner = local if local is not None else t
    data, scale = getattr(inner, "_data", None), getattr(inner, "_scale", None)
    if isinstance(data, torch.Tensor) and isinstance(scale, torch.Tensor):
        return [x for part in (data, scale) for x in _held(part)]
    return [local] if local is not None else []


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor holding memory: a DTensor's local shard; None for other wrapper subclasses."""
    if not _is_wrapper(t):
        return t
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else None


def _is_wrapper(t: torch.Tensor) -> bool:
    # DTensor holds its memory in an inner local tensor; the ops DTensor runs on it happen below
    # this mode, so the tracker reads the local tensor of every DTensor it sees instead.
    return type(t) not in (torch.Tensor, torch.nn.Parameter) and not _is_fake(t)


def _is_fake(t: torch.Tensor) -> bool:
    if not _FAKE:  # imported once, on first use: its import statement cost more than the check
        from torch._subclasses.fake_tensor import FakeTensor

        _FAKE.append(FakeTensor)
    return isinstance(t, _FAKE[0])


_FAKE: list[type] = []


class MemoryTracker(TorchDispatchMode):
    """Count live storages by category; record per-phase peaks and an optional timeline."""

    def __init__(self, *, timeline: bool = False) -> None:
        super().__init__()
        self._live: dict[int, list[Any]] = {}  # id(storage) -> [nbytes, category, weakref]
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.total_bytes = 0
        self.high_water_bytes = 0  # the most total_bytes since take_high_water()
        self.step = 0
        self.phase = "forward"
        self.op_index = 0
        self.peaks: dict[tuple[int, str], PhasePeak] = {}
        self.keep_timeline = timeline
        self.timeline: list[TimelinePoint] = []

    # --- bookkeeping -----------------------------------------------------------------------
    def _add(self, st: torch.UntypedStorage, category: str) -> None:
        key = id(st)
        entry = self._live.get(key)
        if entry is not None:
            self._resize(entry, st.nbytes())
            return
        nbytes = st.nbytes()
        ref = weakref.ref(st, lambda _r, k=key: self._drop(k))
        self._live[key] = [nbytes, category, ref]
        self.by_category[category] += nbytes
        self.total_bytes += nbytes
        self.high_water_bytes = max(self.high_water_bytes, self.total_bytes)

    def _resize(self, entry: list[Any], nbytes: int) -> None:
        delta = nbytes - entry[0]
        if delta:
            entry[0] = nbytes
            self.by_category[entry[1]] += delta
            self.total_bytes += delta
            self.high_water_bytes = max(self.high_water_bytes, self.total_bytes)

    def _drop(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.by_category[entry[1]] -= entry[0]
            self.total_bytes -= entry[0]

    def relabel(self, tensor: torch.Tensor, category: str) -> None:
        """Move a tensor's storage to ``category`` (counting it if it is new)."""
        local = _local(tensor)
        if local is None:
            return
        st = local.untyped_storage()
        entry = self._live.get(id(st))
        if entry is None:
            self._add(st, category)
            return
        self.move(entry, category)

    def move(self, entry: list[Any], category: str) -> int:
        """Recount a counted storage under ``category``; its bytes if it moved, else 0."""
        if entry[1] == category:
            return 0
        self.by_category[entry[1]] -= entry[0]
        self.by_category[category] += entry[0]
        entry[1] = category
        return entry[0]

    def forget(self, tensor: torch.Tensor) -> None:
        """Stop counting a tensor's storage (memory that would not be on the device)."""
        local = _local(tensor)
        if local is not None:
            self._drop(id(local.untyped_storage()))

    def register(self, tensors: Any, category: str) -> None:
        for leaf in tree_flatten(tensors)[0]:
            if isinstance(leaf, torch.Tensor):
                self.relabel(leaf, category)

    def bytes_in(self, category: str) -> int:
        return self.by_category[category]

    def take_high_water(self) -> int:
        """The most bytes alive at once since the previous call (or the start); restarts the
        count from the bytes alive now (``memplan.monitor`` reads a step's peak so)."""
        high, self.high_water_bytes = self.high_water_bytes, self.total_bytes
        return high

    # --- phases ----------------------------------------------------------------------------
    def set_phase(self, phase: str, step: int | None = None) -> None:
        assert phase in PHASES, phase
        if step is not None:
            self.step = step
        self.phase = phase
        self._record()

    def _record(self, op: str = "") -> None:
        key = (self.step, self.phase)
        peak = self.peaks.get(key)
        if peak is None:
            peak = self.peaks[key] = PhasePeak()
        if self.total_bytes > peak.total_bytes or peak.op_index < 0:
            peak.total_bytes = self.total_bytes
            peak.by_category = dict(self.by_category)
            peak.op_index = self.op_index
        if self.keep_timeline:
            self.timeline.append(TimelinePoint(self.op_index, self.step, self.phase,
                                               self.total_bytes, dict(self.by_category), op,
                                               time.perf_counter()))

    def peak(self, step: int, phase: str) -> PhasePeak:
        return self.peaks[(step, phase)]

    # --- dispatch --------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise_if_interrupted()  # Ctrl-C is taken here, between operators (memplan.errors)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.op_index += 1
        born = "activations" if self.phase == "forward" else "temporaries"
        for st in _storages(out):
            self._add(st, born)
        for st in _storages((args, kwargs)):  # inputs may have been resized in place
            entry = self._live.get(id(st))
            if entry is not None:
                self._resize(entry, st.nbytes())
        self._record(str(func))
        return out


class HostCategories:
    """A ``MemoryTracker`` mixin for FSDP2's ``CPUOffloadPolicy`` on a CPU-only build, where
    the host and the device are the same memory: the totals (and so the phase peaks) count
    the device alone. Host memory is the categories ``HOST``: the sharded weights
    (``parameters``), their gradients (``gradients``) and whatever the optimizer step makes
    (it runs on the host copies: ``optimizer``). ``by_category`` still counts all."""

    HOST = ("parameters", "gradients", "optimizer")
    by_category: dict[str, int]
    phase: str

    @property
    def total_bytes(self) -> int:
        return sum(v for k, v in self.by_category.items() if k not in self.HOST)

    @total_bytes.setter
    def total_bytes(self, value: int) -> None:  # the base class's running sum: derived here
        pass

    def _add(self, st: torch.UntypedStorage, category: str) -> None:
        category = "optimizer" if self.phase == "optimizer" else category
        super()._add(st, category)  # type: ignore[misc]


class CompiledTracker(MemoryTracker):
    """``MemoryTracker`` for steps that run torch.compile'd code (real tensors only).

    A dispatch mode on the stack makes Dynamo run a compiled function eagerly
    (torch/_dynamo/convert_frame.py: "non-infra torch dispatch mode present"), unless the mode
    says it ignores compile internals: then it is off while Dynamo and Inductor compile and on
    while the compiled code runs (``TorchDispatchMode.ignore_compile_internals``), so it sees
    the aten ops Inductor's wrapper calls (extern matmuls, fallbacks). The buffers the wrapper
    allocates for its own kernels bypass the dispatcher (``empty_strided_cpu``,
    ``torch._C._dynamo.guards._empty_strided_cpu``); inside ``inductor_buffers_seen`` they
    are made through ``torch.empty_strided`` instead, which the mode counts."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


@contextlib.contextmanager
def inductor_buffers_seen() -> Iterator[None]:
    """Inductor's CPU buffers made through aten (``CompiledTracker``) while inside; the
    generated modules bind the allocator when they load, so compile inside this context.
    Inside, Inductor compiles as for a GPU and the trackers run the checkpoint inside a
    compiled graph (``memplan.profile.inductor_rules.as_on_gpu``)."""
    from memplan.profile.inductor_rules import as_on_gpu

    guards = torch._C._dynamo.guards
    original = guards._empty_strided_cpu

    def through_aten(size, stride, dtype):
        return torch.empty_strided(size, stride, dtype=dtype, device="cpu")

    guards._empty_strided_cpu = through_aten
    try:
        with as_on_gpu(MemoryTracker):
            yield
    finally:
        guards._empty_strided_cpu = original
