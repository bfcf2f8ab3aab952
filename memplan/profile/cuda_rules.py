"""Run on CPU what a CUDA build runs: its autocast policy and the kernels it dispatches to.

A CPU trace gives a GPU's bytes only where the CPU build does what the CUDA build does. Where
they differ, this module makes the CPU run follow CUDA, one rule per difference, each named
with its source in PyTorch (torch 2.13; the autocast lists are the device-generic macros of
``aten/src/ATen/autocast_mode.h``, which CUDA registers and CPU does not use):

Autocast (``cuda_autocast``): CPU autocast casts the same matmul-like ops to the low dtype as
CUDA does (``linear``, ``matmul``, ``mm``, ``bmm``, ``addmm``, ``baddbmm``,
``scaled_dot_product_attention``, convolutions: ``AT_FORALL_LOWER_PRECISION_FP`` on CUDA; the
CPU list in ``autocast_mode.cpp`` has them too), with the same cache of weight casts, so it
runs under ``torch.autocast("cpu")``. On top of it:

- ``AT_FORALL_FP32`` (CUDA only): ``pow``, ``rsqrt``, ``exp``, ``log``, ``reciprocal``,
  ``softplus``, ``layer_norm``, ``rms_norm``, ``group_norm``, ``nll_loss``, ``mse_loss``,
  ``l1_loss``, ``smooth_l1_loss``, ``kl_div``, ``binary_cross_entropy_with_logits``,
  ``cosine_similarity``, ``logsumexp``, ... run in fp32: a low-precision input is cast first.
- ``AT_FORALL_FP32_SET_OPT_DTYPE`` (CUDA only): ``softmax``, ``log_softmax``, ``sum``,
  ``cumsum``, ``cumprod``, ``prod``, ``linalg_vector_norm`` without a ``dtype`` argument get
  ``dtype=torch.float32``: an fp32 output computed from the low-precision input (no copy).
- ``cross_entropy_loss`` is an fp32 op of CPU's list only; on CUDA it is not an autocast op,
  and its decomposition (``log_softmax`` then ``nll_loss``) follows the two rules above.
- ``cat`` and ``stack`` are promote ops of CPU's list only; on CUDA they type-promote inside
  the kernel without casting their inputs first. Both give the promoted dtype; only CPU makes
  the cast copies, so here they run with CPU autocast off.

Kernels (``cuda_kernels``, also active inside ``cuda_autocast``):

- ``F.dropout`` is ``native_dropout`` on CUDA (``aten/src/ATen/native/Dropout.cpp``,
  ``dropout``: fused when the input is on CUDA), which saves a bool mask; on CPU it multiplies by
  a noise tensor in the input dtype.
- ``F.rms_norm`` is ``_fused_rms_norm`` on CUDA (``aten/src/ATen/native/layer_norm.cpp``,
  ``rms_norm_symint``), whose autograd saves the input and an fp32 rstd per row; on CPU it is a
  composite of upcast elementwise ops.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_T = torch.Tensor
LOW = (torch.bfloat16, torch.float16)

# AT_FORALL_FP32 entries as Python calls reach them (functions and tensor methods)
FP32_OPS = frozenset({
    torch.pow, _T.pow, _T.__pow__, torch.rsqrt, _T.rsqrt, torch.exp, _T.exp, torch.log,
    _T.log, torch.log2, _T.log2, torch.log10, _T.log10, torch.log1p, _T.log1p, torch.expm1,
    _T.expm1, torch.reciprocal, _T.reciprocal, torch.acos, _T.acos, torch.asin, _T.asin,
    torch.cosh, _T.cosh, torch.sinh, _T.sinh, torch.tan, _T.tan, torch.erfinv, _T.erfinv,
    torch.logsumexp, _T.logsumexp, F.softplus, F.layer_norm, F.group_norm, F.nll_loss,
    F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
    F.binary_cross_entropy_with_logits, F.cosine_similarity, F.poisson_nll_loss, torch.cdist,
    torch.dist, torch.renorm,
})
# AT_FORALL_FP32_SET_OPT_DTYPE entries: (call, position of its dtype argument or None)
SET_DTYPE_OPS = frozenset({
    F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, _T.softmax, _T.log_softmax,
    torch.sum, _T.sum, torch.cumsum, _T.cumsum, torch.cumprod, _T.cumprod, torch.prod,
    _T.prod, torch.linalg.vector_norm,
})
# CPU-only autocast entries (cross_entropy_loss in CPU's fp32 list; cat, stack promote)
CPU_ONLY = frozenset({torch.cat, torch.stack, torch.concat, torch.concatenate})
# AT_FORALL_LOWER_PRECISION_FP entries CPU's list lacks: cast to the low dtype here (without
# CUDA's cache of weight casts, which only matters when such an op reads a weight directly)
LOW_OPS = frozenset({torch.einsum, torch.mv, _T.mv, torch.addmv, torch.addr, torch.chain_matmul,
                     torch.linalg.multi_dot})


def _low(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in LOW


def _to_fp32(value: Any) -> Any:
    return value.float() if _low(value) else value


def _to_low(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_to_low(v, dtype) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def _any_low(args: tuple, kwargs: dict) -> bool:
    return any(_low(a) for a in args) or any(_low(v) for v in kwargs.values())


class _RMSNorm(torch.autograd.Function):
    """``_fused_rms_norm``'s autograd: saves its input, the weight and an fp32 rstd per row;
    the output in the input's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, dims: int,
                eps: float) -> torch.Tensor:
        reduce = tuple(range(x.dim() - dims, x.dim()))
        mean_sq = x.float().pow(2).mean(dim=reduce, keepdim=True)
        rstd = torch.rsqrt(mean_sq + eps)
        out = (x * rstd).to(x.dtype)
        if weight is not None:
            out = out * weight
        ctx.save_for_backward(x, weight, rstd)
        ctx.reduce = reduce
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        n = math.prod(x.shape[d] for d in ctx.reduce)
        normed = (x * rstd).to(x.dtype)
        weighted = grad * weight if weight is not None else grad
        grad_w = None
        if weight is not None:
            lead = tuple(range(grad.dim() - weight.dim()))
            grad_w = (grad * normed).sum(dim=lead, dtype=torch.float32).to(weight.dtype)
        dot = (weighted * normed).sum(dim=ctx.reduce, keepdim=True, dtype=torch.float32)
        grad_x = (weighted - normed * (dot / n).to(x.dtype)) * rstd.to(x.dtype)
        return grad_x, grad_w, None, None


