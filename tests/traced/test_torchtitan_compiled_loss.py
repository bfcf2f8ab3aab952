"""torchtitan's cross-entropy compiled whole (``compile_loss`` with ``loss_impl torchtitan``,
``memplan.model.head``) against real training steps of the reference model.

What is traced: the reference model (2 layers, vocabulary 2048) whose logits go to
torchtitan's ``cross_entropy_loss`` (``F.cross_entropy(pred.flatten(0, 1).float(),
labels.flatten(0, 1))``, torchtitan/components/loss.py at e7c0cae, the commit of the
published H200 float8 run) under ``torch.compile``, as ``build_cross_entropy_loss`` wraps it
when the job compiles: Inductor on CPU, partitioned by ``min_cut_rematerialization_partition``.
Real tensors, counted by ``memplan.profile.tracker.CompiledTracker`` (the buffers Inductor's
wrapper allocates included).

What the partitioner saves (traced): the logits as the head returned them (the graph's input)
and two fp32 numbers per token (the row max and the log-sum-exp), with the labels and the
count of labels as an fp32 scalar; for two sequences of 128 tokens 256 x 2048 x 2 = 1,048,576 B of bf16
logits and 2,048 B of statistics, where the eager loss saves 2,097,152 B of fp32
log-softmax.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memplan.api import make_layout, make_workload  # noqa: E402
from memplan.profile.compare import compare  # noqa: E402
from memplan.spec import load_model  # noqa: E402

TOLERANCE_PCT = 1.0
EXACT = ("params_bytes", "grads_bytes", "activations_bytes")

CASES = {
    "b2-s128-bf16-pure": dict(micro_batch_size=2, seq_len=128, precision="bf16-pure"),
    "b1-s64-bf16-pure": dict(micro_batch_size=1, seq_len=64, precision="bf16-pure"),
    "b2-s128-fp32": dict(micro_batch_size=2, seq_len=128, precision="fp32"),
    "b2-s128-recompute": dict(micro_batch_size=2, seq_len=128, precision="bf16-pure",
                              recompute="full"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_torchtitan_compiled_loss_matches_trace(case: str) -> None:
    spec = load_model("tiny").model_copy(update={"vocab_size": 2048})
    wl = make_workload(spec, loss_impl="torchtitan", compile_loss=True, **CASES[case])
    result = compare(spec, make_layout(1), wl, fake=False)
    for name in EXACT:
        row = result.row(name)
        assert row.estimated_bytes == row.measured_bytes, row
    bad = [r for r in result.rows if abs(r.diff_pct) > TOLERANCE_PCT]
    assert not bad, bad
