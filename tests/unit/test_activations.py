"""Saved-activation terms per layer, against published formulas and hand derivations.

Korthikanti et al. 2022 (arXiv 2205.05198), section 4.1 / Table 2, for a GPT layer in 16-bit
with 1-byte dropout masks, eager attention and a fused LayerNorm, per micro-batch of b sequences
of s tokens (h hidden, a heads, t TP degree):

    attention block: 11sbh + 5as^2b   = QKV input 2sbh + Q,K 4sbh + V 2sbh + out-proj input 2sbh
                                        + dropout mask sbh; softmax 2as^2b + its dropout mask
                                        as^2b + dropout output 2as^2b
    MLP block:       19sbh            = fc1 input 2sbh + GELU input 8sbh + GELU output 8sbh
                                        + dropout mask sbh
    two LayerNorms:   4sbh            = their inputs 2sbh each
    total            34sbh + 5as^2b

memplan names them differently (each norm saves its input and its output, the output being the
next linear's input), but the sum must match. The paper neglects LayerNorm statistics (fp32 mean
and rstd per token), which memplan carries as ``*.stats`` terms; they are checked separately.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.model.attention import rope_terms
from memplan.model.dims import Dims, Term, total
from memplan.model.embedding import embedding_terms
from memplan.model.head import (
    forward_extra_bytes,
    head_terms,
    linear_backward_bytes,
    loss_backward_bytes,
    loss_chunk_tokens,
)
from memplan.model.layer import layer_terms
from memplan.model.moe import moe_terms
from memplan.parallel import ParallelConfig
from memplan.spec import ModelSpec, load_model
from memplan.workload import Attention, NormImpl, Precision, Recompute, Workload

# Korthikanti's setting, with all divisions exact for t in {1, 2, 4, 8}:
# 5as/h = 5*16*2048/1024 = 160, a/t and 24/t integers, s/t integer for sequence parallelism.
S, B, H, A = 2048, 2, 1024, 16
SBH = S * B * H

GPT = ModelSpec(
    name="gpt-korthikanti", source="test: GPT layer as in Korthikanti et al. 2022",
    num_layers=4, hidden_size=H, ffn_hidden_size=4 * H, num_attention_heads=A, num_kv_heads=A,
    head_dim=H // A, vocab_size=51_200, max_seq_len=S, norm="layernorm", mlp="gelu",
    position="learned", tied_embeddings=True, qkv_bias=True, attn_out_bias=True, mlp_bias=True,
    norm_bias=True, dropout=0.1,
)
GPT_WL = Workload(micro_batch_size=B, seq_len=S, precision=Precision.BF16_MIXED,
                  attention=Attention.EAGER, norm_impl=NormImpl.FUSED)


def _gpt_layer(t: int, sp: bool, recompute: Recompute) -> list[Term]:
    par = ParallelConfig(tp=t, sequence_parallel=sp)
    return layer_terms(GPT, GPT_WL, Dims.of(GPT, par, GPT_WL), moe_layer=False,
                       recompute=recompute)


def _without_stats(terms: list[Term]) -> int:
    return sum(term.size_bytes for term in terms if not term.name.endswith(".stats"))


def _stats(terms: list[Term]) -> int:
    return sum(term.size_bytes for term in terms if term.name.endswith(".stats"))


# --- Korthikanti Table 2 --------------------------------------------------------------------

def test_no_parallelism() -> None:
    """s*b*h*(34 + 5as/h) = 4,194,304 * (34 + 160) = 813,694,976 bytes."""
    terms = _gpt_layer(1, False, Recompute.NONE)
    assert _without_stats(terms) == SBH * 34 + 5 * A * S * S * B == 813_694_976


def test_no_parallelism_term_by_term() -> None:
    """The mapping of memplan's terms onto the paper's (in units of sbh; as^2b for softmax)."""
    sizes = {t.name: t.size_bytes for t in _gpt_layer(1, False, Recompute.NONE)}
    assert sizes["attn_norm.input"] == sizes["mlp_norm.input"] == 2 * SBH  # LN inputs
    assert sizes["attn_norm.output"] == 2 * SBH  # QKV input
    assert sizes["mlp_norm.output"] == 2 * SBH  # fc1 input
    assert sizes["attn.q"] == sizes["attn.k"] == sizes["attn.v"] == 2 * SBH
    assert sizes["attn.out"] == 2 * SBH  # output-projection input
    assert sizes["attn.softmax"] == sizes["attn.softmax_dropout_out"] == 2 * A * S * S * B
    assert sizes["attn.softmax_dropout_mask"] == A * S * S * B
    assert sizes["attn.dropout_mask"] == sizes["mlp.dropout_mask"] == SBH
    assert sizes["mlp.fc1"] == sizes["mlp.act"] == 8 * SBH


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tp(t: int) -> None:
    """TP without SP: s*b*h*(10 + 24/t + 5as/(h t))."""
    terms = _gpt_layer(t, False, Recompute.NONE)
    assert _without_stats(terms) == SBH * 10 + SBH * 24 // t + 5 * A * S * S * B // t


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tp_sp(t: int) -> None:
    """TP + SP: s*b*h/t * (34 + 5as/h)."""
    terms = _gpt_layer(t, True, Recompute.NONE)
    assert _without_stats(terms) == (SBH * 34 + 5 * A * S * S * B) // t


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tp_selective(t: int) -> None:
    """TP + selective recompute: s*b*h*(10 + 24/t)."""
    terms = _gpt_layer(t, False, Recompute.SELECTIVE)
    assert _without_stats(terms) == SBH * 10 + SBH * 24 // t


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tp_sp_selective(t: int) -> None:
    """TP + SP + selective recompute: 34 s*b*h / t."""
    terms = _gpt_layer(t, True, Recompute.SELECTIVE)
    assert _without_stats(terms) == 34 * SBH // t


def test_full_recompute() -> None:
    """Full recompute keeps only the layer input: 2 s*b*h (no TP); it has no statistics."""
    terms = _gpt_layer(1, False, Recompute.FULL)
    assert total(terms) == 2 * SBH
    assert _stats(terms) == 0


@pytest.mark.parametrize("t", [2, 4, 8])
def test_full_recompute_with_tp(t: int) -> None:
    """The layer input is in the residual stream: replicated without SP, split by t with SP."""
    assert total(_gpt_layer(t, False, Recompute.FULL)) == 2 * SBH
    assert total(_gpt_layer(t, True, Recompute.FULL)) == 2 * SBH // t


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute", [Recompute.NONE, Recompute.SELECTIVE])
def test_layernorm_stats(t: int, sp: bool, recompute: Recompute) -> None:
    """Two LayerNorms, each fp32 mean + rstd = 8 bytes per token: 2 * 8 * s*b (/t with SP)."""
    terms = _gpt_layer(t, sp, recompute)
    assert _stats(terms) == 2 * 8 * S * B // (t if sp else 1)


# --- Llama block (formulas.md, "Measured on CPU with real PyTorch") ----------------------------

def _llama_block(spec: ModelSpec, b: int, s: int, precision: Precision = Precision.BF16_MIXED,
                 tp: int = 1) -> list[Term]:
    wl = Workload(micro_batch_size=b, seq_len=s, precision=precision)  # flash, upcast: defaults
    assert wl.attention is Attention.FLASH and wl.norm_impl is NormImpl.UPCAST
    return layer_terms(spec, wl, Dims.of(spec, ParallelConfig(tp=tp), wl), moe_layer=False,
                       recompute=Recompute.NONE)


def _measured_formula(spec: ModelSpec, b: int, s: int, e: int) -> int:
    """2T(4h + 4 + 2eh) + eT(2h + 2gd) + 4eTf + 4bas (query width a*d = h)."""
    h, g, d, f, a = (spec.hidden_size, spec.num_kv_heads, spec.head_dim, spec.ffn_hidden_size,
                     spec.num_attention_heads)
    assert a * d == h
    t_ = b * s
    return 2 * t_ * (4 * h + 4 + 2 * e * h) + e * t_ * (2 * h + 2 * g * d) + 4 * e * t_ * f \
        + 4 * b * a * s


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(["llama-7b", "llama-2-13b", "llama-3-8b", "mistral-7b", "tiny"]),
       b=st.integers(1, 4), s=st.sampled_from([16, 128, 1000, 2048, 4096]))
def test_llama_block_bf16(name: str, b: int, s: int) -> None:
    """bf16: T*(20h + 4gd + 8f + 8) + 4bas per layer, MHA and GQA alike."""
    spec = load_model(name)
    h, g, d, f, a = (spec.hidden_size, spec.num_kv_heads, spec.head_dim, spec.ffn_hidden_size,
                     spec.num_attention_heads)
    got = total(_llama_block(spec, b, s))
    assert got == b * s * (20 * h + 4 * g * d + 8 * f + 8) + 4 * b * a * s
    assert got == _measured_formula(spec, b, s, 2)


@pytest.mark.parametrize(("precision", "e"), [(Precision.FP32, 4), (Precision.FP16_MIXED, 2)])
def test_llama_block_other_dtypes(precision: Precision, e: int) -> None:
    spec = load_model("llama-3-8b")
    assert total(_llama_block(spec, 2, 512, precision)) == _measured_formula(spec, 2, 512, e)


@pytest.mark.parametrize(("b", "s"), [(1, 2048), (2, 2048), (4, 512)])
def test_llama_7b_block(b: int, s: int) -> None:
    """Llama-7B (h = g*d = 4096, f = 11008 = 2.6875h): 20h + 4h + 8f = 45.5h per token, so the
    block is 45.5sbh + 4abs + 8sb; the 8sb are the two RMSNorms' fp32 rstd (4 B/token each).

    formulas.md writes "45.5*s*b*h + 4*a*b*s", which drops the rstd: that is exact only without
    the ``.stats`` terms.
    """
    spec = load_model("llama-7b")
    h, a = spec.hidden_size, spec.num_attention_heads
    terms = _llama_block(spec, b, s)
    assert 2 * _without_stats(terms) == 91 * s * b * h + 2 * 4 * a * b * s
    assert _stats(terms) == 8 * s * b
    assert 2 * total(terms) == 91 * s * b * h + 2 * (4 * a * b * s + 8 * s * b)


def test_gqa_kv_width() -> None:
    """Llama-3-8B: g = 8 KV heads of d = 128, so k and v are T*1024*2 bytes; q is T*4096*2."""
    spec = load_model("llama-3-8b")
    sizes = {t.name: t.size_bytes for t in _llama_block(spec, 2, 1024)}
    tokens = 2 * 1024
    assert sizes["attn.k"] == sizes["attn.v"] == tokens * 8 * 128 * 2
    assert sizes["attn.q"] == sizes["attn.out"] == tokens * 32 * 128 * 2
    assert sizes["attn.lse"] == 2 * 32 * 1024 * 4  # fp32 per query head and token


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gqa_kv_width_under_tp(tp: int) -> None:
    spec = load_model("llama-3-8b")
    sizes = {t.name: t.size_bytes for t in _llama_block(spec, 1, 1024, tp=tp)}
    assert sizes["attn.k"] == 1024 * 8 * 128 * 2 // tp
    assert sizes["attn.lse"] == 1 * (32 // tp) * 1024 * 4


def test_mqa() -> None:
    """MQA (g = 1): k and v are one head wide, T*d*e each; q is unchanged."""
    spec = load_model("llama-2-7b").model_copy(update={"num_kv_heads": 1})
    sizes = {t.name: t.size_bytes for t in _llama_block(spec, 2, 256)}
    assert sizes["attn.k"] == sizes["attn.v"] == 2 * 256 * 128 * 2
    assert sizes["attn.q"] == 2 * 256 * 4096 * 2
    mha = {t.name: t.size_bytes for t in _llama_block(load_model("llama-2-7b"), 2, 256)}
    assert mha["attn.k"] == 32 * sizes["attn.k"]


@pytest.mark.parametrize(
    ("attention", "recompute", "kv_heads_saved"),
    [
        (Attention.FLASH, Recompute.NONE, 2),  # SDPA's kernels take grouped K and V
        (Attention.EAGER, Recompute.NONE, 4),  # the matmuls save K and V repeated to 4 heads
        (Attention.EAGER, Recompute.SELECTIVE, 2),  # the repeat runs inside the rebuilt core
        (Attention.FLASH, Recompute.SELECTIVE, 2),
    ],
)
def test_kv_width_by_kernel_and_recompute(attention: Attention, recompute: Recompute,
                                          kv_heads_saved: int) -> None:
    """tiny (4 query heads, 2 KV heads of d = 16), 1 x 256 tokens, bf16: k and v are saved at
    256 * heads * 16 * 2 bytes each, with heads = 2 (grouped) or 4 (repeated)."""
    spec = load_model("tiny")
    wl = Workload(micro_batch_size=1, seq_len=256, attention=attention, recompute=recompute)
    sizes = {t.name: t.size_bytes for t in layer_terms(
        spec, wl, Dims.of(spec, ParallelConfig(), wl), moe_layer=False, recompute=recompute)}
    assert sizes["attn.k"] == sizes["attn.v"] == 256 * kv_heads_saved * 16 * 2
    assert sizes["attn.q"] == 256 * 4 * 16 * 2


# --- MoE -----------------------------------------------------------------------------------

def _mixtral_terms(top_k: int, b: int = 1, s: int = 1024) -> dict[str, int]:
    spec = load_model("mixtral-8x7b")
    spec = spec.model_copy(update={"moe": spec.moe.model_copy(update={"top_k": top_k})})
    wl = Workload(micro_batch_size=b, seq_len=s)
    return {t.name: t.size_bytes for t in moe_terms(spec, Dims.of(spec, ParallelConfig(), wl))}


def test_mixtral_moe_terms() -> None:
    """Mixtral (h=4096, 8 experts, top-2, expert f=14336), T = 1024 tokens, bf16:

    router probs fp32  T*8*4           =     32,768
    top-k indices      T*2*8 (int64)   =     16,384
    dispatched copies  T*2*h*2         = 16,777,216
    expert gate/act/up/prod, each T*2*f*2 = 58,720,256
    expert outputs     T*2*h*2         = 16,777,216
    routing weights    T*2*2           =      4,096
    top-k weights      T*2*4 + T*4     =     12,288  (renormalisation saves both, fp32)
    row indices        T*2*8 (int64)   =     16,384  (which rows each expert gathers)
    weighted outputs   T*2*h*2         = 16,777,216  (kept by the combine's index_add)
    """
    terms = _mixtral_terms(2)
    tk = 1024 * 2
    assert terms["moe.router_probs"] == 1024 * 8 * 4 == 32_768
    assert terms["moe.topk_indices"] == tk * 8
    assert terms["moe.dispatched"] == terms["moe.expert_out"] == tk * 4096 * 2 == 16_777_216
    for n in ("gate", "act", "up", "prod"):
        assert terms[f"moe.expert.{n}"] == tk * 14336 * 2 == 58_720_256
    assert terms["moe.routing_weights"] == tk * 2
    assert terms["moe.topk_weights"] == tk * 4 + 1024 * 4 == 12_288
    assert terms["moe.token_index"] == tk * 8 == 16_384
    assert terms["moe.combine_in"] == tk * 4096 * 2


def test_moe_terms_scale_with_top_k() -> None:
    """Routed terms are proportional to top_k; the router's probabilities are not, and the
    top-k weights' per-token sum (T fp32 values, T = 1024) is not."""
    one, two = _mixtral_terms(1), _mixtral_terms(2)
    assert one.keys() == two.keys()
    for name in one:
        if name == "moe.router_probs":
            assert one[name] == two[name]
        elif name == "moe.topk_weights":
            assert 2 * one[name] - two[name] == 1024 * 4
        else:
            assert two[name] == 2 * one[name]


def test_mixtral_layer_uses_moe_terms() -> None:
    spec = load_model("mixtral-8x7b")
    wl = Workload(micro_batch_size=1, seq_len=1024)
    dm = Dims.of(spec, ParallelConfig(), wl)
    assert spec.is_moe_layer(0)
    names = {t.name for t in layer_terms(spec, wl, dm, moe_layer=True, recompute=Recompute.NONE)}
    assert "moe.router_probs" in names and "mlp.gate" not in names


# --- context parallelism, eager softmax, other stage terms -----------------------------------

@pytest.mark.parametrize("attention", [Attention.FLASH, Attention.EAGER])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_divides_tokens(attention: Attention, cp: int) -> None:
    """With CP every layer term is over T/cp local tokens; eager's scores are (s/cp) x s, so they
    shrink by cp as well. The whole layer is exactly 1/cp of the cp=1 layer."""
    spec = load_model("gpt2")
    wl = Workload(micro_batch_size=2, seq_len=1024, attention=attention)
    base = total(layer_terms(spec, wl, Dims.of(spec, ParallelConfig(), wl), moe_layer=False,
                             recompute=Recompute.NONE))
    split = total(layer_terms(spec, wl, Dims.of(spec, ParallelConfig(cp=cp), wl), moe_layer=False,
                              recompute=Recompute.NONE))
    assert split * cp == base
    dm = Dims.of(spec, ParallelConfig(cp=cp), wl)
    assert (dm.s, dm.s_kv, dm.tokens) == (1024 // cp, 1024, 2 * 1024 // cp)


@pytest.mark.parametrize(("tp", "cp"), [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4)])
def test_eager_softmax_term(tp: int, cp: int) -> None:
    """Softmax output: b * (a/t) heads * (s/cp) local queries * s keys * e bytes; with dropout
    its 1-byte mask and its e-byte output are the same shape."""
    spec = load_model("gpt2")  # a = 12, dropout 0.1
    b, s = 2, 1024
    wl = Workload(micro_batch_size=b, seq_len=s, attention=Attention.EAGER)
    dm = Dims.of(spec, ParallelConfig(tp=tp, cp=cp), wl)
    sizes = {t.name: t.size_bytes
             for t in layer_terms(spec, wl, dm, moe_layer=False, recompute=Recompute.NONE)}
    scores = b * (12 // tp) * (s // cp) * s
    assert sizes["attn.softmax"] == scores * 2
    assert sizes["attn.softmax_dropout_mask"] == scores
    assert sizes["attn.softmax_dropout_out"] == scores * 2
    assert "attn.lse" not in sizes


def test_eager_without_dropout_has_no_softmax_mask() -> None:
    spec = load_model("llama-2-7b")
    wl = Workload(micro_batch_size=1, seq_len=512, attention=Attention.EAGER)
    names = {t.name for t in layer_terms(spec, wl, Dims.of(spec, ParallelConfig(), wl),
                                         moe_layer=False, recompute=Recompute.NONE)}
    assert "attn.softmax" in names
    assert not {"attn.softmax_dropout_mask", "attn.softmax_dropout_out"} & names


def test_rope_terms_are_per_sequence() -> None:
    """cos and sin: 2 * s * d * e, independent of the micro-batch size; none for learned."""
    spec = load_model("llama-2-7b")
    for b in (1, 3):
        wl = Workload(micro_batch_size=b, seq_len=2048)
        assert total(rope_terms(spec, wl, Dims.of(spec, ParallelConfig(), wl))) == (
            2 * 2048 * 128 * 2)
    wl = Workload(micro_batch_size=1, seq_len=2048)
    assert total(rope_terms(spec, wl, Dims.of(spec, ParallelConfig(cp=2), wl))) == (
        2 * 1024 * 128 * 2)
    gpt2 = load_model("gpt2")
    assert rope_terms(gpt2, wl, Dims.of(gpt2, ParallelConfig(), wl)) == []


def test_embedding_and_head_terms() -> None:
    """Embedding: int64 ids 8T (+ learned positions' int64 ids 8s, one row shared by the batch,
    + 1-byte dropout mask T*h when dropout > 0). Head (Llama-2-7B,
    upcast RMSNorm, fp32 logits): final norm 4Th + 4T + 2Th + 2Th, log-softmax T*V*4, targets 8T,
    and two fp32 scalars (the loss and nll_loss's total_weight), 8 bytes per micro-batch."""
    spec = load_model("llama-2-7b")
    wl = Workload(micro_batch_size=2, seq_len=1024)
    dm = Dims.of(spec, ParallelConfig(), wl)
    t_, h, v = 2048, 4096, 32000
    assert total(embedding_terms(spec, dm)) == 8 * t_
    gpt2 = load_model("gpt2")
    assert total(embedding_terms(gpt2, dm)) == 8 * t_ + 8 * 1024 + t_ * 768
    head = {t.name: t.size_bytes for t in head_terms(spec, wl, dm)}
    assert head["loss.log_softmax"] == t_ * v * 4
    assert head["loss.targets"] == 8 * t_
    assert head["loss.scalars"] == 8
    assert total(head_terms(spec, wl, dm)) == 8 * t_ * h + 4 * t_ + t_ * v * 4 + 8 * t_ + 8


def test_head_vocab_is_ceil_split_under_tp() -> None:
    """GPT-2's V = 50257 over t = 4: ceil(50257/4) = 12,565 columns per rank."""
    spec = load_model("gpt2")
    wl = Workload(micro_batch_size=1, seq_len=1024)
    head = {t.name: t.size_bytes
            for t in head_terms(spec, wl, Dims.of(spec, ParallelConfig(tp=4), wl))}
    assert head["loss.log_softmax"] == 1024 * 12_565 * 4


def test_chunked_loss_llama_3_8b() -> None:
    """Llama-3-8B (h 4096, V 128,256), one sequence of 8192 tokens, bf16, fp32 logits, 8 loss
    chunks of 1024 tokens. Saved: no log-softmax, one fp32 loss scalar. Forward: one chunk's
    fp32 logits and log-softmax, 2 * 1024 * V * 4. Backward of the loss (the last chunk run):
    its log-softmax, that gradient and the logits' fp32 gradient, 3 * 1024 * V * 4, beside
    the other seven chunks' input gradients 7 * 1024 * h * 2 and the summed head gradient
    V * h * 2. The projection's backward: the second chunk run sums two head gradients into a
    third, beside the input gradients of the chunks run so far (all but one)."""
    spec = load_model("llama-3-8b")
    wl = Workload(micro_batch_size=1, seq_len=8192, loss_chunks=8)
    dm = Dims.of(spec, ParallelConfig(), wl)
    v, h, tc = 128_256, 4096, 1024
    grad_w = v * h * 2
    assert loss_chunk_tokens(wl, dm) == (1024, 8)
    head = {t.name: t.size_bytes for t in head_terms(spec, wl, dm)}
    assert "loss.log_softmax" not in head and head["loss.scalars"] == 4
    assert forward_extra_bytes(spec, wl, dm) == 2 * tc * v * 4 == 1_050_673_152
    assert loss_backward_bytes(spec, wl, dm, grad_w) == (
        3 * tc * v * 4 + 7 * tc * h * 2 + grad_w) == 2_685_403_136
    last_made = 8 * tc * h * 2 + 2 * grad_w + tc * v * 2
    second_sum = 7 * tc * h * 2 + 3 * grad_w
    assert linear_backward_bytes(spec, wl, dm, grad_w) == max(last_made, second_sum) \
        == 3_210_739_712


def test_chunked_loss_uneven_chunks() -> None:
    """torch.chunk of 15 tokens into 4: chunks of ceil(15/4) = 4 tokens, four of them; into 7:
    chunks of 3, five of them (fewer than asked)."""
    wl = Workload(micro_batch_size=1, seq_len=15, loss_chunks=4)
    assert loss_chunk_tokens(wl, Dims.of(load_model("tiny"), ParallelConfig(), wl)) == (4, 4)
    wl = Workload(micro_batch_size=1, seq_len=15, loss_chunks=7)
    assert loss_chunk_tokens(wl, Dims.of(load_model("tiny"), ParallelConfig(), wl)) == (3, 5)


def test_chunked_loss_lowers_the_llama_3_8b_peak() -> None:
    """At 8192 tokens the unchunked loss holds T * V * 4 of saved log-softmax (4.3 GB) and
    twice that in its backward; 8 chunks remove most of it."""
    from memplan.api import estimate

    base = estimate("llama-3-8b", gpus=8, zero=3, seq_len=8192)
    chunked = estimate("llama-3-8b", gpus=8, zero=3, seq_len=8192, loss_chunks=8)
    saved = 8192 * 128_256 * 4
    assert base.worst.activations_bytes - chunked.worst.activations_bytes == saved + 4
    assert chunked.peak_bytes < base.peak_bytes - saved


def test_eager_core_rerun_under_autocast_by_hand() -> None:
    """GPT-2 (a = 12, d = 64, dropout 0.1) at b = 2, s = 128 under amp-bf16 with selective
    recompute: the rerun core stops early beside the core output's gradient b s h 2 =
    2 * 128 * 768 * 2 = 393,216, the fp32 masked scores and dropout's fp32 output, each
    b a s^2 4 = 2 * 12 * 128 * 128 * 4 = 1,572,864: 3,538,944 (``eager.rerun``; the
    saved tensors it made again, ``Core.rebuilt``, are the moment's alive bytes). In bf16
    without autocast the masked scores are bf16 (786,432) and dropout's output is saved:
    393,216 + 786,432 = 1,179,648."""
    from memplan.model import eager

    spec = load_model("gpt2")
    amp = Workload(micro_batch_size=2, seq_len=128, attention=Attention.EAGER,
                   precision=Precision.AMP_BF16, recompute=Recompute.SELECTIVE)
    c = eager.core(spec, Dims.of(spec, ParallelConfig(), amp))
    assert eager.rerun(c) == 393_216 + 2 * 1_572_864 == 3_538_944
    bf16 = amp.model_copy(update={"precision": Precision.BF16_MIXED})
    c = eager.core(spec, Dims.of(spec, ParallelConfig(), bf16))
    assert eager.rerun(c) == 393_216 + 786_432


def test_full_recompute_rerun_under_autocast_by_hand() -> None:
    """GPT-2 (h = 768, biases, dropout 0.1) at b = 1, s = 256 under amp-bf16 with full
    recompute: the attention's rerun moment, beside what ``eager.forward_saving`` holds, has
    the branch gradient's bf16 cast 256 * 768 * 2 = 393,216 (rerun_in, with the fp32 incoming
    stream 786,432), the attention norm's fp32 output 786,432, and autocast's cached casts of
    the q/k/v/o biases, 4 * 768 * 2 = 6,144 B alive (``layer._rerun_moments``; the moment's
    alive bytes are checked exactly in tests/traced/test_ground_truth.py). Without autocast
    (bf16-mixed) none of the three."""
    from memplan.model import eager
    from memplan.model.attention import _core
    from memplan.model.layer import backward_moments

    spec = load_model("gpt2")

    def rerun(precision: Precision) -> tuple[int, int]:
        wl = Workload(micro_batch_size=1, seq_len=256, attention=Attention.EAGER,
                      precision=precision, recompute=Recompute.FULL)
        dm = Dims.of(spec, ParallelConfig(), wl)
        m = next(m for m in backward_moments(spec, wl, dm, moe_layer=False,
                                             recompute=Recompute.FULL) if m.name == "rebuild")
        return m.alive_bytes, m.transient_bytes - eager.forward_saving(_core(spec, wl, dm))

    from memplan.model.layer import cast_cache_bytes, layer_blocks

    _, amp_beside = rerun(Precision.AMP_BF16)
    _, bf16_beside = rerun(Precision.BF16_MIXED)
    assert amp_beside == 786_432 + 393_216 + 786_432
    assert bf16_beside == 256 * 768 * 2  # the incoming stream gradient alone, bf16
    wl = Workload(micro_batch_size=1, seq_len=256, attention=Attention.EAGER,
                  precision=Precision.AMP_BF16, recompute=Recompute.FULL)
    dm = Dims.of(spec, ParallelConfig(), wl)
    attn = layer_blocks(spec, False)[1]
    assert cast_cache_bytes(spec, wl, dm, attn, Recompute.NONE) == 6_144
