"""torchtitan's cross-entropy compiled (``compile_loss`` with ``loss_impl torchtitan``:
``memplan.model.head`` whole, on whole or vocabulary-split logits; ``memplan.model.loss_in_call``
per chunk of the ``ChunkedLossWrapper``), by hand.

llama-3.1-8b (h 4096, V 128,256, untied), bf16-pure, one GPU, micro-batch 2 x 2048
(T 4096): the logits in bf16 T V 2 = 1,050,673,152, in fp32 2,101,346,304.
"""

from __future__ import annotations

import pytest

from memplan.api import estimate
from memplan.errors import MemplanError
from memplan.model import head, loss_in_call
from memplan.model.dims import Dims

ALL_BF16 = 1_050_673_152


def _setup(**kw):
    est = estimate("llama-3.1-8b", precision="bf16-pure", micro_batch_size=2, seq_len=2048,
                   loss_impl="torchtitan", **kw)
    return est, Dims.of(est.spec, est.parallel, est.workload)


def test_compiled_saved_terms() -> None:
    """Saved: the bf16 logits (the graph's input, T V 2) and two fp32 per token, the row max
    and the log-sum-exp (2 x 4096 x 4 = 32,768), no fp32 log-softmax (eagerly T V 4); the
    targets (T x 8 = 32,768) and two fp32 scalars (the loss and the label count the mean
    divides by: 8)."""
    est, dm = _setup(compile_loss=True)
    terms = {t.name: t.size_bytes for t in head.head_terms(est.spec, est.workload, dm)}
    assert "loss.log_softmax" not in terms
    assert terms["loss.logits"] == ALL_BF16
    assert terms["loss.row_stats"] == 32_768
    assert terms["loss.targets"] == 32_768
    assert terms["loss.scalars"] == 8
    eager, dm = _setup()
    eager_terms = {t.name: t.size_bytes for t in head.head_terms(eager.spec, eager.workload, dm)}
    assert eager_terms["loss.log_softmax"] == 2 * ALL_BF16


def test_compiled_forward_and_backward() -> None:
    """Forward: the kernels make the fp32 loss (4 bytes) beside what is saved, where the eager
    loss holds the fp32 logits (T V 4) and the model's bf16 output (T V 2) beside its saved
    log-softmax. Backward: one kernel makes the logits' gradient in bf16 (T V 2), where the
    eager loss holds two fp32 logits-sized gradients (2 T V 4)."""
    est, dm = _setup(compile_loss=True)
    assert head.forward_extra_bytes(est.spec, est.workload, dm) == 4
    assert head.loss_backward_bytes(est.spec, est.workload, dm, 0) == ALL_BF16
    eager, dm = _setup()
    assert head.loss_backward_bytes(eager.spec, eager.workload, dm, 0) == 4 * ALL_BF16


def test_compiled_under_loss_parallel() -> None:
    """At tp 2 (V / 2 = 64,128 a rank, T V / 2 = 262,668,288 elements) the graph holds
    ``_LossParallelCrossEntropy`` (0.3's components/loss.py): saved, the fp32 softmax less the
    one-hot targets, T V / 2 x 4 = 1,050,673,152, and the out-of-shard mask, T = 4,096 B,
    no log-probabilities and no logits; beside them in forward the bf16 logits (the graph's
    input, 525,336,576), the fp32 log-probabilities (1,050,673,152), three fp32 per token
    (49,152) and the loss (4): 1,576,058,884. Backward: the bf16 gradient, 525,336,576."""
    est, dm = _setup(compile_loss=True, gpus=2, tp=2)
    terms = {t.name: t.size_bytes for t in head.head_terms(est.spec, est.workload, dm)}
    assert "loss.log_softmax" not in terms and "loss.logits" not in terms
    assert terms["loss.softmax_grad"] == 1_050_673_152
    assert terms["loss.target_mask"] == 4_096
    assert head.forward_extra_bytes(est.spec, est.workload, dm) == 1_576_058_884
    assert head.loss_backward_bytes(est.spec, est.workload, dm, 0) == 525_336_576


