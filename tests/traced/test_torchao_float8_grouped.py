"""torchao's float8 grouped GEMM for routed experts (``_Float8GroupedMM``, torchao 0.18
``prototype/moe_training/fp8_grouped_mm.py``, what torchtitan's
``Float8GroupedExpertsConverter`` runs) traced on CPU under fake tensors, against
``memplan.model.float8_grouped``: what it saves for backward, and the bytes alive at its
forward and backward matmuls (``memplan.profile.tracker.MemoryTracker``).

What could not run: its four Triton kernels (torchao's ``has_triton()`` is false without a
GPU, and the CPU build's triton does not match the kernels' autotune keys). Each stands in as
the tensors its ``register_fake`` function (the same file as the kernel) allocates: float8
data and fp32 scales of the shapes written there; the rest of the autograd function, its
``_scaled_grouped_mm`` calls (fake kernels of torch) and what it saves and frees, is the real
code.

torchao is not a project dependency; the tests are skipped without it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
fgm = pytest.importorskip("torchao.prototype.moe_training.fp8_grouped_mm")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from memplan.model import float8_grouped  # noqa: E402
from memplan.profile.tracker import MemoryTracker  # noqa: E402

F8 = torch.float8_e4m3fn


def _rowwise_2d(hp, output_dtype=F8, round_scales_to_power_of_2=False):
    # float8_rowwise.py _fake_triton_fp8_rowwise_2d_scale_and_cast
    m, k = hp.shape
    return torch.empty((m, k), dtype=output_dtype), torch.empty((m, 1), dtype=torch.float32)


def _colwise_3d(hp, output_dtype=F8, round_scales_to_power_of_2=False):
    # float8_rowwise.py _fake_triton_fp8_colwise_3d_scale_and_cast
    e, k, n = hp.shape
    data = torch.empty((e, k, n), dtype=output_dtype).as_strided((e, k, n), (k * n, 1, k))
    return data, torch.empty((e, 1, n), dtype=torch.float32)


def _transpose_rhs(hp, output_dtype=F8, round_scales_to_power_of_2=False):
    # float8_rowwise.py triton_fp8_rowwise_3d_transpose_rhs (its fake: the same shapes)
    e, k, n = hp.shape
    data = torch.empty((e, n, k), dtype=output_dtype).as_strided((e, n, k), (n * k, 1, n))
    return data, torch.full((e, k), float("inf"), dtype=torch.float32)


def _colwise_dual(h1, h2, offsets, output_dtype=F8, round_scales_to_power_of_2=False):
    # jagged_float8_scales.py _fake_triton_fp8_per_group_colwise_scales_dual
    k, n1 = h1.shape
    n2, groups = h2.shape[1], offsets.numel()
    return (torch.empty_like(h1, dtype=output_dtype).as_strided(h1.size(), (1, k)),
            torch.empty((n1 * groups,), dtype=torch.float32),
            torch.empty_like(h2, dtype=output_dtype).as_strided(h2.size(), (1, k)),
            torch.empty((n2 * groups,), dtype=torch.float32))


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setattr(fgm, "triton_fp8_rowwise_2d_scale_and_cast", _rowwise_2d)
    monkeypatch.setattr(fgm, "triton_fp8_colwise_3d_scale_and_cast", _colwise_3d)
    monkeypatch.setattr(fgm, "triton_fp8_rowwise_3d_transpose_rhs", _transpose_rhs)
    monkeypatch.setattr(fgm, "triton_fp8_per_group_colwise_scales_dual", _colwise_dual)


@pytest.mark.parametrize(("rows", "d_in", "d_out", "experts"),
                         [(256, 128, 64, 4), (192, 64, 160, 3)])
def test_float8_grouped_mm_matches_trace(kernels, rows, d_in, d_out, experts) -> None:
    e = 2  # bf16
    with FakeTensorMode():
        a = torch.randn(rows, d_in, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(experts, d_out, d_in, dtype=torch.bfloat16, requires_grad=True)
        step = rows // experts
        offs = torch.arange(step, rows + 1, step, dtype=torch.int32)
        saved: list = []
        tracker = MemoryTracker()
        with tracker:
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: saved.append(t) or t, lambda t: t):
                y = fgm._Float8GroupedMM.apply(a, w.transpose(-2, -1), offs, torch.bfloat16,
                                               F8, False)
            tracker.set_phase("backward")
            y.backward(torch.ones_like(y))
    # saved: the input itself and a view of the weight (a bf16 grouped_mm saves the same)
    assert saved[0] is a and saved[1]._base is w
    weight, out, inp = experts * d_in * d_out * e, rows * d_out * e, rows * d_in * e
    # the tracker sees the weight (its transposed view) and none of the input until backward
    forward = tracker.peak(0, "forward").total_bytes
    assert forward - weight - out == float8_grouped.forward_bytes(rows, d_in, d_out, experts)
    # backward: the weight, the output and its gradient, the saved input, grad_A and grad_B
    backward = tracker.peak(0, "backward").total_bytes
    held = weight + 2 * out + inp + inp + weight
    assert backward - held == float8_grouped.backward_bytes(rows, d_in, d_out, experts)
