"""The CPU run follows CUDA's autocast policy and kernels (``memplan.profile.cuda_rules``).

Each rule is checked by what autograd saves (a saved-tensor hook records every packed tensor)
and by the dtypes ops return, on small real tensors.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from memplan.profile.cuda_rules import cuda_autocast, cuda_kernels  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32


def _saved(fn) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of every distinct storage autograd saves while ``fn`` runs."""
    seen: dict[int, tuple[torch.dtype, tuple[int, ...]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.setdefault(t.untyped_storage().data_ptr(), (t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return list(seen.values())


def test_fp32_ops_run_in_fp32_under_cuda_autocast() -> None:
    """pow, rsqrt, exp, layer_norm, rms_norm: fp32 on CUDA (AT_FORALL_FP32); CPU's autocast
    leaves them in bf16."""
    x = torch.randn(4, 8, dtype=BF16)
    with torch.autocast("cpu", dtype=BF16):
        assert x.pow(2).dtype == BF16  # the CPU policy this corrects
    with cuda_autocast(BF16):
        assert x.pow(2).dtype == FP32 and (x ** 2).dtype == FP32
        assert torch.rsqrt(x.abs() + 1).dtype == FP32 and x.exp().dtype == FP32
        assert F.layer_norm(x, (8,)).dtype == FP32
        assert F.rms_norm(x, (8,)).dtype == FP32
    assert x.pow(2).dtype == BF16  # outside, nothing changes


def test_softmax_and_sum_get_an_fp32_dtype() -> None:
    """softmax, log_softmax, sum: an fp32 output from the bf16 input (set-dtype rule), no fp32
    copy of the input saved."""
    x = torch.randn(4, 8, dtype=BF16, requires_grad=True)
    with cuda_autocast(BF16):
        assert F.softmax(x, -1).dtype == FP32 and x.sum().dtype == FP32
        assert torch.log_softmax(x, -1).dtype == FP32
        saved = _saved(lambda: F.softmax(x, -1))
    assert saved == [(FP32, (4, 8))]  # softmax saves its output only


def test_linear_saves_casts_and_caches_weight_casts() -> None:
    """Two linears reading one fp32 weight under autocast: each saves a bf16 cast of its input
    (a non-leaf, cast per call), both the one cached bf16 cast of the weight (a leaf that
    requires grad: ``cached_cast`` in autocast_mode.cpp)."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True) * 1.0

    def two_linears() -> None:
        F.linear(x, w)
        F.linear(x, w)

    with cuda_autocast(BF16):
        saved = _saved(two_linears)
    assert sorted(saved, key=str) == sorted([(BF16, (4, 8)), (BF16, (8, 8)), (BF16, (4, 8))],
                                            key=str)
    with cuda_autocast(BF16):
        y = F.linear(x, w)
    assert y.dtype == BF16


def test_cross_entropy_follows_its_decomposition() -> None:
    """On CUDA cross_entropy is not an autocast op: its log_softmax runs in fp32 from the bf16
    logits (saved: the fp32 log-probabilities), nll_loss in fp32. CPU's list casts the logits
    to fp32 first."""
    logits = torch.randn(6, 10, dtype=BF16, requires_grad=True)
    target = torch.randint(0, 10, (6,))
    with cuda_autocast(BF16):
        loss = F.cross_entropy(logits, target)
        saved = _saved(lambda: F.cross_entropy(logits, target))
    assert loss.dtype == FP32
    assert (FP32, (6, 10)) in saved and (BF16, (6, 10)) not in saved


def test_dropout_saves_a_bool_mask() -> None:
    """CUDA's dropout is native_dropout: a bool mask, one byte per element."""
    x = torch.randn(4, 8, requires_grad=True)
    with cuda_kernels():
        saved = _saved(lambda: F.dropout(x, 0.1, True))
        assert F.dropout(x, 0.1, False) is x
    assert saved == [(torch.bool, (4, 8))]


def test_rms_norm_is_the_fused_kernel() -> None:
    """CUDA's fused RMSNorm saves its input, its weight and one fp32 rstd per row; gradients
    agree with the composite."""
    x = torch.randn(3, 4, 8, dtype=BF16, requires_grad=True)
    w = torch.randn(8, dtype=BF16, requires_grad=True)
    with cuda_kernels():
        saved = _saved(lambda: F.rms_norm(x, (8,), w, 1e-6))
        out = F.rms_norm(x, (8,), w, 1e-6)
    assert sorted(saved, key=str) == sorted([(BF16, (3, 4, 8)), (BF16, (8,)),
                                             (FP32, (3, 4, 1))], key=str)
    out.float().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    F.rms_norm(x.float(), (8,), w.float(), 1e-6).sum().backward()
    assert torch.allclose(gx.float(), x.grad.float(), atol=5e-2)
    assert torch.allclose(gw.float(), w.grad.float(), atol=5e-2)


def test_rules_hold_in_a_checkpoints_recomputation() -> None:
    """A checkpointed region reruns in backward without the Python mode stack; the rules are
    function replacements, so the rerun saves what the forward saved (else checkpoint raises
    "trying to save more tensors during recomputation")."""
    from torch.utils.checkpoint import checkpoint

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    norm_w = torch.ones(8, requires_grad=True)

    def region(t: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(F.linear(t, w), (8,), norm_w, 1e-6)
        return F.dropout(F.softmax(h, -1), 0.1, True)

    with cuda_autocast(BF16):
        out = checkpoint(region, x, use_reentrant=False)
        out.float().sum().backward()
    assert x.grad is not None and w.grad is not None and norm_w.grad is not None


def test_rules_are_removed_on_exit() -> None:
    before = (torch.Tensor.pow, F.softmax, F.dropout, torch.cat)
    with cuda_autocast(BF16):
        assert torch.Tensor.pow is not before[0]
    assert (torch.Tensor.pow, F.softmax, F.dropout, torch.cat) == before
