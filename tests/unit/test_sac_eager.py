"""Op-level checkpointing of an eager attention core (transformers' ``eager_attention_forward``:
the scores' bmm, the scaling and additive mask, softmax, its cast back, dropout, the value
bmm), derived by hand.

tiny: h 64, 4 heads / 2 KV heads of d 16, SwiGLU f 176, 2 layers. At seq 128 and micro-batch
2 in bf16 a layer's tokens are T = 256 and its scores b x heads x s x s_kv = 2 x 4 x 128 x
128 = 131,072 elements. With ``softmax_fp32`` (transformers' Llama: ``softmax(dtype=
torch.float32)`` then ``.to(query.dtype)``) the softmax copies its bf16 input to fp32 first
(an op of the ``copy`` family, 128 wide, kept by no item) and casts its output back.
"""

from __future__ import annotations

import pytest

from memplan.api import estimate, make_layout, make_workload
from memplan.errors import MemplanError
from memplan.model.dims import Dims
from memplan.model.layer import ops_items, ops_unkept
from memplan.model.sac_ops import ops_refusal, rerun_flops_per_token, resolve
from memplan.report.sac_policy import emit_for
from memplan.spec import ModelSpec, load_model

TINY = load_model("tiny")
FIELDS = dict(seq_len=128, micro_batch_size=2, attention="eager", softmax_fp32=True)


def _items(spec: ModelSpec = TINY, **fields):
    wl = make_workload(spec, **{**FIELDS, **fields}, recompute="ops")
    assert ops_refusal(spec, wl) is None
    dm = Dims.of(spec, make_layout(1), wl)
    return ops_items(spec, wl, dm), ops_unkept(spec, wl, dm)


def test_eager_core_items_by_hand() -> None:
    """attn.scores: the first bmm's output, 131,072 x 2 = 262,144 B, 2 x s_kv x q = 2 x 128
    x 64 = 16,384 FLOPs a token (the whole square); attn.softmax: fp32, 524,288 B, one FLOP
    an element (heads x s_kv = 512 a token); attn.softmax_cast: 262,144 B, the second
    128-wide copy (the first, the softmax's upcast, counted unkept); attn.context: the value
    bmm's output, T x q x 2 = 32,768 B, 16,384 FLOPs, the first bmm 16 (d) wide."""
    items, unkept = _items()
    core = [(i.name, i.terms, i.size_bytes, i.flops_per_token, i.op, i.width, i.nth)
            for i in items if i.op in ("bmm", "softmax") or i.name == "attn.softmax_cast"]
    assert core == [
        ("attn.scores", (), 262_144, 16_384.0, "bmm", 128, 0),
        ("attn.softmax", ("attn.softmax",), 524_288, 512.0, "softmax", 128, 0),
        ("attn.softmax_cast", ("attn.softmax_cast",), 262_144, 512.0, "copy", 128, 1),
        ("attn.context", (), 32_768, 16_384.0, "bmm", 16, 0)]
    assert ("copy", 128) in unkept
    assert "attn.out" not in {i.name for i in items}  # SDPA's kernel: no such op here
    kept = resolve(items, ("attn.scores", "attn.softmax", "attn.softmax_cast",
                           "attn.context"), TINY)
    assert rerun_flops_per_token(items, ()) - rerun_flops_per_token(items, kept) == \
        2 * 16_384 + 2 * 512


def test_eager_dropout_item_by_hand() -> None:
    """With dropout 0.1 (its bool mask, 131,072 B, and its bf16 output, 262,144 B: CUDA's
    native_dropout) and the softmax in bf16: attn.dropout, 393,216 B, the first dropout 128
    wide; no cast."""
    spec = ModelSpec.model_validate({**TINY.model_dump(), "name": "tiny-drop", "dropout": 0.1})
    items, _ = _items(spec, softmax_fp32=False)
    drop = [(i.name, i.size_bytes, i.op, i.width, i.nth) for i in items
            if i.name.startswith("attn.") and i.op in ("dropout", "copy")]
    assert drop == [("attn.dropout", 393_216, "dropout", 128, 0)]


