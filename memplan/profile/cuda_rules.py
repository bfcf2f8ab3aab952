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

The rules are applied by replacing the functions and tensor methods named below for the
duration of the context (and restoring them after), not by a ``TorchFunctionMode``: the autograd
engine runs a checkpointed region's recomputation without the Python mode stack, so a mode would
see the forward but not its rerun in backward (``tests/traced/test_cuda_rules.py``).

Kernels (``cuda_kernels``, also active inside ``cuda_autocast``):

- ``F.dropout`` is ``native_dropout`` on CUDA (``aten/src/ATen/native/Dropout.cpp``,
  ``dropout``: fused when the input is on CUDA), which saves a bool mask; on CPU it multiplies by
  a noise tensor in the input dtype.
- ``F.rms_norm`` is ``_fused_rms_norm`` on CUDA (``aten/src/ATen/native/layer_norm.cpp``,
  ``rms_norm_symint``), whose autograd saves the input and an fp32 rstd per row; on CPU it is a
  composite of upcast elementwise ops.
- ``F.scaled_dot_product_attention`` with a value head narrower than the query/key head
  (MLA: DeepSeek-V3) runs CUDA's memory-efficient kernel, flash needing one head dim for all
  three (``aten/src/ATen/native/transformers/sdp_utils_cpp.h`` ``check_head_dim_size_flash``):
  ``_scaled_dot_product_efficient_attention`` saves q, k, v, its output and an fp32
  logsumexp per query and head, padded to 32 queries (``kAlignLSE``); CPU's flash kernel
  refuses such heads and the math fallback materialises the scores. The aten op is given a
  CPU kernel (``_efficient_forward``, ``_efficient_backward``) and called as CUDA's SDPA
  calls it: its autograd node is aten's own, and an op-level checkpointing policy sees it as
  the one op it is on CUDA (the SDPA family, ``memplan.report.sac_policy``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

_T = torch.Tensor
LOW = (torch.bfloat16, torch.float16)

_FN, _LINALG = F, torch.linalg
# AT_FORALL_FP32 entries, as (owner, attribute) where Python calls reach them
FP32_OPS = (
    *((owner, name) for name in ("pow", "rsqrt", "exp", "log", "log2", "log10", "log1p", "expm1",
                                 "reciprocal", "acos", "asin", "cosh", "sinh", "tan", "erfinv",
                                 "logsumexp") for owner in (torch, _T)),
    (_T, "__pow__"), (torch, "cdist"), (torch, "dist"), (torch, "renorm"),
    *((_FN, name) for name in ("softplus", "layer_norm", "group_norm", "nll_loss", "mse_loss",
                               "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
                               "binary_cross_entropy_with_logits", "cosine_similarity",
                               "poisson_nll_loss")),
)
# AT_FORALL_FP32_SET_OPT_DTYPE entries
SET_DTYPE_OPS = (
    (_FN, "softmax"), (_FN, "log_softmax"), (_LINALG, "vector_norm"),
    *((owner, name) for name in ("softmax", "log_softmax", "sum", "cumsum", "cumprod", "prod")
      for owner in (torch, _T)),
)
# CPU-only autocast entries: cat and stack promote there (cross_entropy_loss has its own rule)
CPU_ONLY = ((torch, "cat"), (torch, "stack"), (torch, "concat"), (torch, "concatenate"))
# AT_FORALL_LOWER_PRECISION_FP entries CPU's list lacks: cast to the low dtype here (without
# CUDA's cache of weight casts, which only matters when such an op reads a weight directly)
LOW_OPS = ((torch, "einsum"), (torch, "mv"), (_T, "mv"), (torch, "addmv"), (torch, "addr"),
           (torch, "chain_matmul"), (_LINALG, "multi_dot"))


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
    """``_fused_rms_norm``'s autograd over the last ``dims`` dimensions, without a weight or
    over several dimensions (the reference model's ``FusedRMSNorm`` covers one dimension with
    a weight): saves its input, the weight and an fp32 rstd per row; its forward allocates its
    output and the per-row statistics only (the reduction accumulates in fp32)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, dims: int,
                eps: float) -> torch.Tensor:
        reduce = tuple(range(x.dim() - dims, x.dim()))
        n = math.prod(x.shape[d] for d in reduce)
        norm = torch.linalg.vector_norm(x, dim=reduce, keepdim=True, dtype=torch.float32)
        rstd = torch.rsqrt(norm.pow(2) / n + eps)
        out = x * rstd.to(x.dtype)
        if weight is not None:
            out.mul_(weight)
        ctx.save_for_backward(x, weight, rstd)
        ctx.reduce, ctx.n = reduce, n
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        r = rstd.to(x.dtype)
        weighted = grad * weight if weight is not None else grad.clone()
        normed = x * r
        grad_w = None
        if weight is not None:
            lead = tuple(range(grad.dim() - weight.dim()))
            grad_w = (grad * normed).sum(dim=lead, dtype=torch.float32).to(weight.dtype)
        dot = (weighted * normed).sum(dim=ctx.reduce, keepdim=True, dtype=torch.float32)
        normed.mul_((dot / ctx.n).to(x.dtype))
        weighted.sub_(normed).mul_(r)
        return weighted, grad_w, None, None


def fused_rms_norm(x: torch.Tensor, normalized_shape: tuple[int, ...] | list[int] | int,
                   weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm`` as CUDA's fused kernel runs it."""
    from memplan.profile.reference import FusedRMSNorm

    dims = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    if weight is not None and dims == 1:
        return FusedRMSNorm.apply(x, weight, eps)
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


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cpu")


def _fp32_rule(orig):
    def run(*args, **kwargs):
        if _autocast_on() and _any_low(args, kwargs):
            args = tuple(_to_fp32(a) for a in args)
            kwargs = {k: _to_fp32(v) for k, v in kwargs.items()}
        return orig(*args, **kwargs)
    return run


def _set_dtype_rule(orig):
    def run(*args, **kwargs):
        if (_autocast_on() and args and _low(args[0]) and kwargs.get("dtype") is None
                and not _dtype_given(args)):
            kwargs = {**kwargs, "dtype": torch.float32}
        return orig(*args, **kwargs)
    return run


def _cpu_only_rule(orig):
    def run(*args, **kwargs):
        if _autocast_on():
            with torch.autocast("cpu", enabled=False):
                return orig(*args, **kwargs)
        return orig(*args, **kwargs)
    return run


def _low_rule(orig):
    def run(*args, **kwargs):
        if _autocast_on():
            low = torch.get_autocast_dtype("cpu")
            args = tuple(_to_low(a, low) for a in args)
            kwargs = {k: _to_low(v, low) for k, v in kwargs.items()}
        return orig(*args, **kwargs)
    return run


def _cross_entropy_rule(orig):
    def run(*args, **kwargs):
        if _autocast_on():
            with torch.autocast("cpu", enabled=False):
                return _cross_entropy_cuda(*args, **kwargs)
        return orig(*args, **kwargs)
    return run


def _rms_norm_rule(orig):
    def run(*args, **kwargs):
        if _autocast_on():  # rms_norm is an fp32 op of CUDA's autocast
            args = tuple(_to_fp32(a) for a in args)
            kwargs = {k: _to_fp32(v) for k, v in kwargs.items()}
        return fused_rms_norm(*args, **kwargs)
    return run


def _dropout_rule(orig):
    return _dropout


LSE_ALIGN = 32  # kAlignLSE, aten/src/ATen/native/transformers/cuda/mem_eff_attention


def _efficient_scores(q: torch.Tensor, k: torch.Tensor, bias, causal: bool,
                      scale: float | None, i: int) -> torch.Tensor:
    """Head ``i``'s fp32 attention probabilities (the kernel's math, one head at a time)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q[:, i].float() @ k[:, i].float().transpose(-1, -2) * scale
    if bias is not None:
        b = bias[:, i] if bias.dim() == 4 and bias.shape[1] > 1 else (
            bias[:, 0] if bias.dim() == 4 else bias)
        scores = (scores.masked_fill(~b, float("-inf")) if b.dtype == torch.bool
                  else scores + b.float())
    if causal:
        s, s_kv = scores.shape[-2], scores.shape[-1]
        keep = torch.ones(s, s_kv, dtype=torch.bool).tril(s_kv - s)
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _efficient_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                       is_causal=False, *, scale=None):
    """``aten._scaled_dot_product_efficient_attention`` on CPU (registered below): what
    CUDA's kernel returns, computed head by head out of the trackers' sight (a backend kernel
    runs below the dispatch modes, as the CUDA kernel's tiles are no tensors): its output
    token-major, ``(B, M, H, Kv)`` returned transposed (attention.cu
    ``_efficient_attention_forward``), and an fp32 logsumexp padded to ``LSE_ALIGN`` queries;
    without dropout the philox seed and offset hold nothing on the device."""
    b, h, s = query.shape[0], query.shape[1], query.shape[2]
    out = query.new_empty(b, s, h, value.shape[-1]).transpose(1, 2)
    rows = -(-s // LSE_ALIGN) * LSE_ALIGN if compute_log_sumexp else 0
    lse = torch.zeros(b, h, rows, dtype=torch.float32)
    for i in range(h):
        scores = _efficient_scores(query, key, attn_bias, is_causal, scale, i)
        out[:, i] = (scores.softmax(-1) @ value[:, i].float()).to(out.dtype)
        if rows:
            lse[:, i, :s] = scores.logsumexp(-1)
    empty = torch.empty(0, dtype=torch.long)
    return out, lse, empty, empty.clone()


def _efficient_backward(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed,
                        philox_offset, dropout_p, grad_input_mask, is_causal=False, *,
                        scale=None):
    """``aten._scaled_dot_product_efficient_attention_backward`` on CPU: the gradients of q,
    k and v (allocated as the inputs are), each head's from its recomputed probabilities."""
    gq, gk, gv = (torch.empty_like(t) for t in (query, key, value))
    scale_ = query.shape[-1] ** -0.5 if scale is None else scale
    for i in range(query.shape[1]):
        p = _efficient_scores(query, key, attn_bias, is_causal, scale, i).softmax(-1)
        do, v = grad_out[:, i].float(), value[:, i].float()
        gv[:, i] = (p.transpose(-1, -2) @ do).to(gv.dtype)
        dp = do @ v.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale_
        gq[:, i] = (ds @ key[:, i].float()).to(gq.dtype)
        gk[:, i] = (ds.transpose(-1, -2) @ query[:, i].float()).to(gk.dtype)
    return gq, gk, gv, torch.empty(0, dtype=query.dtype)


_EFFICIENT_LIB: list = []


def _efficient_kernels() -> None:
    """Registers the CPU kernels of CUDA's memory-efficient attention (once): autograd is
    aten's own (derivatives.yaml: the node saves q, k, v, the bias, the output, the
    logsumexp and the philox seed and offset), and a policy sees the kernel as the one op it
    is on CUDA."""
    if _EFFICIENT_LIB:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_efficient_attention", _efficient_forward, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", _efficient_backward, "CPU")
    _EFFICIENT_LIB.append(lib)


def _sdpa_rule(orig):
    def run(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
        grouped = enable_gqa and key.shape[-3] != query.shape[-3]
        if (query.shape[-1] == value.shape[-1] or dropout_p or grouped
                or not torch.is_grad_enabled()):
            return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if _autocast_on():  # an autocast op of the low-precision list
            low = torch.get_autocast_dtype("cpu")
            query, key, value = (_to_low(t, low) for t in (query, key, value))
        _efficient_kernels()
        with torch.autocast("cpu", enabled=False):
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, True, 0.0, is_causal, scale=scale)[0]
    return run


def _rules(autocast: bool) -> list[tuple[Any, str, Any]]:
    rules = [(_FN, "rms_norm", _rms_norm_rule), (_FN, "dropout", _dropout_rule),
             (_FN, "scaled_dot_product_attention", _sdpa_rule)]
    if autocast:
        rules += [(o, n, _fp32_rule) for o, n in FP32_OPS]
        rules += [(o, n, _set_dtype_rule) for o, n in SET_DTYPE_OPS]
        rules += [(o, n, _cpu_only_rule) for o, n in CPU_ONLY]
        rules += [(o, n, _low_rule) for o, n in LOW_OPS]
        rules.append((_FN, "cross_entropy", _cross_entropy_rule))
    return rules


@contextlib.contextmanager
def _patched(autocast: bool) -> Iterator[None]:
    saved = []
    try:
        for owner, name, rule in _rules(autocast):
            orig = getattr(owner, name)
            saved.append((owner, name, orig))
            setattr(owner, name, rule(orig))
        yield
    finally:
        for owner, name, orig in reversed(saved):
            setattr(owner, name, orig)


def _dtype_given(args: tuple) -> bool:
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
    with _patched(autocast=False):
        yield


@contextlib.contextmanager
def autocast_rules() -> Iterator[None]:
    """CUDA's autocast rules and kernels wherever CPU autocast is on, without turning it on:
    kept around a whole training step, they also apply when a checkpointed region reruns in
    backward under the autocast state it saved (``torch.utils.checkpoint``)."""
    with _patched(autocast=True):
        yield


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """``torch.autocast("cuda", dtype)`` as a CPU run can follow it, with CUDA's kernels."""
    with torch.autocast("cpu", dtype=dtype), _patched(autocast=True):
        yield
