"""Inductor's compiled code on CPU as a GPU would run it, under a memory-tracking dispatch mode.

``as_on_gpu``: the two rules ``memplan.profile.compiled_trace`` traces compiled layers with
(one kernel per scheduler node, ``_kernel_per_node``; a GPU's realization of reused pointwise
values, ``_gpu_realization``; written here again, as that module's records follow its own
copies: tests/traced/recorded.py), so a whole model's compiled step holds the buffers a GPU run
holds and not the CPU backend's (which writes consecutive scheduler nodes into one kernel,
allocating all their outputs first: torchtitan's debugmodel block, 2 layers, float8 tensorwise
under full AC, 2 x 256 tokens, backward 2,703,370 B above the GPU rules' peak, which memplan
matches to 18 B), and ``register``.

With activation checkpointing inside a ``torch.compile``'d region, AOTAutograd's partitioner
wraps each random op it may rerun (SDPA, dropout) in ``run_and_save_rng_state`` in the forward
and its rerun in ``run_with_rng_state`` in the backward (torch/_prims/rng_prims.py). These are
higher-order operators: under a ``TorchDispatchMode`` they run only where the mode's exact
class has a rule (``HigherOrderOperator.dispatch``, torch/_ops.py: ``type(curr_mode) in
python_key_table``), and otherwise raise. The rules here are the operators' CPU kernels run
with the mode on, so the wrapped op's allocations are counted as any other op's.

The generator state the forward saves is a host tensor (``torch.get_rng_state``, made outside
the dispatcher, not counted), as it is on a GPU (``torch.cuda.get_rng_state`` returns a CPU
``ByteTensor``): it costs no device memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _save(mode: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    with mode:
        return torch.get_rng_state(), op(*args, **kwargs)


def _rerun(mode: Any, rng_state: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    current = torch.get_rng_state()
    torch.set_rng_state(rng_state)
    try:
        with mode:
            return op(*args, **kwargs)
    finally:
        torch.set_rng_state(current)


def register(base: type) -> None:
    """The two rules for ``base`` and every subclass of it defined by now (the lookup is by
    exact class); a class that has them already is left as it is."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    todo, seen = [base], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo += cls.__subclasses__()
        if cls not in run_and_save_rng_state.python_key_table:
            run_and_save_rng_state.py_impl(cls)(_save)
        if cls not in run_with_rng_state.python_key_table:
            run_with_rng_state.py_impl(cls)(_rerun)


@contextlib.contextmanager
def as_on_gpu(tracker: type) -> Iterator[None]:
    """Inside: Inductor compiles with a GPU's kernel and realization rules, and ``tracker``'s
    classes run the checkpoint's random-state operators (``register``)."""
    register(tracker)
    with _kernel_per_node(), _gpu_realization():
        yield


@contextlib.contextmanager
def _replaced(targets: list[tuple[type, str]], wrap: Any) -> Iterator[None]:
    """Each ``(class, attribute)`` of ``targets`` replaced by ``wrap(original)`` inside."""
    originals = [getattr(cls, name) for cls, name in targets]
    for (cls, name), original in zip(targets, originals, strict=True):
        setattr(cls, name, wrap(original))
    try:
        yield
    finally:
        for (cls, name), original in zip(targets, originals, strict=True):
            setattr(cls, name, original)


def _kernel_per_node() -> contextlib.AbstractContextManager[None]:
    """One kernel per scheduler node: the C++ backend groups consecutive nodes into one
    kernel call until an extern kernel flushes the group (``CppScheduling.codegen_node``),
    every output allocated before the call; a GPU backend launches each node on its own
    (``SIMDScheduling.codegen_node``). Flushed after each node, the CPU run allocates and
    frees as a GPU run does (the rule ``compiled_trace.compiled_layer_step`` traces
    layers with, kept there beside its records)."""
    from torch._inductor.codegen import cpp

    def flushed(original: Any) -> Any:
        def codegen_node(self: Any, node: Any) -> None:
            original(self, node)
            self._set_flush_status(True)
        return codegen_node

    return _replaced([(cpp.CppScheduling, "codegen_node")], flushed)


def _gpu_realization() -> contextlib.AbstractContextManager[None]:
    """A GPU's choice of which reused pointwise values become buffers: the lowering's three
    decisions (torch/_inductor/ir.py ``StorageBox.should_realize_on_reuse``,
    ``has_exceeded_max_reads``, ``Loops.has_large_inner_fn``) read ``is_cpu`` to pick the
    CPU's thresholds (a value with a "heavy" op realized, other read and op counts); here
    ``is_cpu`` is false inside those three alone (the rule of
    ``compiled_trace.compiled_layer_step(gpu_realize=True)``)."""
    from torch._inductor import ir

    def as_gpu(original: Any) -> Any:
        def decide(*args: Any, **kwargs: Any) -> Any:
            is_cpu, ir.is_cpu = ir.is_cpu, lambda *_: False
            try:
                return original(*args, **kwargs)
            finally:
                ir.is_cpu = is_cpu
        return decide

    return _replaced([(ir.StorageBox, "should_realize_on_reuse"),
                      (ir.StorageBox, "has_exceeded_max_reads"),
                      (ir.Loops, "has_large_inner_fn")], as_gpu)