def test_kept_core_outputs_add_their_bytes_and_emit() -> None:
    """Keeping the scores and the context in both layers: 2 x (262,144 + 32,768) B beyond
    keeping nothing; the torch policy names the bmms by width; torchtitan has no eager core;
    Megatron's core_attn recomputes the core whole."""
    def run(save: str):
        return estimate(TINY, **FIELDS, recompute="ops", recompute_save=save)

    assert run("attn.scores,attn.context").stages[0].activations_bytes - \
        run("").stages[0].activations_bytes == 2 * (262_144 + 32_768)
    text = emit_for("torch", run("attn.scores,attn.context"))
    assert "SAVE = {('bmm', 16, 0), ('bmm', 128, 0)}" in text
    assert "_aten.bmm.default" in text
    with pytest.raises(MemplanError, match="eager attention"):
        emit_for("torchtitan", run("attn.scores"))
    megatron = emit_for("megatron", run("attn.scores"))
    assert "--recompute-modules core_attn" in megatron
    assert "an eager core partly kept" in megatron


CAP = ModelSpec.model_validate({**TINY.model_dump(), "name": "tiny-cap",
                                "attn_logit_softcap": 50.0})


def test_softcap_items_by_hand() -> None:
    """Gemma 2's soft-capping (models/gemma2/modeling_gemma2.py eager_attention_forward:
    ``matmul(q, k^T) * scaling``, ``/ softcap``, ``tanh``, ``* softcap``, then the mask):
    after the scores' bmm the scaling (a ``scale``, 128 wide, kept by none), then
    attn.softcap_tanh (``aten.tanh``, the ``attn.softcap_tanh`` term its backward saves:
    131,072 x 2 = 262,144 B, one FLOP an element, heads x s_kv = 512 a token) and
    attn.softcap (the product by the cap, the second 128-wide ``scale``, 262,144 B, saved by
    no one); the division is no op a policy counts. The emitted policy counts two scales and
    one tanh a layer."""
    items, unkept = _items(CAP)
    cap = [(i.name, i.terms, i.size_bytes, i.flops_per_token, i.op, i.width, i.nth)
           for i in items if i.name.startswith("attn.softcap")]
    assert cap == [
        ("attn.softcap_tanh", ("attn.softcap_tanh",), 262_144, 512.0, "tanh", 128, 0),
        ("attn.softcap", (), 262_144, 512.0, "scale", 128, 1)]
    assert ("scale", 128) in unkept
    names = [i.name for i in items]
    assert names.index("attn.scores") < names.index("attn.softcap_tanh") < \
        names.index("attn.softcap") < names.index("attn.softmax")
    est = estimate(CAP, **FIELDS, recompute="ops", recompute_save="attn.softcap_tanh")
    text = emit_for("torch", est)
    assert "SAVE = {('tanh', 128, 0)}" in text
    assert "('scale', 128): 2" in text and "('tanh', 128): 1" in text


def test_softcap_core_moments_by_hand() -> None:
    """tiny soft-capped, bf16, transformers' fp32 softmax: scores S = 262,144 B (bf16), the
    fp32 softmax 524,288 B, q (and each tensor of q's shape) 32,768 B; K and V repeated to
    every head (2 groups), locals of the core: 65,536 B. The checkpointed core's moments
    (memplan.model.eager.checkpointed_moments): the first bmm, 65,536 + its inputs' copies
    (q, its contiguous copy, K repeated and k^T's copy: 4 x 32,768) + S = 458,752; raw and
    scaled scores, 65,536 + 2 S = 589,824; soft-capping's steps (each op's input and output),
    589,824 with the raw scores freed (kept, they add S); the capped and masked scores,
    589,824; the masked scores, the softmax's fp32 copy of them and its fp32 output,
    65,536 + S + 2 x 524,288 = 1,376,256; the value matmul, 65,536 + S + 524,288 + the cast S
    + its output 32,768 = 1,146,880. From the masked scores on, kept tanh output and capped
    scores add S each (the product and the add would have freed them); at the output
    projection too."""
    from memplan.model import eager
    from memplan.model.attention import _core

    wl = make_workload(CAP, **FIELDS, recompute="ops")
    c = _core(CAP, wl, Dims.of(CAP, make_layout(1), wl))
    s = 262_144
    late = {"attn.scores": s, "attn.softcap_tanh": s, "attn.softcap": s}
    assert eager.checkpointed_moments(c) == [
        (458_752, {}), (589_824, {}), (589_824, {"attn.scores": s}), (589_824, late),
        (1_376_256, late), (1_146_880, {**late, "attn.softmax": 0})]
    adds = eager.output_moment_adds(c, False)
    assert adds["attn.softcap_tanh"] == adds["attn.softcap"] == s
    # without soft-capping: no such moment, nothing added
    plain = _core(TINY, wl, Dims.of(TINY, make_layout(1), wl))
    assert [v for v, _ in eager.checkpointed_moments(plain)] == [
        458_752, 589_824, 589_824, 1_376_256, 1_146_880]


