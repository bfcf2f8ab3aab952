"""torchtune's chunked output and CEWithChunkedOutputLoss (``loss_impl torchtune-chunked``,
``memplan.model.chunked_output``), by hand.

llama-3.1-8b (h 4096, V 128,256, untied), bf16-pure, one GPU, micro-batch 2 x 2048 (T 4096),
8 chunks of 256 tokens of each sequence: c = 512 tokens. Per chunk: L = c V 4 = 262,668,288
(its fp32 log-softmax output, or a gradient of it), G = c V 2 = 131,334,144 (the logits'
gradient in bf16), I = c h 2 = 4,194,304 (its input gradient); the head's weight gradient
W = V h 2 = 1,050,673,152. All logits in bf16: T V 2 = 1,050,673,152; in fp32 T V 4 =
2,101,346,304.
"""

from __future__ import annotations

import pytest

from memplan.api import estimate
from memplan.errors import MemplanError
from memplan.model import chunked_output, head
from memplan.model.dims import Dims

L, G, I, W = 262_668_288, 131_334_144, 4_194_304, 1_050_673_152
ALL_BF16 = 1_050_673_152
ALL_FP32 = 2 * ALL_BF16


def _setup(**kw):
    est = estimate("llama-3.1-8b", precision="bf16-pure", micro_batch_size=2, seq_len=2048,
                   loss_impl="torchtune-chunked", loss_chunks=8, **kw)
    return est, Dims.of(est.spec, est.parallel, est.workload)


def test_saved_terms() -> None:
    """Saved: the fp32 log-softmax of every token (T V 4), the targets (T x 8 = 32,768) and,
    with two sequences, their chunks' copies (32,768); scalars: the loss and 8 total weights
    in fp32, the int64 label count: 9 x 4 + 8 = 44."""
    est, dm = _setup()
    terms = {t.name: t.size_bytes for t in head.head_terms(est.spec, est.workload, dm)}
    assert terms["loss.log_softmax"] == ALL_FP32
    assert terms["loss.targets"] == 32_768
    assert terms["loss.label_chunks"] == 32_768
    assert terms["loss.scalars"] == 44


def test_forward_extra() -> None:
    """At the last chunk's log-softmax: every chunk's bf16 logits (T V 2) and that chunk's
    fp32 upcast (L): 1,050,673,152 + 262,668,288 = 1,313,341,440."""
    est, dm = _setup()
    assert head.forward_extra_bytes(est.spec, est.workload, dm) == 1_313_341_440


def test_backward_peak_is_the_summed_weight_gradient() -> None:
    """Every chunk's loss backward runs first: the first one holds 2L = 525,336,576 beside all
    saved; after them the log-softmax outputs (T V 4) are freed and every G (T V 2) waits:
    T V 2 less than saved. The second projection's weight gradient is summed with the first's
    (3 W) once both chunks' G are freed (the chunks' inputs are copies, freed with their
    gradients' making): 3 W - T V 2 - 2 G = 3,152,019,456 - 1,050,673,152 - 262,668,288 =
    1,838,678,016. After the last chunk, beside the final norm's saved terms: 3 W."""
    est, dm = _setup()
    assert chunked_output.loss_backward_bytes(est.spec, est.workload, dm, W) == 1_838_678_016
    assert chunked_output.linear_backward_bytes(est.spec, est.workload, dm, W) == 3 * W


def test_one_sequence_keeps_the_input_gradients() -> None:
    """One sequence of 4096 (chunks of c = 512 tokens, views of the final norm's output): the
    two chunks' input gradients (2 I) wait beside the sum: 1,838,678,016 + 8,388,608 =
    1,847,066,624."""
    est = estimate("llama-3.1-8b", precision="bf16-pure", micro_batch_size=1, seq_len=4096,
                   loss_impl="torchtune-chunked", loss_chunks=8)
    dm = Dims.of(est.spec, est.parallel, est.workload)
    assert chunked_output.loss_backward_bytes(est.spec, est.workload, dm, W) == 1_847_066_624
    terms = {t.name for t in head.head_terms(est.spec, est.workload, dm)}
    assert "loss.label_chunks" not in terms  # one sequence: the chunks are views


def test_autocast_is_refused() -> None:
    with pytest.raises(MemplanError, match="torchtune-chunked"):
        estimate("tiny", precision="amp-bf16", loss_impl="torchtune-chunked", loss_chunks=8)


def test_checkpointed_chunks_unchanged() -> None:
    """``loss_chunks`` alone still means checkpointed chunks: no log-softmax saved."""
    est = estimate("llama-3.1-8b", precision="bf16-pure", micro_batch_size=2, seq_len=2048,
                   loss_chunks=8)
    dm = Dims.of(est.spec, est.parallel, est.workload)
    assert est.workload.loss_checkpointed
    assert "loss.log_softmax" not in {t.name for t in head.head_terms(est.spec, est.workload,
                                                                      dm)}


def test_compiled_saved_terms() -> None:
    """``compile_loss``: each chunk saves its bf16 logits and two fp32 numbers per token (the
    row max and the log of the sum of exponentials): T V 2 = 1,050,673,152 and 2 x 4096 x 4
    = 32,768, no log-softmax; scalars: the loss and the label count, 4 + 8 = 12 (no total
    weight is saved)."""
    est, dm = _setup(compile_loss=True)
    terms = {t.name: t.size_bytes for t in head.head_terms(est.spec, est.workload, dm)}
    assert "loss.log_softmax" not in terms
    assert terms["loss.logits"] == ALL_BF16
    assert terms["loss.row_stats"] == 32_768
    assert terms["loss.label_chunks"] == 32_768
    assert terms["loss.scalars"] == 12


def test_compiled_forward_extra() -> None:
    """Compiled, the forward's worst beyond all saved is the last chunk's projection: the
    final norm's output (T h 2 = 33,554,432; the chunks' inputs are copies) less what the
    loss has not made yet (statistics 32,768, labels' copies 32,768, scalars 12):
    33,488,884."""
    est, dm = _setup(compile_loss=True)
    assert head.forward_extra_bytes(est.spec, est.workload, dm) == 33_488_884


def test_compiled_backward() -> None:
    """Compiled, each chunk's backward makes G and frees its saved bf16 logits (G's size):
    G beside all saved, nothing freed net. Then the projections as eagerly: the second
    chunk's weight gradient summed (3 W) once two G are freed: 3 W - 2 G = 3,152,019,456 -
    262,668,288 = 2,889,351,168 (the first projection, I + W = 1,054,867,456, is less)."""
    est, dm = _setup(compile_loss=True)
    assert chunked_output.loss_backward_bytes(est.spec, est.workload, dm, W) == 2_889_351_168


def test_compile_loss_needs_the_torchtune_loss() -> None:
    with pytest.raises(MemplanError, match="compile_loss with loss_impl generic"):
        estimate("llama-3.1-8b", precision="bf16-pure", compile_loss=True)


def test_frozen_head_makes_no_weight_gradient() -> None:
    """With LoRA the output projection is frozen: its backward makes the chunks' input
    gradients only, no weight gradient to sum (autograd's mm makes mat2's gradient only when
    it requires grad). The loss's backward peaks at the first chunk's two fp32 gradients,
    2L = 525,336,576; the projection's adds nothing beyond what is saved."""
    est, dm = _setup(lora_rank=8, lora_targets="q,v")
    block = head.HeadBlock.of(est.spec, est.workload, dm)
    assert block.loss == 525_336_576
    assert block.linear == 0
