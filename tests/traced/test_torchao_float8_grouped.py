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


def _titan_experts(float8: bool, dim: int, hidden: int, experts: int, rows: int):
    """torchtitan 0.3.0's ``GroupedExperts`` (``models/common/moe.py``: w1 and w3 each a
    grouped matmul over the routed rows, silu(x w1) * (x w3), then w2), bf16 weights, as
    ``Float8GroupedExpertsConverter`` converts it (``quantize_(experts,
    Float8TrainingOpConfig())``) or plain; one forward and backward under fake tensors: the
    bytes alive at each grouped matmul, and the storages saved for backward. The weights
    are counted from the start in both runs (the converted ones by the tensor each wraps)."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization.quant_api import quantize_
    from torchtitan.models.common.moe import GroupedExperts

    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)
        try:
            m = GroupedExperts(GroupedExperts.Config(dim=dim, hidden_dim=hidden,
                                                     num_experts=experts))
        finally:
            torch.set_default_dtype(torch.float32)
        if float8:
            quantize_(m, config=Float8TrainingOpConfig(),
                      filter_fn=lambda mod, _fqn: isinstance(mod, GroupedExperts))
        x = torch.randn(rows, dim, dtype=torch.bfloat16, requires_grad=True)
        counts = torch.full((experts,), rows // experts, dtype=torch.int64)
        tracker = MemoryTracker(timeline=True)
        tracker.register([getattr(p, "_data", p) for p in m.parameters()], "parameters")
        saved: dict[int, int] = {}

        def pack(t):
            st = t.untyped_storage()
            saved[id(st)] = st.nbytes()
            return t

        with tracker:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = m(x, counts)
            tracker.set_phase("backward")
            y.backward(torch.ones_like(y))
    calls = [(p.phase, p.total_bytes) for p in tracker.timeline if "grouped_mm" in p.op]
    return calls, sum(saved.values())


def test_torchtitan_grouped_experts_match_trace(kernels) -> None:
    """torchtitan's experts in float8 against the same experts in bf16: the same bytes saved
    for backward; at each forward grouped matmul (w1, w3: d -> f; w2: f -> d) the float8
    casts (``float8_grouped.forward_bytes``) more; at each weight-gradient matmul of backward
    (w2's first, then w3's, then w1's) the backward's (``float8_grouped.backward_bytes``)."""
    pytest.importorskip("torchtitan.models.common.moe")
    dim, hidden, experts, rows = 128, 256, 4, 512
    plain, plain_saved = _titan_experts(False, dim, hidden, experts, rows)
    f8, f8_saved = _titan_experts(True, dim, hidden, experts, rows)
    assert f8_saved == plain_saved
    assert [p for p, _ in f8] == [p for p, _ in plain] == ["forward"] * 3 + ["backward"] * 6
    mms = [(dim, hidden), (dim, hidden), (hidden, dim)]  # w1, w3, w2 in forward order
    for (_, a), (_, b), (d_in, d_out) in zip(f8[:3], plain[:3], mms):
        assert a - b == float8_grouped.forward_bytes(rows, d_in, d_out, experts)
    grad_weights = [f8[i][1] - plain[i][1] for i in (4, 6, 8)]
    assert grad_weights == [float8_grouped.backward_bytes(rows, d_in, d_out, experts)
                            for d_in, d_out in reversed(mms)]
