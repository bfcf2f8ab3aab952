"""torchtune's chunked cross-entropy compiled (``compile_loss``, ``memplan.model.
chunked_output``) against real training steps of the reference model.

What is traced: the reference model (2 layers, vocabulary 2048, as in
tests/traced/test_torchtune_loss_trace.py) whose final norm's output goes through torchtune
0.6.1's ``TransformerDecoder.chunked_output`` copy and then torchtune's own
``CEWithChunkedOutputLoss`` (8 chunks) after its own ``training.compile_loss``: each chunk's
``compute_cross_entropy`` compiled by Inductor on CPU, partitioned by
``min_cut_rematerialization_partition``. Real tensors (a fake mode makes Dynamo run the loss
eagerly), counted by the exact tracker in its compile-aware form
(``memplan.profile.tracker.CompiledTracker``: it sees the aten ops the compiled code calls and,
rerouted through aten, the buffers Inductor's wrapper allocates for its kernels).

What the partitioner saves per chunk (traced): the chunk's logits as the model returned them
(the graph's input), its labels, and two fp32 numbers per token (``amax`` and the log of the
sum of exponentials): for two sequences of 128 tokens, 256 x 2048 x 2 = 1,048,576 B of bf16
logits and 2 x 256 x 4 = 2,048 B of statistics, where the eager loss saves 256 x 2048 x 4 =
2,097,152 B of fp32 log-softmax. Every phase peak within 1% (all within 0.3%); the saved
activations to the byte. Cases: chunks along the sequence copied (b 2) or views (b 1), an
uneven split (s 100: the last chunk's shape compiles a second graph), fp32 (the chunk is its
own upcast) and full recompute of the layers.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtune")

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
    "b2-s128-recompute": dict(micro_batch_size=2, seq_len=128, precision="bf16-pure",
                              recompute="full"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_torchtune_compiled_loss_matches_trace(case: str) -> None:
    spec = load_model("tiny").model_copy(update={"vocab_size": 2048})
    wl = make_workload(spec, loss_impl="torchtune-chunked", loss_chunks=8, compile_loss=True,
                       **CASES[case])
    result = compare(spec, make_layout(1), wl, fake=False)
    for name in EXACT:
        row = result.row(name)
        assert row.estimated_bytes == row.measured_bytes, row
    bad = [r for r in result.rows if abs(r.diff_pct) > TOLERANCE_PCT]
    assert not bad, bad


def test_partitioner_saves_logits_and_row_statistics() -> None:
    """The saved set of one chunk's compiled cross-entropy, read from the partition Inductor
    makes (``memplan.profile.compiled_trace``'s recording of
    ``min_cut_rematerialization_partition``): 32 tokens (two sequences of 16) of a 2048-word
    vocabulary in bf16: the logits (graph input, 32 x 2048 x 2 = 131,072 B), the labels (graph
    input, 32 x 8 = 256 B), ``amax`` and ``log`` (fp32, 32 x 4 = 128 B each)."""
    import torch.nn.functional as F
    from torchtune.modules.loss import CEWithChunkedOutputLoss
    from torchtune.training import compile_loss

    from memplan.profile.compiled_trace import _record

    torch._dynamo.reset()
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(2048, 64, dtype=torch.bfloat16))
    hidden = torch.randn(2, 128, 64, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 2048, (2, 128))
    loss_fn = compile_loss(CEWithChunkedOutputLoss(8), verbose=False)
    rows: list = []
    module, original, recording = _record(rows)
    module.min_cut_rematerialization_partition = recording
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False):
            logits = [F.linear(c, weight) for c in hidden.chunk(8, dim=1)]
            loss_fn(logits, labels).backward()
    finally:
        module.min_cut_rematerialization_partition = original
        torch._dynamo.reset()
    assert len(rows) == 1  # one graph serves the eight chunks of one shape
    assert sorted((t.dtype, t.size_bytes, t.graph_input) for t in rows[0]) == [
        ("bfloat16", 131_072, True), ("float32", 128, False), ("float32", 128, False),
        ("int64", 256, True)]
    assert sorted(t.op for t in rows[0] if not t.graph_input) == ["aten.amax.default",
                                                                   "aten.log.default"]
