"""Layout options that change what a rank holds: vocab parallelism, the TP style of sequence
parallelism, and where data-parallel gradients live. Bytes derived by hand for ``tiny``
(2 layers, h 64, f 176, 4 heads / 2 KV heads, d 16, V 128, untied, bf16-mixed)."""

from __future__ import annotations

import pytest

import memplan
from memplan.errors import MemplanError
from memplan.model import head, norm
from memplan.model.dims import Dims
from memplan.overheads import no_overheads
from memplan.parallel import ParallelConfig, TpStyle
from memplan.workload import Workload

TINY_PARAMS = 108_864
LAYER_PARAMS = 46_208  # attention 12,288 + MLP 33,792 + two norms 128


def _stage(**kw):
    return memplan.estimate("tiny", overheads=no_overheads(), **kw).stages[0]


def test_vocab_parallel_splits_embedding_and_head() -> None:
    """tp 2: matrices split, norms replicated. Vocab-parallel: embedding and head 128/2 * 64
    rows each; replicated: 128 * 64 each.

    per layer on a rank: (12,288 + 33,792) / 2 + 128 = 23,168; two layers 46,336; final norm 64
    vocab-parallel: 46,336 + 64 + 2 * 4,096 = 54,592 params, * 2 B = 109,184
    replicated:     46,336 + 64 + 2 * 8,192 = 62,784 params, * 2 B = 125,568
    """
    split = _stage(gpus=2, tp=2)
    whole = _stage(gpus=2, tp=2, vocab_parallel=False)
    assert split.params_bytes == 54_592 * 2
    assert whole.params_bytes == 62_784 * 2


def test_vocab_parallel_splits_the_loss() -> None:
    """The fp32 log-softmax over T = 2 * 64 tokens: T * 128 * 4 = 65,536 B replicated, half
    of it vocab-parallel at tp 2."""
    wl = Workload(micro_batch_size=2, seq_len=64)
    for vocab_parallel, size in ((True, 32_768), (False, 65_536)):
        par = ParallelConfig(tp=2, vocab_parallel=vocab_parallel)
        terms = {t.name: t.size_bytes for t in head.head_terms(
            memplan.load_model("tiny"), wl, Dims.of(memplan.load_model("tiny"), par, wl))}
        assert terms["loss.log_softmax"] == size


def test_dtensor_sequence_parallel_saves_gathered_linear_inputs() -> None:
    """tp 2 with SP, T = 128 tokens: a norm's output (the next linear's input) is its sequence
    shard under Megatron-LM, T/2 * 64 * 2 = 8,192 B, and the gathered sequence under DTensor,
    T * 64 * 2 = 16,384 B. The other norm terms are sharded either way."""
    spec = memplan.load_model("tiny")
    wl = Workload(micro_batch_size=2, seq_len=64)
    sizes = {}
    for style in TpStyle:
        par = ParallelConfig(tp=2, sequence_parallel=True, tp_style=style)
        dm = Dims.of(spec, par, wl)
        terms = {t.name: t.size_bytes for t in norm.norm_terms("n", spec, wl, dm)}
        sizes[style] = terms
    assert sizes[TpStyle.MEGATRON]["n.output"] == 8_192
    assert sizes[TpStyle.DTENSOR]["n.output"] == 16_384
    assert sizes[TpStyle.MEGATRON]["n.input_fp32"] == sizes[TpStyle.DTENSOR]["n.input_fp32"]


def test_ddp_bucket_copies_add_one_gradient_set_everywhere() -> None:
    """dp 2, ZeRO 0: PyTorch DDP's default buckets are a persistent copy of the gradients
    (108,864 * 2 B = 217,728 B) present in every phase of both steps; as views, the gradients
    themselves live from the start instead."""
    view = _stage(gpus=2, seq_len=64, micro_batch_size=2)
    copy = _stage(gpus=2, seq_len=64, micro_batch_size=2, grad_buffers="copy")
    grads = TINY_PARAMS * 2
    assert copy.grads_bytes == view.grads_bytes == grads
    assert copy.steady.optimizer - view.steady.optimizer == grads
    # views: gradients exist in forward; copies: a bucket set does instead, same bytes
    assert copy.steady.forward == view.steady.forward
    assert copy.first_step.forward == view.first_step.forward


def test_single_replica_gradients_are_freed_between_steps() -> None:
    """One GPU, one micro-batch: no gradient exists during forward (zero_grad(set_to_none))."""
    one = _stage(gpus=1, seq_len=64, micro_batch_size=2)
    two = _stage(gpus=2, seq_len=64, micro_batch_size=2)
    assert two.steady.forward - one.steady.forward == TINY_PARAMS * 2


@pytest.mark.parametrize(("kw", "field"), [
    (dict(tp_style="deepspeed"), "tp_style"), (dict(grad_buffers="pinned"), "grad_buffers")])
def test_unknown_choices_are_errors(kw: dict, field: str) -> None:
    with pytest.raises(MemplanError, match=field):
        memplan.estimate("tiny", gpus=2, tp=2, **kw)