def test_compiled_chunk_in_the_loss_call() -> None:
    """``ChunkedLossWrapper`` of 8 chunks (loss_chunk_backward in-loss), each chunk's loss
    compiled: a chunk of 512 tokens, its logits 512 x 128,256 = 65,667,072 elements; the head
    weight's gradient summed in bf16, 128,256 x 4096 x 2 = 1,050,673,152. The loss's moment:
    the summed gradient, the bf16 logits and their bf16 gradient (2 x 131,334,144) and three
    fp32 per token (6,144): 1,313,347,584; the projection's: the summed gradient, the logits
    and their gradient, the new weight gradient (1,050,673,152) and the chunk's input
    gradient (512 x 4096 x 2 = 4,194,304): 2,368,208,896, the larger. Eagerly the loss's,
    with the bf16 logits, the fp32 copy, log-softmax and gradient (3 x 262,668,288), is
    1,970,012,160."""
    est, dm = _setup(compile_loss=True, loss_chunks=8, loss_chunk_backward="in-loss")
    assert loss_in_call._chunk_moments(est.spec, est.workload, dm) == (1_313_347_584,
                                                                         2_368_208_896)
    eager, dm = _setup(loss_chunks=8, loss_chunk_backward="in-loss")
    assert loss_in_call._chunk_moments(eager.spec, eager.workload, dm) == (1_970_012_160,
                                                                           2_368_208_896)
    # the chunks' saved set is the eager wrapper's: each chunk's graph is gone by its end
    compiled = {t.name: t.size_bytes for t in head.head_terms(est.spec, est.workload, dm)}
    assert compiled == {t.name: t.size_bytes
                        for t in head.head_terms(eager.spec, eager.workload, dm)}


def test_chunk_in_the_loss_call_under_loss_parallel() -> None:
    """The same wrapper at tp 2 (64,128 vocabulary rows a rank): a chunk's logits 512 x
    64,128 = 32,833,536 elements (bf16 65,667,072, fp32 131,334,144); the summed gradient of
    the head's shard 64,128 x 4096 x 2 = 525,336,576. Compiled, the forward's kernel: the
    summed gradient, the bf16 logits, the fp32 log-probabilities and the saved softmax less
    the targets (2 x 131,334,144), three fp32 and a mask byte per token (512 x 13 = 6,656):
    853,678,592. Eagerly ``_LossParallelCrossEntropy.backward``'s four fp32 (saved
    log-probabilities, zeros, exp, their sum: 525,336,576) beside the summed gradient and the
    logits: 1,116,340,224. The projection's: the summed gradient, the logits and their
    gradient (131,334,144), the new weight gradient (525,336,576), the chunk's input gradient
    (4,194,304): 1,186,201,600."""
    est, dm = _setup(compile_loss=True, loss_chunks=8, loss_chunk_backward="in-loss", gpus=2,
                     tp=2)
    assert loss_in_call._chunk_moments(est.spec, est.workload, dm) == (853_678_592,
                                                                         1_186_201_600)
    eager, dm = _setup(loss_chunks=8, loss_chunk_backward="in-loss", gpus=2, tp=2)
    assert loss_in_call._chunk_moments(eager.spec, eager.workload, dm) == (1_116_340_224,
                                                                           1_186_201_600)


@pytest.mark.parametrize(("kw", "why"), [
    (dict(loss_chunks=8, loss_chunk_backward="rerun"),
     "loss_chunks 8 and loss_chunk_backward rerun"),
    (dict(precision="amp-bf16"), "precision amp-bf16"),
])
def test_compiled_loss_refuses_what_is_not_modelled(kw: dict, why: str) -> None:
    args = dict(precision="bf16-pure", micro_batch_size=1, seq_len=1024, loss_impl="torchtitan",
                compile_loss=True) | kw
    with pytest.raises(MemplanError, match=f"compile_loss with {why}: a compiled loss"):
        estimate("llama-3.1-8b", **args)
