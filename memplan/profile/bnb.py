"""bitsandbytes' 8-bit optimizers in a trace (``memplan.profile.trace``), on any device.

The optimizer objects are bitsandbytes' own: their ``init_state`` creates every state tensor
(``memplan.model.optimizer.Blockwise``), which the tracker sees. Their update runs through the
``bitsandbytes::optimizer_update_8bit_blockwise`` op; its CUDA implementation
(``_optimizer_update_8bit_blockwise_impl`` in ``bitsandbytes/backends/cuda/ops.py``) passes
pointers to one kernel that writes the parameter and the states in place and allocates
nothing. Fake tensors need a fake implementation of the op, registered here as exactly that:
no output, no allocation. (bitsandbytes registers one for ``optimizer_update_32bit``, which
tensors under ``min_8bit_size`` use; its CPU implementation of the 8-bit update,
``_optimizer_update_8bit_blockwise_cpu``, dequantizes to fp32 temporaries that the CUDA kernel
does not make, so a trace on real CPU tensors measures the states but not the CUDA step.)
Fake tensors also hold no values for ``create_dynamic_map`` to compute the quantization maps
from: under fake tensors each map is an empty tensor of the real map's shape and dtype (256
fp32 values, computed outside the trace), created where bitsandbytes creates it.
"""

from __future__ import annotations

import contextlib
import importlib
from functools import cache
from unittest import mock

import torch

_OP = "bitsandbytes::optimizer_update_8bit_blockwise"


@cache
def _register_fake_update() -> None:
    """A fake kernel for the 8-bit update: in place, nothing allocated (as on CUDA)."""
    importlib.import_module("bitsandbytes")  # defines the op

    def _update_in_place(*args, **kwargs) -> None:
        return None

    try:
        torch.library.register_fake(_OP)(_update_in_place)
    except RuntimeError:  # a bitsandbytes that registers its own fake kernel for it
        pass


@cache
def _map_layout(signed: bool) -> tuple[torch.Size, torch.dtype]:
    """Shape and dtype of the real quantization map (``create_dynamic_map``)."""
    from bitsandbytes import functional
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # neither fake nor seen by the tracker
        real = functional.create_dynamic_map(signed=signed)
    return real.shape, real.dtype


def _empty_map(signed: bool = True, **_: object) -> torch.Tensor:
    shape, dtype = _map_layout(signed)
    return torch.empty(shape, dtype=dtype)


def bnb_optimizer(dotted: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The bitsandbytes optimizer ``dotted`` (``bitsandbytes.optim.AdamW8bit``) over
    ``params``, with its default arguments (``min_8bit_size=4096``)."""
    from torch._subclasses.fake_tensor import is_fake

    module, name = dotted.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    _register_fake_update()
    fake = any(is_fake(p) for p in params)
    if fake:  # the real maps' layouts, before create_dynamic_map is replaced
        _map_layout(True), _map_layout(False)
    with (mock.patch("bitsandbytes.functional.create_dynamic_map", _empty_map) if fake
          else contextlib.nullcontext()):
        return cls(params, lr=1e-4)