def fused_rms_norm(x: torch.Tensor, normalized_shape: tuple[int, ...] | list[int] | int,
                   weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm`` as CUDA's fused kernel runs it."""
    dims = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return _RMSNorm.apply(x, weight, dims, eps)


def _cross_entropy_cuda(input: torch.Tensor, target: torch.Tensor, weight=None,
                        size_average=None, ignore_index: int = -100, reduce=None,
                        reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """``cross_entropy_loss`` as CUDA autocast runs it: its ``log_softmax`` in fp32 from the
    low-precision input (set-dtype rule), its ``nll_loss`` in fp32."""
    if label_smoothing:
        raise NotImplementedError("cuda_autocast: cross_entropy with label smoothing")
    dim = 1 if input.dim() > 1 else 0
    logp = torch.log_softmax(input, dim, dtype=torch.float32)
    return F.nll_loss(logp, target, weight=_to_fp32(weight), ignore_index=ignore_index,
                      reduction=reduction)


class CudaDispatch(TorchFunctionMode):
    """The rules of the module docstring; ``autocast``: also those of CUDA's autocast lists
    (used under ``torch.autocast("cpu")``, see ``cuda_autocast``)."""

    def __init__(self, autocast: bool) -> None:
        super().__init__()
        self.autocast = autocast

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return _dropout(*args, **kwargs)
        if func is F.rms_norm:
            if self.autocast and torch.is_autocast_enabled("cpu"):
                args = tuple(_to_fp32(a) for a in args)
                kwargs = {k: _to_fp32(v) for k, v in kwargs.items()}
            return fused_rms_norm(*args, **kwargs)
        if not (self.autocast and torch.is_autocast_enabled("cpu")):
            return func(*args, **kwargs)
        if func is F.cross_entropy:
            with torch.autocast("cpu", enabled=False):
                return _cross_entropy_cuda(*args, **kwargs)
        if func in LOW_OPS:
            low = torch.get_autocast_dtype("cpu")
            args = tuple(_to_low(a, low) for a in args)
            kwargs = {k: _to_low(v, low) for k, v in kwargs.items()}
            return func(*args, **kwargs)
        if func in CPU_ONLY:
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        if func in FP32_OPS and _any_low(args, kwargs):
            args = tuple(_to_fp32(a) for a in args)
            kwargs = {k: _to_fp32(v) for k, v in kwargs.items()}
            return func(*args, **kwargs)
        if func in SET_DTYPE_OPS and args and _low(args[0]) and kwargs.get("dtype") is None \
                and not _dtype_given(func, args):
            kwargs = {**kwargs, "dtype": torch.float32}
            return func(*args, **kwargs)
        return func(*args, **kwargs)


def _dtype_given(func, args: tuple) -> bool:
    """Whether a positional argument already sets the dtype (``F.softmax(x, dim, 3, dtype)``
    is keyword-only in practice; ``Tensor.sum(dim, keepdim, dtype=...)``)."""
    return any(isinstance(a, torch.dtype) for a in args[1:])


def _dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
             inplace: bool = False) -> torch.Tensor:
    if not training or p == 0.0:
        return input
    out = torch.native_dropout(input, p, True)[0]
    if inplace:
        with torch.no_grad():
            input.copy_(out)
        return input
    return out


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    """CUDA's kernel choices (dropout's bool mask, the fused RMSNorm) on a CPU run."""
    with CudaDispatch(autocast=False):
        yield


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """``torch.autocast("cuda", dtype)`` as a CPU run can follow it, with CUDA's kernels."""
    with torch.autocast("cpu", dtype=dtype), CudaDispatch(autocast=True):
        yield
