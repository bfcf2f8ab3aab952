"""torchtune's chunked output and cross-entropy (``loss_impl torchtune-chunked``,
``memplan.model.chunked_output``) against real training steps of the reference model.

What is traced: the reference Llama-like model (RMSNorm, RoPE, GQA, SwiGLU; 2 layers) whose
final norm's output goes through ``ReferenceModel._chunked_output`` and
``memplan.profile.reference.ce_with_chunked_output``, statement-for-statement copies of
torchtune 0.6.1's ``TransformerDecoder.chunked_output`` (torchtune/modules/transformer.py)
and ``CEWithChunkedOutputLoss.forward`` (torchtune/modules/loss/ce_chunked_output_loss.py,
``num_output_chunks=8``): torchtune 0.6.1 itself does not import without torchao, which the
test environment does not have. The model's output list is held while the loss runs and
dropped after it, as the recipe's ``del logits`` does. Fake tensors under the exact tracker.

The tiny model's vocabulary is raised to 2048 so that the logits dominate the head as they
do in real models. Cases: two sequences of 128 (each chunk along the sequence a strided view:
the matmul and nll_loss save copies), one sequence of 64 (chunks of 8 tokens: the summed
weight gradients are the backward's peak), an uneven split (s 100: chunks of 13, the last
9), fp32 (the upcast is the tensor itself), bf16 weights with an fp32 master copy, recompute
full and a tied head. Every phase peak within 1% (all are within 0.05%); the saved
activations to the byte.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memplan.api import make_layout, make_workload  # noqa: E402
from recorded import compare  # noqa: E402 (tests/traced/recorded.py)
from memplan.spec import load_model  # noqa: E402

TOLERANCE_PCT = 1.0
EXACT = ("params_bytes", "grads_bytes", "activations_bytes")

CASES = {
    "b2-s128-bf16-pure": dict(micro_batch_size=2, seq_len=128, precision="bf16-pure"),
    "b1-s64-bf16-pure": dict(micro_batch_size=1, seq_len=64, precision="bf16-pure"),
    "b2-s100-bf16-pure": dict(micro_batch_size=2, seq_len=100, precision="bf16-pure"),
    "b2-s128-fp32": dict(micro_batch_size=2, seq_len=128, precision="fp32"),
    "b1-s64-fp32": dict(micro_batch_size=1, seq_len=64, precision="fp32"),
    "b2-s128-bf16-mixed": dict(micro_batch_size=2, seq_len=128, precision="bf16-mixed"),
    "b2-s128-recompute": dict(micro_batch_size=2, seq_len=128, precision="bf16-pure",
                              recompute="full"),
    "b1-s64-tied": dict(micro_batch_size=1, seq_len=64, precision="bf16-pure", tied=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_torchtune_chunked_loss_matches_trace(case: str) -> None:
    fields = dict(CASES[case])
    tied = fields.pop("tied", False)
    spec = load_model("tiny").model_copy(update={"vocab_size": 2048,
                                                 "tied_embeddings": tied})
    wl = make_workload(spec, loss_impl="torchtune-chunked", loss_chunks=8, **fields)
    result = compare(spec, make_layout(1), wl)
    for name in EXACT:
        row = result.row(name)
        assert row.estimated_bytes == row.measured_bytes, row
    bad = [r for r in result.rows if abs(r.diff_pct) > TOLERANCE_PCT]
    assert not bad, bad
