"""The optimizer stepped in backward (``--optimizer-in-backward``, ``memplan.model.
step_in_backward``) against real training steps of the reference model: one optimizer per
parameter, stepped and zeroed in its post-accumulate-grad hook as torchtune's
``register_optim_in_bwd_hooks`` (torchtune/training/memory.py) registers it
(``memplan.profile.trace._InBackward``), on fake tensors (bitsandbytes' update kernel as the
fake op ``memplan.profile.bnb`` makes it). Every phase peak within 1%, step 1 (whose states
are made one parameter at a time during backward) and the steady state; states and gradients
to the byte.

bitsandbytes' per-optimizer quantization maps: its constructor makes them on the host,
``init_state`` moves them to the device of a tensor with 8-bit states; the trace does not
count the host ones. What is left is 128 bytes that bitsandbytes allocates per run beside
them (0.01%)."""

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
EXACT = ("params_bytes", "grads_bytes", "optimizer_bytes")

GRID = [
    ("adamw", "bf16-pure", "foreach", "none", "flash"),
    ("adamw", "bf16-pure", "forloop", "none", "flash"),
    ("adamw", "bf16-pure", "foreach", "full", "flash"),
    ("adamw", "fp32", "foreach", "full", "eager"),
    ("adamw", "amp-bf16", "foreach", "selective", "flash"),
    ("sgd", "bf16-pure", "foreach", "none", "flash"),
    ("adamw8bit", "bf16-pure", "foreach", "none", "flash"),
    ("paged-adamw8bit", "bf16-pure", "foreach", "full", "flash"),
]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(("optimizer", "precision", "impl", "recompute", "attention"), GRID,
                         ids=["-".join(case) for case in GRID])
def test_optimizer_in_backward_matches_trace(optimizer: str, precision: str, impl: str,
                                             recompute: str, attention: str,
                                             tied: bool) -> None:
    """``tied``: the head shares the embedding's weight, whose hook runs once, after the
    embedding's backward (tiny's own head is untied)."""
    spec = TINY.model_copy(update={"tied_embeddings": tied})
    wl = make_workload(spec, seq_len=128, micro_batch_size=2, optimizer=optimizer,
                       precision=precision, optimizer_impl=impl, recompute=recompute,
                       attention=attention, optimizer_in_backward=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # paged falls back on CPU
        result = compare(spec, make_layout(1), wl)
    for name in EXACT:
        row = result.row(name)
        assert row.estimated_bytes == row.measured_bytes, row
    assert result.row("grads_bytes").measured_bytes == 0  # no gradient left after backward
    bad = [r for r in result.rows if abs(r.diff_pct) > TOLERANCE_PCT]
    assert not bad, bad
