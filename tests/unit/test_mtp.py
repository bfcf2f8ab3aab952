"""Multi-token prediction (``memplan.model.mtp``, Megatron-LM's --mtp-num-layers): the
parameters of one depth, its saved bytes, and the last stage's increase in an estimate, each
derived by hand for the tiny spec (model_specs/models/tiny.toml: h 64, V 128, 2 layers, 4
query and 2 KV heads of 16, SwiGLU width 176, RMSNorm, RoPE, untied embeddings)."""

from __future__ import annotations

import pytest

import memplan
from memplan.model.dims import Dims, total
from memplan.model.head import head_terms
from memplan.model.model_states import count_stage_params
from memplan.model.mtp import depth_params, depth_terms, mtp_recompute
from memplan.spec import load_model
from memplan.workload import LossImpl, NormImpl, Recompute, Workload

TINY = load_model("tiny")
# one decoder layer of tiny: norms 2 x 64, q 64 x 64, k and v 64 x 32 each, o 64 x 64,
# gate, up and down 64 x 176 each: 128 + 4,096 + 4,096 + 4,096 + 33,792 = 46,208
# (tests/unit/test_spec.py: 108,864 = 2 x 46,208 + 2 x 8,192 + 64)
LAYER = 46_208


@pytest.mark.parametrize(("t", "pp", "tied", "expected"), [
    # per depth: the layer 46,208; enorm, hnorm, final norm 3 x 64 = 192; eh_proj 2h x h =
    # 128 x 64 = 8,192; under pp 2 the stage's own word embedding 128 x 64 = 8,192
    (1, 2, False, LAYER + 192 + 8_192 + 8_192),  # 62,784
    # pp 1: the first stage's embedding is the same module: 54,592
    (1, 1, False, LAYER + 192 + 8_192),
    # tied under pp 2: the last stage already holds the word embedding's copy: 54,592
    (1, 2, True, LAYER + 192 + 8_192),
    # t 2: the layer's matrices halved (12,288 + 33,792) / 2 + 128 = 23,168, eh_proj 4,096,
    # the vocabulary's 64 rows x 64 = 4,096, the norms whole: 31,552
    (2, 2, False, 23_168 + 192 + 4_096 + 4_096),
])
def test_one_depth_adds_its_parameters_to_the_last_stage(t: int, pp: int, tied: bool,
                                                          expected: int) -> None:
    spec = TINY.model_copy(update={"tied_embeddings": tied})
    without = count_stage_params(spec, t, 1, pp, (1,), pp == 1, True, t)
    with_mtp = count_stage_params(spec, t, 1, pp, (1,), pp == 1, True, t, 1)
    assert with_mtp.total - without.total == expected
    assert with_mtp.layers == (*without.layers, without.layers[-1])
    assert sum(with_mtp.tensor_sizes) - sum(without.tensor_sizes) == expected
    # the norms' and eh_proj's parameters of one depth beside its layer: 192 + 8,192 / t
    assert depth_params(spec, t) == 192 + 8_192 // t
    # only the last stage holds MTP
    assert count_stage_params(spec, t, 1, pp, (0,), True, pp == 1, t, 1).total == (
        count_stage_params(spec, t, 1, pp, (0,), True, pp == 1, t).total + (
            expected if pp == 1 else 0))


def _dims() -> Dims:
    """A micro-batch of 2 x 64 tokens in bf16 on one of 2 TP ranks (64 vocabulary rows),
    without sequence parallelism: 128 rows in the residual stream."""
    return Dims(b=2, s=64, s_kv=64, tokens=128, res_tokens_div=1, tp=2, e=2, vocab_shard=64,
                stream_e=2)


MEGATRON = Workload(norm_impl=NormImpl.FUSED, loss_impl=LossImpl.MEGATRON, mtp_layers=1)


def test_one_depth_saved_bytes_beside_its_layer() -> None:
    """One depth's saved terms beside its transformer layer, Megatron's fused norms and
    vocab-parallel loss, 128 rows of h 64 in bf16 on a rank of 64 vocabulary rows:
    the rolled ids 128 x 8 = 1,024; enorm's, hnorm's and the final norm's inputs 128 x 64 x
    2 = 16,384 and fp32 rstd 128 x 4 = 512 each: 3 x 16,896 = 50,688; the concatenation
    eh_proj saves 128 x 128 x 2 = 32,768; the depth's chunk of the concatenated hidden
    states 16,384; the fp32 softmax 128 x 64 x 4 = 32,768, the target mask and indices
    128 x (1 + 8) = 1,152; the rolled loss mask and the scaled loss, fp32 [b, s]: 2 x 512.
    Total 135,808. Under the uniform full recompute the checkpoint keeps hnorm's input
    (16,384; the embedding's output is the layer kind's saved input) beside the ids, the
    chunk and the loss: 1,024 + 16,384 + 16,384 + 33,920 + 1,024 = 68,736."""
    dm = _dims()
    loss = [t for t in head_terms(TINY, MEGATRON.model_copy(update={"mtp_layers": 0}), dm)
            if t.name in ("loss.softmax", "loss.target_mask")]
    assert total(depth_terms(TINY, MEGATRON, dm, loss)) == 135_808
    full = MEGATRON.model_copy(update={"recompute": Recompute.FULL})
    assert total(depth_terms(TINY, full, dm, loss)) == 68_736
    # the head carries each depth's terms
    assert total(head_terms(TINY, MEGATRON.model_copy(update={"mtp_layers": 2}), dm)) == (
        total(head_terms(TINY, MEGATRON.model_copy(update={"mtp_layers": 0}), dm))
        + 2 * 135_808)


def test_mtp_recompute_follows_megatron_methods() -> None:
    """Full uniform checkpoints each depth; the block method (recompute_layers) leaves MTP
    unrecomputed (MultiTokenPredictionLayer._checkpointed_forward warns); selective as the
    decoder's."""
    assert mtp_recompute(Workload(recompute="full")) is Recompute.FULL
    assert mtp_recompute(Workload(recompute="full", recompute_layers=1)) is Recompute.NONE
    assert mtp_recompute(Workload(recompute="selective")) is Recompute.SELECTIVE


def test_last_stage_increase_in_an_estimate() -> None:
    """tiny under Megatron-LM (fused norms, its vocab-parallel loss, flash attention), pp 2
    on 2 GPUs, micro-batch 2 x 64 tokens, bf16 with fp32 main gradients: one depth adds to
    the last stage 62,784 parameters (derived above), one more layer of the stage's own kind
    to its layer runs, and per micro-batch that layer's saved terms plus the depth's terms at t 1 (128 rows, 128 vocabulary rows): ids 1,024, three norms' input
    and rstd 3 x (16,384 + 512), the concatenation 32,768, the chunk 16,384, the fp32 softmax
    128 x 128 x 4 = 65,536, the target mask 1,152, loss mask and loss 1,024: 168,576. The
    first stage does not move."""
    kwargs = dict(gpus=2, pp=2, framework="megatron", micro_batch_size=2, seq_len=64)
    base = memplan.estimate("tiny", **kwargs)
    mtp = memplan.estimate("tiny", mtp_layers=1, **kwargs)
    assert mtp.stages[0] == base.stages[0]
    last, last_mtp = base.stages[1], mtp.stages[1]
    assert last_mtp.num_params - last.num_params == 62_784
    assert last_mtp.num_layers == last.num_layers + 1
    layer = sum(t.size_bytes for count, terms in last.activation_groups[3:] for t in terms)
    assert last_mtp.microbatch_bytes - last.microbatch_bytes == layer + 168_576
    assert last_mtp.peak_bytes > last.peak_bytes
