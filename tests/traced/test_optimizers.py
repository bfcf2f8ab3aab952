"""The optimizers beyond AdamW and SGD against real training steps of the reference model,
as ``test_ground_truth`` checks torch.optim's: bitsandbytes' 8-bit ones (``--optimizer
adamw8bit|paged-adamw8bit|paged-adamw``), torch.optim.Adafactor and torch.optim.Muon
(beside AdamW).

torch.optim.Adafactor reads values on the host (``step_t.item()``, ``p.norm(2).item()``),
which fake tensors cannot give: it is traced on real CPU tensors, its foreach and for-loop
implementations as they run on CUDA. torch.optim.Muon and AdamW run on fake tensors. Muon's
first step is 0.18% over: the model counts AdamW's states (made at AdamW's step, after
Muon's) beside Muon's temporaries; from the second step on they are there.

What is traced and what is read from code: the optimizer objects are bitsandbytes 0.50.2's
own (``bitsandbytes.optim.AdamW8bit``, ``PagedAdamW8bit``, ``PagedAdamW``), so every state
tensor their ``init_state`` creates (uint8 states, fp32 absmax per block of 256, fp32 states
below ``min_8bit_size``; the 32-bit paged one's fp32 states for every tensor, no maps) and the
quantization maps their constructor makes are measured by the exact tracker. The update kernel
is CUDA code: under fake tensors it runs as a fake op that, like the CUDA implementation,
writes in place and allocates nothing (``memplan.profile.bnb``). Paging exists only on CUDA
(on CPU ``get_state_buffer`` falls back to device tensors, with a warning), and the tiny
model's tensors are all under its 100,000 elements, so the paged optimizers trace the same
states as unpaged ones would (``PagedAdamW``: 8 bytes per parameter element, 108,864 x 8 =
870,912); which states are paged is checked by hand in ``tests/unit/test_optimizer8bit``.

Tiny (2 layers, h 64, f 176, V 128): the embedding and head (8192 elements), q and o (4096)
and gate/up/down (11,264) get 8-bit states; k and v (2048) and the norms (64) keep fp32 ones
(273,984 bytes in all, derived in ``tests/unit/test_optimizer8bit.py``).
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")  # imported before any trace: nothing of its import counted

from memplan.api import make_layout, make_workload  # noqa: E402
from recorded import compare  # noqa: E402 (tests/traced/recorded.py)
from memplan.spec import load_model  # noqa: E402

TOLERANCE_PCT = 1.0
TINY = load_model("tiny")
EXACT = ("params_bytes", "grads_bytes", "optimizer_bytes", "first_step.optimizer_bytes",
         "steady.optimizer_bytes")

GRID = [(opt, precision) for opt in ("adamw8bit", "paged-adamw8bit", "paged-adamw")
        for precision in ("bf16-pure", "bf16-mixed", "fp32")]


@pytest.mark.parametrize(("optimizer", "precision"), GRID,
                         ids=[f"{o}-{p}" for o, p in GRID])
def test_8bit_optimizer_matches_trace(optimizer: str, precision: str) -> None:
    """States and the optimizer phase to the byte; every phase peak within 1%."""
    wl = make_workload(TINY, seq_len=128, micro_batch_size=2, optimizer=optimizer,
                       precision=precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # paged falls back on CPU (see above)
        result = compare(TINY, make_layout(1), wl)
    for name in EXACT:
        row = result.row(name)
        assert row.estimated_bytes == row.measured_bytes, row
    bad = [r for r in result.rows if abs(r.diff_pct) > TOLERANCE_PCT]
    assert not bad, bad


TORCH_GRID = [("adafactor", p, impl) for p in ("bf16-pure", "bf16-mixed", "fp32")
              for impl in ("foreach", "forloop")] + [
    ("muon", p, impl) for p in ("bf16-pure", "bf16-mixed", "fp32")
    for impl in ("foreach", "fused", "forloop")]


@pytest.mark.parametrize(("optimizer", "precision", "impl"), TORCH_GRID,
                         ids=["-".join(case) for case in TORCH_GRID])
def test_torch_optimizer_matches_trace(optimizer: str, precision: str, impl: str) -> None:
    """States to the byte; every phase peak within 1% (the optimizer phase within 0.2%)."""
    wl = make_workload(TINY, seq_len=128, micro_batch_size=2, optimizer=optimizer,
                       precision=precision, optimizer_impl=impl)
    result = compare(TINY, make_layout(1), wl, fake=optimizer != "adafactor")
    for name in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        row = result.row(name)
        assert row.estimated_bytes == row.measured_bytes, row
    for name in ("first_step.optimizer_bytes", "steady.optimizer_bytes"):
        assert abs(result.row(name).diff_pct) < 0.2, result.row(name)
    bad = [r for r in result.rows if abs(r.diff_pct) > TOLERANCE_PCT]
    assert not bad, bad


@pytest.mark.parametrize("name", ["AdamW8bit", "PagedAdamW8bit", "PagedAdamW",
                                  "PagedAdamW32bit"])
def test_8bit_states_of_real_tensors(name: str) -> None:
    """bitsandbytes' own CPU step on real tensors (its CPU kernel runs; its temporaries are
    not the CUDA kernel's, so only the states are compared): a stack of Linear layers around
    the thresholds, 64 x 63 = 4032 elements (fp32 states) with a bias of 64, 64 x 64 = 4096
    and 400 x 250 = 100,000 (8-bit; on CUDA the paged optimizer pages the last). The state
    tensors after one step, the shared quantization maps counted once, equal
    ``Blockwise.states`` of the same shapes; the 32-bit ``PagedAdamW`` (and its alias
    ``PagedAdamW32bit``) ``Paged32.states``: 8 x (4032 + 64 + 4096 + 100,000) = 865,536."""
    import bitsandbytes

    from memplan.model.optimizer import optimizer_policy
    from memplan.workload import Optimizer

    layers = [torch.nn.Linear(63, 64), torch.nn.Linear(64, 64, bias=False),
              torch.nn.Linear(250, 400, bias=False)]
    params = [p for layer in layers for p in layer.parameters()]
    opt = getattr(bitsandbytes.optim, name)(params, lr=1e-4)
    for p in params:
        p.grad = torch.ones_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # paged falls back on CPU
        opt.step()
    seen = {v.data_ptr(): v.numel() * v.element_size() for state in opt.state.values()
            for v in state.values() if isinstance(v, torch.Tensor)}
    policy = optimizer_policy({"AdamW8bit": Optimizer.ADAMW8BIT,
                               "PagedAdamW8bit": Optimizer.PAGED_ADAMW8BIT}.get(
                                   name, Optimizer.PAGED_ADAMW))
    expected = policy.per_tensor.states([tuple(p.shape) for p in params], 4)
    assert sum(seen.values()) == expected.device_bytes + expected.paged_bytes
    if "8bit" not in name:
        assert sum(seen.values()) == 865_536