def test_eager_refused_where_not_modelled() -> None:
    """fp16 with transformers' fp32 softmax and no autocast: CUDA's softmax upcasts fp16
    without a copy (the policy's copy count would differ; under autocast, or with the
    softmax in the scores' dtype, fp16 is bf16's); sinks with an fp32 softmax (GPT-OSS's
    eager_attention_forward softmaxes in the scores' dtype: modelled); a sequence
    as long as the hidden size under upcast-fp32 norms in 16 bits (their unnamed casts share
    the softmax's casts' width). Soft-capping and a window shorter than the sequence are
    modelled."""
    wl = make_workload(TINY, **FIELDS, recompute="ops", precision="fp16-mixed")
    assert "eager attention in fp16" in ops_refusal(TINY, wl)
    assert ops_refusal(TINY, wl.model_copy(update={"softmax_fp32": False})) is None
    assert ops_refusal(TINY, make_workload(TINY, **FIELDS, recompute="ops",
                                           precision="amp-fp16")) is None
    sinks = ModelSpec.model_validate({**TINY.model_dump(), "name": "tiny-sinks",
                                      "attn_sinks": True})
    assert "sinks and an fp32 softmax" in ops_refusal(sinks, make_workload(
        sinks, **FIELDS, recompute="ops"))
    assert ops_refusal(CAP, make_workload(CAP, **FIELDS, recompute="ops")) is None
    window = ModelSpec.model_validate({**TINY.model_dump(), "name": "tiny-window",
                                       "sliding_window": 64})
    assert ops_refusal(window, make_workload(window, **FIELDS, recompute="ops")) is None
    wide = make_workload(CAP, **{**FIELDS, "seq_len": 64}, recompute="ops",
                         norm_impl="upcast-fp32")
    assert "as long as the hidden size" in ops_refusal(CAP, wide)
    assert ops_refusal(CAP, wide.model_copy(update={"seq_len": 128})) is None


def test_sink_core_moments_by_hand() -> None:
    """GPT-OSS's checkpointed eager core (``eager._sink_moments``) narrowed to 2 x 64 tokens,
    4 / 2 heads of 32, bf16: a score tensor b heads s s_kv e = 65,536, a column of it
    b heads s e = 1,024, the row max's indices b heads s 8 = 4,096; K and V repeated to every
    head 2 x T q e = 65,536, q 32,768. The scores, raw and scaled, 196,608; the masked
    scores, the cat (66,560), the max's values and indices: 202,752; the difference beside
    them and the cat, the values: 265,216 (the core's peak); the softmax beside the difference
    and the masked scores: 264,192; the value matmul's output beside the difference and the
    probabilities: 231,424."""
    from memplan.model import eager

    spec = load_model("gpt-oss-20b").model_copy(update={
        "num_layers": 2, "hidden_size": 128, "ffn_hidden_size": 128, "num_attention_heads": 4,
        "num_kv_heads": 2, "head_dim": 32, "vocab_size": 512, "sliding_window": 32})
    wl = make_workload(spec, seq_len=64, micro_batch_size=2, attention="eager",
                       precision="bf16-pure", recompute="full")
    c = eager.core(spec, Dims.of(spec, make_layout(1), wl))
    assert (c.scores, c.sink_col, c.sink_index) == (65_536, 1_024, 4_096)
    moments = [value for value, _ in eager.checkpointed_moments(c)]
    assert moments[1:] == [196_608, 202_752, 265_216, 264_192, 231_424]
    assert eager.forward_checkpointed(c) == 265_216
    # rerun with autograd recording, at the difference: the probabilities with their sink
    # column (66,560) not made yet; beside the rest the caller's q, k and v the matmuls copy
    # or repeat (32,768 + 2 x 16,384), the masked scores, the cat, the difference and the
    # max's values: 65,536 + 65,536 + 2 x 66,560 + 1,024 = 265,216
    assert eager.saving_sink_moments(c) == [(66_560, 265_216)]
