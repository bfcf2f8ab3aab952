"""Activation offloading traced on a CPU-only build: ``torch.autograd.graph.save_on_cpu`` as
it runs on a GPU, with the exact tracker counting what stays on the "device".

On a CPU-only build ``save_on_cpu``'s ``pack_to_cpu`` (``tensor.cpu()``) returns the tensor
itself and ``unpack_from_cpu`` (``tensor.to(device)``) too, so nothing would move. ``HostSaved``
runs the same two hooks with the host side made real: ``pack`` copies every tensor autograd
saves (parameters and views included, as ``pack_to_cpu`` does) into a new tensor made outside
every dispatch mode, so memplan's tracker (``memplan.profile.tracker``, a ``TorchDispatchMode``)
never sees it: it is host memory; the device tensor is then held by nobody but the forward's
own references, exactly as on a GPU. ``unpack`` makes the device copy ``tensor.to(device)``
makes, a ``clone`` the tracker counts, alive while the autograd node that reads it runs.
``host_bytes`` sums what was packed in a step (the host's pinned or pageable copies).

The hooks wrap each decoder layer (a forward pre-hook enters them, a forward hook leaves):
the layers' saved tensors are offloaded, the embedding's, final norm's, head's and loss's stay
(``memplan.model.offload.saved_on_host``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes


class HostSaved:
    """``save_on_cpu(pin_memory=...)``'s pack and unpack hooks with a real host side."""

    def __init__(self) -> None:
        self.host_bytes = 0  # packed in the current step
        self.packed = 0  # tensors packed in the current step

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():  # host memory: no tracker sees it
            host = torch.empty(tensor.size(), dtype=tensor.dtype)
            host.copy_(tensor)
        self.host_bytes += host.numel() * host.element_size()
        self.packed += 1
        return host

    def unpack(self, host: torch.Tensor) -> torch.Tensor:
        return host.clone()  # the device copy ``host.to(device)`` makes

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


@contextlib.contextmanager
def offload_layers(layers: Iterable[torch.nn.Module], saved: HostSaved) -> Iterator[None]:
    """Run each of ``layers``' forwards under ``saved``'s hooks while the context is open."""
    stack: list[contextlib.AbstractContextManager] = []

    def enter(module, args):
        ctx = saved.hooks()
        ctx.__enter__()
        stack.append(ctx)

    def leave(module, args, output):
        stack.pop().__exit__(None, None, None)

    handles, checkpointed = [], []
    for layer in layers:
        if getattr(layer, "gradient_checkpointing", False):
            # transformers' GradientCheckpointingLayer: the hooks go around its checkpoint, as
            # save_on_cpu around the model's forward would be (the checkpoint's inputs packed,
            # its rerun saving on the device under the checkpoint's own hooks)
            run = layer._gradient_checkpointing_func
            checkpointed.append((layer, run))
            layer._gradient_checkpointing_func = _under(saved, run)
            continue
        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for layer, run in checkpointed:
            layer._gradient_checkpointing_func = run


def _under(saved: HostSaved, run):
    def call(*args, **kwargs):
        with saved.hooks():
            return run(*args, **kwargs)
    return call
