"""A compiled decoder layer's saved terms (``memplan.model.compiled``) on the tiny spec, by hand.

tiny: h = 64, f = 176 (SwiGLU), 4 query heads, 2 KV heads, d = 16 (q width 64, KV width 32),
RMSNorm, RoPE. Workload: mbs 2, seq 32, bf16 (e = 2): T = 64 tokens, T*h*e = 8,192 B.
The rules (torch/_functorch/partitioners.py ``solve_min_cut``) are traced on transformers'
Llama layer in tests/traced/test_compile_trace.py.
"""

from __future__ import annotations

import pytest

from memplan.errors import LayoutError
from memplan.model.dims import Dims, total
from memplan.model.layer import layer_kind, layer_terms
from memplan.parallel import ParallelConfig, validate
from memplan.spec import ModelSpec, load_model
from memplan.workload import Float8Recipe, Recompute, SelectiveImpl, Workload

TINY = load_model("tiny")
WL = Workload(micro_batch_size=2, seq_len=32, compile=True)
DM = Dims.of(TINY, ParallelConfig(), WL)


def test_compiled_layer_terms() -> None:
    """Each norm: its input 8,192 (the layer's input; the residual sum), rsqrt T*4 = 256, its
    output 8,192 (16,640), not the fp32 copy or the normalised tensor (recomputed pointwise);
    attention: q 8,192, k and v 64*32*2 = 4,096 each, SDPA's output 8,192, logsumexp
    2*4*32*4 = 1,024 (25,600); the MLP: gate, up and their product 64*176*2 = 22,528 each
    (67,584), not SiLU(gate). 2*16,640 + 25,600 + 67,584 = 126,464 (eager: 181,760)."""
    terms = {t.name: t.size_bytes
             for t in layer_terms(TINY, WL, DM, moe_layer=False, recompute=Recompute.NONE)
             if t.size_bytes}
    assert terms == {
        "attn_norm.input": 8_192, "attn_norm.output": 8_192, "attn_norm.stats": 256,
        "attn.q": 8_192, "attn.k": 4_096, "attn.v": 4_096, "attn.out": 8_192, "attn.lse": 1_024,
        "mlp_norm.input": 8_192, "mlp_norm.output": 8_192, "mlp_norm.stats": 256,
        "mlp.gate": 22_528, "mlp.up": 22_528, "mlp.prod": 22_528}
    assert sum(terms.values()) == 126_464
    eager = WL.model_copy(update={"compile": False})
    assert layer_kind(TINY, eager, DM, False, Recompute.NONE).saved_bytes == 181_760


def test_checkpointed_compiled_layer_keeps_its_input() -> None:
    """Full checkpointing around the compiled layer: every forward node must be recomputed,
    the layer's input (8,192) is saved."""
    assert layer_kind(TINY, WL, DM, False, Recompute.FULL).saved_bytes == 8_192


def test_checkpointed_compiled_forward_peak() -> None:
    """Full checkpointing inside the compiled graph, nothing saved: the forward's peak is at
    the up projection's matmul, beside the input 8,192 the output projection's output 8,192
    (the residual sums recomputed from it and the input), the MLP norm's output 8,192 and
    the gate and up outputs 64*176*2 = 22,528 each; SiLU(gate) * up is written into the
    gate's buffer (``compiled.checkpointed_mlp_working_bytes``): 3 x 8,192 + 2 x 22,528 =
    69,632. Eagerly SiLU(gate) is a third T x f beside them: 92,160. In fp32 twice each:
    139,264 (the traced toy's forward peak is the same sum: tests/traced/
    test_compile_trace.py)."""
    assert layer_kind(TINY, WL, DM, False, Recompute.FULL).forward_peak_bytes == 69_632
    eager = WL.model_copy(update={"compile": False})
    assert layer_kind(TINY, eager, Dims.of(TINY, ParallelConfig(), eager), False,
                      Recompute.FULL).forward_peak_bytes == 92_160
    fp32 = Workload.model_validate({**WL.model_dump(), "precision": "fp32"})
    assert layer_kind(TINY, fp32, Dims.of(TINY, ParallelConfig(), fp32), False,
                      Recompute.FULL).forward_peak_bytes == 139_264


def test_per_op_sac_compiled_drops_the_down_projections_output() -> None:
    """torchtitan's per-op SAC, compiled: the input 8,192; of the odd matmuls (q 1st, v 3rd,
    w1 5th, w2 7th) q 64*64*2 = 8,192, v 64*32*2 = 4,096, w1 64*176*2 = 22,528, not w2's
    output (read by the residual add alone); SDPA's output 8,192 and logsumexp 1,024:
    52,224 (eagerly w2's 8,192 more: 60,416)."""
    wl = WL.model_copy(update={"recompute": Recompute.SELECTIVE,
                               "selective_impl": SelectiveImpl.OP})
    assert layer_kind(TINY, wl, DM, False, Recompute.SELECTIVE).saved_bytes == 52_224
    eager = wl.model_copy(update={"compile": False})
    assert layer_kind(TINY, eager, DM, False, Recompute.SELECTIVE).saved_bytes == 60_416


@pytest.mark.parametrize("sp,recipe,fused,saved", [
    (True, "none", False, 30_208), (True, "tensorwise", False, 30_208),
    (True, "rowwise", False, 32_000), (False, "none", False, 38_400),
    (False, "rowwise", False, 40_192), (True, "none", True, 32_256),
    (True, "rowwise", True, 33_280)])
def test_per_op_sac_compiled_under_tp(sp: bool, recipe: str, fused: bool, saved: int) -> None:
    """torchtitan's per-op SAC, compiled, at tp 2 in the DTensor style
    (``memplan.model.compiled.sac_tp_terms``, traced in tests/traced/test_compile_trace.py).
    With SP the input is its 32-token shard, 32*64*2 = 4,096; the odd matmuls' outputs on this
    rank q 64*32*2 = 4,096, v 64*16*2 = 2,048, w1 64*88*2 = 11,264; SDPA's output 4,096 and
    logsumexp 2*2*32*4 = 512; the output projection's reduce-scattered output 4,096 (in the
    save list, read by backward): 30,208, tensorwise the same (its scalars not counted).
    Rowwise adds per norm one of whose linears is rerun (k; up, the 6th matmul) its input's
    row scales, 64*4 = 256 twice, and per column-parallel linear (q, k, v, gate, up) its
    weight's 64 fp32 backward scales, 5*256 = 1,280: 32,000. Without SP the input is
    64*64*2 = 8,192, no reduce-scatter, and the down projection's output 64*64*2 = 8,192 is
    saved (its all-reduce rerun in backward reads it): 38,400, rowwise 40,192. A fused qkv
    (1st, kept: 64*64*2 = 8,192 in place of q and v; w1 3rd, w2 5th): 32,256; rowwise the
    MLP's row scales alone (qkv is not rerun), 256, and 3*256 weight scales: 33,280."""
    wl = WL.model_copy(update={"recompute": Recompute.SELECTIVE,
                               "float8": Float8Recipe(recipe), "fused_qkv": fused,
                               "selective_impl": SelectiveImpl.OP})
    par = ParallelConfig(tp=2, sequence_parallel=sp, tp_style="dtensor")
    validate(TINY, par, wl)
    dm = Dims.of(TINY, par, wl)
    assert layer_kind(TINY, wl, dm, False, Recompute.SELECTIVE).saved_bytes == saved


@pytest.mark.parametrize("sp,saved", [(True, 82_746), (False, 82_994)])
def test_compiled_float8_tp_layer_without_recompute(sp: bool, saved: int) -> None:
    """torchao's tensorwise float8 TP styles at tp 2, compiled, no recompute
    (``memplan.model.compiled.float8_tp_weights``, ``float8_tp_gathered_kept``; traced in
    tests/traced/test_compile_trace.py). Beyond the compiled float8 layer on the rank's
    shards, the float8 casts of the weight shards, 1 B each: q 64*64/2 = 2,048, k and v
    64*32/2 = 1,024 each, o 2,048 (6,144); gate, up and down 64*176/2 = 5,632 each (16,896).
    With SP each norm's all-gathered float8 output is saved too, 64*64*1 + its fp32 scale
    = 4,100. So with SP: the norms' input shards 32*64*2 = 4,096 and rsqrt 32*4 = 128 twice
    (8,448) and their gathered casts (8,200); q 64*32*2 = 4,096, k and v 64*16*2 = 2,048
    each, SDPA's output 4,096 and logsumexp 2*2*32*4 = 512, the output projection's float8
    input 64*32 + 4 = 2,052, four amaxes and scales 4*6 = 24 (14,876); gate and up 64*88*2 =
    11,264 each, the down projection's float8 input 64*88 + 4 = 5,636, three amaxes and
    scales 18 (28,182); the weights 23,040: 82,746. Without SP the norms' inputs are
    64*64*2 = 8,192, their rsqrt 64*4 = 256 (16,896), no gathered cast: 82,994."""
    wl = WL.model_copy(update={"float8": Float8Recipe.TENSORWISE})
    par = ParallelConfig(tp=2, sequence_parallel=sp, tp_style="dtensor")
    validate(TINY, par, wl)
    dm = Dims.of(TINY, par, wl)
    terms = {t.name: t.size_bytes
             for t in layer_terms(TINY, wl, dm, moe_layer=False, recompute=Recompute.NONE)}
    assert terms["attn.float8_weights"] == 6_144 and terms["mlp.float8_weights"] == 16_896
    assert terms.get("attn_norm.output", 0) == (4_100 if sp else 0)
    assert sum(terms.values()) == saved
    # per-op SAC recomputes the casts: neither the weights' nor the gathered inputs'
    sac = wl.model_copy(update={"recompute": Recompute.SELECTIVE,
                                "selective_impl": SelectiveImpl.OP})
    kept = {t.name for t in layer_terms(TINY, sac, dm, moe_layer=False,
                                        recompute=Recompute.SELECTIVE)}
    assert not {"attn.float8_weights", "mlp.float8_weights"} & kept


def test_compiled_lora_layer_terms() -> None:
    """LoRA r8 on q and v (frozen base weights, bf16, fp32 adapters), compiled: the attention
    norm saves its input 8,192 and rsqrt 256, not its output (no trainable matmul reads it:
    the adapters read their fp32 cast of it); q, k, v, SDPA's output and logsumexp as without
    LoRA (25,600); the adapters one fp32 cast of the norm's output for both (AOTAutograd's
    CSE: 64*64*4 = 16,384; eagerly one per adapter, 32,768) and their rank-8 outputs
    2*64*8*4 = 4,096; the MLP norm its input and rsqrt (8,448); the frozen MLP gate and up
    (45,056), not their product (the frozen down projection reads it, recomputed).
    8,448 + 25,600 + 20,480 + 8,448 + 45,056 = 108,032 (eager: 163,328)."""
    wl = WL.model_copy(update={"lora_rank": 8, "lora_targets": ("q", "v")})
    dm = Dims.of(TINY, ParallelConfig(), wl)
    terms = {t.name: t.size_bytes
             for t in layer_terms(TINY, wl, dm, moe_layer=False, recompute=Recompute.NONE)
             if t.size_bytes}
    assert terms["attn.lora_input"] == 16_384 and terms["attn.lora_rank"] == 4_096
    assert "attn_norm.output" not in terms and "mlp.prod" not in terms
    assert sum(terms.values()) == 108_032
    eager = wl.model_copy(update={"compile": False})
    assert layer_kind(TINY, eager, Dims.of(TINY, ParallelConfig(), eager), False,
                      Recompute.NONE).saved_bytes == 163_328


@pytest.mark.parametrize(("model", "update", "why"), [
    ("mixtral-8x7b", {}, "MoE layers"),
    ("tiny", {"precision": "amp-bf16", "fused_qkv": True},
     "precision amp-bf16 and torchtitan's fused wqkv without recompute"),
    ("tiny", {"precision": "amp-bf16", "lora_rank": 8}, "precision amp-bf16 and LoRA"),
    ("tiny", {"precision": "amp-fp16", "recompute": "full", "compile_in_checkpoint": True},
     "precision amp-fp16 and the activation checkpoint around"),
    ("lfm2-1.2b", {"precision": "amp-bf16"}, "precision amp-bf16 and q/k norms other than"),
    ("olmo-2-7b", {"precision": "amp-bf16"}, "post norms and precision amp-bf16"),
    ("command-r7b", {"precision": "amp-bf16"}, r"layers without RoPE \(NoPE\)"),
    ("phi-3-mini-4k", {"precision": "amp-bf16", "recompute": "selective",
                       "selective_impl": "op", "seq_len": 1024},
     "fused gate and up projections with selective recompute"),
    ("mistral-7b", {"precision": "amp-bf16", "seq_len": 4096},
     "sliding-window attention over a sequence as long as the window"),
    ("tiny", {"attention": "eager"}, "attention eager"),
    ("tiny", {"lora_rank": 8, "base_quant": "nf4"}, "base_quant nf4"),
    ("tiny", {"lora_rank": 8, "recompute": "full"}, "checkpoint inside the compiled graph"),
    ("tiny", {"lora_rank": 8, "recompute": "full", "compile_in_checkpoint": True,
              "lora_targets": ["q", "v", "gate"]}, "LoRA on the MLP inside"),
    ("tiny", {"lora_rank": 8, "recompute": "full", "compile_in_checkpoint": True,
              "lora_targets": ["down"]}, "LoRA on the MLP inside"),
    ("tiny", {"lora_rank": 8, "recompute": "full", "compile_in_checkpoint": True,
              "lora_targets": "all-linear", "lora_dropout": 0.05}, "LoRA on the MLP inside"),
    ("tiny", {"recompute": "selective"}, r"recompute selective \(core\)"),
])
def test_compile_refuses_what_is_not_modelled(model: str, update: dict, why: str) -> None:
    wl = Workload.model_validate({**WL.model_dump(), **update})
    with pytest.raises(LayoutError, match=why):
        validate(load_model(model), ParallelConfig(), wl)


def test_compile_under_autocast_refuses_more_than_one_rank() -> None:
    wl = Workload.model_validate({**WL.model_dump(), "precision": "amp-bf16"})
    validate(TINY, ParallelConfig(), wl)
    with pytest.raises(LayoutError, match="tp 2, cp 1"):
        validate(TINY, ParallelConfig(tp=2), wl)


AMP = Workload.model_validate({**WL.model_dump(), "precision": "amp-bf16"})
AMP_DM = Dims.of(TINY, ParallelConfig(), AMP)


def test_compiled_autocast_layer_terms() -> None:
    """fp32 weights under autocast to bf16 (traced: tests/traced/test_compile_trace.py): the
    attention norm's fp32 input (the layer's) T*h*4 = 16,384, rsqrt 256 each, each norm's
    output as one bf16 cast 8,192 (eagerly one per reading linear: 3 and 2); the MLP norm's
    input as the output projection's bf16 output 8,192 (the fp32 residual sum recomputed);
    q and k the bf16 casts of RoPE's fp32 outputs 8,192 and 4,096, v 4,096, SDPA's output
    8,192 and logsumexp 1,024; gate, up and product 22,528 each; the bf16 casts of the
    weights, attention (64*64 + 2*64*32 + 64*64) * 2 = 24,576 and MLP 3*64*176*2 = 67,584.
    16,384 + 2*256 + 4*8,192 + 8,192 + 2*4,096 + 8,192 + 1,024 + 3*22,528 + 24,576 + 67,584
    = 226,816."""
    terms = {t.name: t.size_bytes
             for t in layer_terms(TINY, AMP, AMP_DM, moe_layer=False, recompute=Recompute.NONE)
             if t.size_bytes}
    assert terms == {
        "attn_norm.input": 16_384, "attn_norm.output": 8_192, "attn_norm.stats": 256,
        "attn.q": 8_192, "attn.k": 4_096, "attn.v": 4_096, "attn.out": 8_192,
        "attn.lse": 1_024, "attn.weight_casts": 24_576,
        "mlp_norm.input": 8_192, "mlp_norm.output": 8_192, "mlp_norm.stats": 256,
        "mlp.gate": 22_528, "mlp.up": 22_528, "mlp.prod": 22_528,
        "mlp.weight_casts": 67_584}
    assert sum(terms.values()) == 226_816


def test_compiled_autocast_layer_moments() -> None:
    """Forward: the saved set (226,816) and, at the MLP's residual add, the down
    projection's bf16 output 8,192 beside the fp32 sum 16,384 (not in place: another dtype),
    no fp32 norm output (fused into its cast): 251,392. Backward's end: the incoming and
    the input's fp32 gradients 16,384 each and up's bf16 weight gradient 64*176*2 = 22,528
    (55,296) beside every gradient. Full checkpointing, the checkpoint in the graph: the
    input 16,384 saved; forward at the MLP's activation: the input, the output projection's
    output and the MLP norm's cast 8,192 each, gate and up 22,528 each, the down weight's
    cast 22,528: 100,352; no autocast cache (the casts are graph nodes)."""
    kind = layer_kind(TINY, AMP, AMP_DM, False, Recompute.NONE)
    assert kind.forward_peak_bytes == 251_392
    end = kind.moments[-1]
    assert (end.name, end.alive_bytes, end.transient_bytes) == ("compiled_end", 0, 55_296)
    assert set(end.grads_before) == {"attn_norm", "attn", "mlp_norm", "mlp"}
    full = AMP.model_copy(update={"recompute": Recompute.FULL})
    kind = layer_kind(TINY, full, AMP_DM, False, Recompute.FULL)
    assert (kind.saved_bytes, kind.forward_peak_bytes, kind.cached_bytes) == (16_384, 100_352, 0)
    assert kind.moments[-1].transient_bytes == 55_296



def test_compiled_autocast_fused_qkv_under_full_recompute() -> None:
    """A fused qkv projection (torchtitan's wqkv) under autocast with full recompute, the
    checkpoint inside the compiled graph (traced: tests/traced/test_compile_trace.py,
    torchtitan's block at 2 x 256 and 2 x 1,024): the same bytes as separate q/k/v, none of
    them the projection's. T = 64, h 64, kv 32, f 176: the input T*h*4 = 16,384 saved;
    forward at the MLP's activation 16,384 + 2 x 8,192 (the output projection's output, the
    MLP norm's cast) + 2 x 22,528 (gate, up) + 22,528 (the down weight's cast) = 100,352;
    the backward's end 16,384 + 16,384 + 64*176*2 = 55,296 beside every gradient.

    Under per-op SAC (``compiled.autocast_sac_deferred``) the full recompute's moments but
    at the MLP's kernel: the attention side the rerun would have rebuilt, less what the
    policy keeps of it, deferred (the norm's cast 8,192 and statistics 256, q 8,192, k and
    v 4,096 each, SDPA's output 8,192 and logsumexp 1,024, the attention weights' casts
    24,576: 58,624, less the kept wqkv output T*128*2 = 16,384, SDPA's output and
    logsumexp: 33,024), the gate weight's cast not made (22,528), the output projection's
    made (64*64*2 = 8,192): 47,360 below full's. Without recompute torchtitan's fused wqkv
    stays refused."""
    full = AMP.model_copy(update={"recompute": Recompute.FULL, "fused_qkv": True})
    validate(TINY, ParallelConfig(), full)
    dm = Dims.of(TINY, ParallelConfig(), full)
    kind = layer_kind(TINY, full, dm, False, Recompute.FULL)
    assert (kind.saved_bytes, kind.forward_peak_bytes, kind.cached_bytes) == (16_384, 100_352, 0)
    assert kind.moments[-1].transient_bytes == 55_296
    sac = full.model_copy(update={"recompute": Recompute.SELECTIVE,
                                  "selective_impl": SelectiveImpl.OP})
    validate(TINY, ParallelConfig(), sac)
    rebuilt = {m.name: m for m in kind.moments}
    for m in layer_kind(TINY, sac, dm, False, Recompute.SELECTIVE).moments:
        assert rebuilt[m.name].alive_bytes - m.alive_bytes == (
            47_360 if m.name == "mlp_act" else 0)
    with pytest.raises(LayoutError, match="torchtitan's fused wqkv without recompute"):
        validate(TINY, ParallelConfig(), full.model_copy(update={"recompute": Recompute.NONE}))


def test_compiled_autocast_per_op_sac_forward_holds_the_gate_once() -> None:
    """torchtitan's per-op SAC under autocast, the checkpoint inside the compiled graph
    (traced: tests/traced/test_compile_trace.py, torchtitan's block, 2 x 256 and 2 x 1,024,
    exact): the input 16,384 and the policy's outputs, q's 8,192, v's 4,096, the gate's
    T*f*2 = 22,528, SDPA's output 8,192 and logsumexp 1,024: 60,416 saved. The forward
    peaks at the MLP's activation kernel (``compiled.autocast_checkpointed_forward_bytes``,
    100,352 with the input), whose gate output is the kept one: 100,352 + 44,032 - 22,528 =
    121,856."""
    sac = AMP.model_copy(update={"recompute": Recompute.SELECTIVE,
                                 "selective_impl": SelectiveImpl.OP})
    kind = layer_kind(TINY, sac, AMP_DM, False, Recompute.SELECTIVE)
    assert (kind.saved_bytes, kind.forward_peak_bytes) == (60_416, 121_856)

TINY_MOE = TINY.model_validate({**TINY.model_dump(), "name": "tiny-moe",
                                "moe": {"num_experts": 4, "top_k": 2,
                                        "expert_ffn_hidden_size": 96,
                                        "stacked_experts": True}})


def _compiled_moe_terms(impl: str, spec=TINY_MOE) -> dict[str, int]:
    wl = Workload.model_validate({**WL.model_dump(), "moe_impl": impl})
    validate(spec, ParallelConfig(), wl)
    dm = Dims.of(spec, ParallelConfig(), wl)
    return {t.name: t.size_bytes
            for t in layer_terms(spec, wl, dm, moe_layer=True, recompute=Recompute.NONE)
            if t.name.startswith("moe.") and t.size_bytes}


def test_compiled_grouped_token_moe_terms() -> None:
    """transformers 5.3's grouped experts compiled (``memplan.model.compiled.moe_terms``,
    moe_impl grouped-token): T = 64 tokens, k = 2 (S = 128 routed rows), E = 4, expert ffn
    96, bf16. The router's logits 64*4*2 = 512 (not the fp32 probabilities), the top-k
    indices, their flattened copy, the sort and its inverse 128*8 = 1,024 each, the top-k
    fp32 values 128*4 = 512 (not their per-token sum), the sorted gathered rows 128*64*2 =
    16,384, gate, up and their product 128*96*2 = 24,576 each (not SiLU(gate)), the down
    output 16,384, the sorted fp32 weights 512, the int32 offsets 4*4 = 16: 112,144 (no
    token index)."""
    terms = _compiled_moe_terms("grouped-token")
    assert terms == {
        "moe.router_logits": 512, "moe.topk_indices": 1_024, "moe.topk_weights": 512,
        "moe.sort_index": 1_024, "moe.unsort_index": 1_024, "moe.dispatched": 16_384,
        "moe.expert.gate": 24_576, "moe.expert.up": 24_576, "moe.expert.prod": 24_576,
        "moe.expert_out": 16_384, "moe.routing_weights": 512, "moe.expert_ids": 1_024,
        "moe.offsets": 16}
    assert sum(terms.values()) == 112_144


def test_compiled_grouped_moe_terms() -> None:
    """transformers 5.23's grouped experts compiled (moe_impl grouped: ``torch.sort`` of the
    flattened ids, one gather ``hidden_states[perm // num_top_k]``), the toy above: the
    gathered rows' token index perm // k, int64, 128*8 = 1,024, saved (the gather's backward
    reads it); neither the flattened top-k indices (1,024) nor the sorted fp32 weights (512,
    recomputed from the saved top-k values and sort): 112,144 - 1,024 - 512 + 1,024 =
    111,632. A router casting its top-k weights to the logits' dtype (5.23's Qwen3-MoE)
    saves the same: the fp32 top-k values, the cast recomputed."""
    terms = _compiled_moe_terms("grouped")
    assert terms == {
        "moe.router_logits": 512, "moe.topk_indices": 1_024, "moe.topk_weights": 512,
        "moe.token_index": 1_024, "moe.sort_index": 1_024, "moe.unsort_index": 1_024,
        "moe.dispatched": 16_384, "moe.expert.gate": 24_576, "moe.expert.up": 24_576,
        "moe.expert.prod": 24_576, "moe.expert_out": 16_384, "moe.offsets": 16}
    assert sum(terms.values()) == 111_632
    cast = TINY_MOE.model_copy(update={"moe": TINY_MOE.moe.model_copy(
        update={"router_weights_cast": True})})
    assert _compiled_moe_terms("grouped", cast) == terms


@pytest.mark.parametrize("update,why", [
    ({"moe_impl": "loop"}, "MoE layers under generic, moe_impl loop"),
    ({"precision": "fp32"}, r"MoE layers in fp32 \(transformers' grouped experts compile"),
    ({"recompute": "selective", "selective_impl": "op"}, "MoE layers and recompute selective"),
    ({"moe_impl": "grouped-token", "cast": True},
     "MoE layers whose router casts its top-k weights, moe_impl grouped-token"),
])
def test_compiled_moe_refusals(update: dict, why: str) -> None:
    """What a compiled MoE layer is not derived for is refused by name (a router casting its
    top-k weights traced with 5.23's experts alone, moe_impl grouped)."""
    update = dict(update)
    spec = TINY_MOE
    if update.pop("cast", False):
        spec = spec.model_copy(update={"moe": spec.moe.model_copy(
            update={"router_weights_cast": True})})
    wl = Workload.model_validate({**WL.model_dump(), "moe_impl": "grouped", **update})
    with pytest.raises(LayoutError, match=why):
        validate(spec, ParallelConfig(), wl)


@pytest.mark.parametrize(("precision", "saved", "forward", "backward"), [
    ("bf16-pure", 112_640, (110_592, 112_640), (65_536, 202_752)),
    ("fp32", 141_312, (139_264, 90_112), (94_208, 270_336))])
def test_compiled_adapted_mlp_moments(precision: str, saved: int, forward: tuple,
                                      backward: tuple) -> None:
    """LoRA rank 8 on gate, up and down of the tiny MLP, compiled (T = 64, f = 176, h = 64;
    T*f = 11,264 elements; rank-r outputs T*8*4 = 2,048 B each), at Inductor's fused
    pointwise kernels (``compiled.lora_mlp_forward``, ``lora_mlp_backward``).

    bf16 base, fp32 adapters: the MLP saves the gate and up sums (bf16, 22,528 each), the
    fp32 cast of its input (64*64*4 = 16,384, shared by gate's and up's ``lora_A``) and of
    the product (45,056), three rank-r outputs (6,144): 112,640. Forward kernel: the down
    adapter's rank-r output not made yet (-2,048: 110,592); beside, the gate and up
    ``lora_B`` outputs (fp32, 45,056 each) and the bf16 product (22,528): 112,640. Backward
    kernel: the down adapter's cast and rank-r output freed (-47,104: 65,536); the
    product's gradients (bf16 22,528 + fp32 45,056), gate's and up's for their bases (bf16,
    2 x 22,528) and for their ``lora_B`` (fp32, 2 x 45,056): 202,752.

    fp32: gate, up and the product (kept: the down adapter's input) 45,056 each, three
    rank-r outputs: 141,312. Forward: 139,264 beside the two ``lora_B`` outputs (90,112).
    Backward: the product and the rank-r output freed (94,208); the product's two gradients,
    gate's and up's two each (6 x 45,056): 270,336, none written into the saved up sum
    (with a GPU's realization rules the kernel reads it from more than one node)."""
    from memplan.model.mlp import Mlp

    wl = Workload.model_validate({**WL.model_dump(), "precision": precision, "lora_rank": 8,
                                  "lora_targets": "gate,up,down"})
    dm = Dims.of(TINY, ParallelConfig(), wl)
    mlp = Mlp()
    assert total(mlp.saved(TINY, wl, dm, Recompute.NONE)) == saved
    fwd = {m.name: m for m in mlp.forward_moments(TINY, wl, dm, Recompute.NONE)}
    assert (fwd["mlp_lora"].own_bytes, fwd["mlp_lora"].transient_bytes) == forward
    bwd = {m.name: m for m in mlp.backward_moments(TINY, wl, dm, Recompute.NONE)}
    assert (bwd["mlp_lora"].own_bytes, bwd["mlp_lora"].transient_bytes) == backward
    assert [m.own_bytes for m in mlp.rebuild_moments(TINY, wl, dm)] == [forward[0]]


def test_compiled_adapted_mlp_in_checkpoint_is_modelled() -> None:
    """Every linear adapted, the compiled layer inside its checkpoint: validated."""
    wl = Workload.model_validate({**WL.model_dump(), "lora_rank": 8,
                                  "lora_targets": "all-linear", "recompute": "full",
                                  "compile_in_checkpoint": True})
    validate(TINY, ParallelConfig(), wl)


def test_compiled_torchao_nf4_saves_dequantized_weights() -> None:
    """torchao's NF4 base weights compiled (``linear.compiled_dequant_terms``): each adapted
    (so quantized) linear's dequantized weight in the compute dtype (bf16, 2 B), beside the
    unquantized compiled layer's terms. tiny: q and o 64 x 64 = 4,096 elements each, k and v
    64 x 32 = 2,048 each (attention 12,288: 24,576 B); gate, up, down 64 x 176 = 11,264 each
    (33,792: 67,584 B); 92,160 B in all."""
    base = Workload.model_validate({**WL.model_dump(), "lora_rank": 8,
                                    "lora_targets": "all-linear"})
    quant = Workload.model_validate({**base.model_dump(), "base_quant": "nf4-torchao-0.1"})
    validate(TINY, ParallelConfig(), quant)

    def terms(wl: Workload) -> dict[str, int]:
        return {t.name: t.size_bytes
                for t in layer_terms(TINY, wl, Dims.of(TINY, ParallelConfig(), wl),
                                     moe_layer=False, recompute=Recompute.NONE)}

    plain, nf4 = terms(base), terms(quant)
    assert nf4["attn.dequant_weights"] == 24_576 and nf4["mlp.dequant_weights"] == 67_584
    assert sum(nf4.values()) - sum(plain.values()) == 92_160


def test_autocast_down_gradient_deferred_by_size() -> None:
    """Inductor keeps the order of the lower estimated peak at the MLP's fused kernel
    (``compiled.down_grad_deferred``): the down weight's fp32 gradient h*f*4 = 64*176*4 =
    45,056 against the product and the incoming gradient's cast. T = 64: 64*176*2 = 22,528
    + 64*64*2 = 8,192 = 30,720 < 45,056: deferred. T = 128: 45,056 + 16,384 = 61,440:
    first. Without autocast never deferred."""
    from memplan.model.compiled import down_grad_deferred

    assert down_grad_deferred(AMP_DM, 22_528, 8_192, 11_264)
    assert not down_grad_deferred(AMP_DM, 45_056, 16_384, 11_264)
    assert not down_grad_deferred(DM, 22_528, 0, 11_264)


def test_autocast_swiglu_moments_deferred() -> None:
    """T = 64 under autocast, the down weight's gradient deferred: the MLP saves gate, up,
    product 22,528 each and its weights' bf16 casts 67,584: 135,168. The down projection's
    grad-input matmul: all of it, beside the incoming gradient's bf16 cast 8,192 and its
    output 22,528 (30,720); the fused kernel: the down weight's cast 22,528 freed (112,640),
    beside the cast and the kernel's input gradient and new gradient (2 * 22,528 + 8,192 =
    53,248); the input projections: gate freed too (90,112), beside the cast, gate's
    gradient 22,528 and both input gradients 2 * 8,192 (47,104). No weight gradient yet."""
    from memplan.model.compiled import swiglu_moments

    got = swiglu_moments(AMP, AMP_DM, 135_168, 22_528, 16_384, 11_264, 22_528)
    assert [(m.name, m.own_bytes, m.transient_bytes, m.grads) for m in got] == [
        ("mlp", 135_168, 30_720, ()), ("mlp_act", 112_640, 53_248, ()),
        ("mlp_in", 90_112, 47_104, ())]


def test_autocast_swiglu_moments_down_gradient_first() -> None:
    """T = 128 (seq 64) under autocast, the down weight's gradient first: inner 128*176*2 =
    45,056, the cast 16,384, saved 3 * 45,056 + 67,584 = 202,752. The grad-input matmul:
    the product freed by the weight gradient's matmul (157,696), beside its output and the
    cast (61,440), the down gradient made; the kernel: the down weight's cast 22,528 freed
    too (135,168), two gradients 90,112 (the cast freed); then the input projections as
    without autocast (0 own, both input gradients 32,768 and one inner, 77,824)."""
    from memplan.model.compiled import swiglu_moments

    wl = AMP.model_copy(update={"seq_len": 64})
    dm = Dims.of(TINY, ParallelConfig(), wl)
    got = swiglu_moments(wl, dm, 202_752, 45_056, 32_768, 11_264, 22_528)
    assert [(m.name, m.own_bytes, m.transient_bytes, m.grads, m.fresh_params, m.hook_freed)
            for m in got] == [
        ("mlp", 157_696, 61_440, ("mlp_out",), 11_264, 0),
        ("mlp_act", 135_168, 90_112, ("mlp_out",), 0, 0),
        ("mlp_in", 0, 77_824, ("mlp",), 11_264, 0)]


def test_autocast_deferred_mlp_holds_what_its_weight_gradients_read() -> None:
    """T = 64, deferred: after the MLP's moments, until the end, no MLP weight gradient
    exists and the product, gate's and up's gradients (3 * 22,528) and the incoming
    gradient's cast 8,192 are alive (75,776), and after the MLP norm's backward its output's
    cast 8,192 too (83,968); the MLP's own moments and the end are left as they are."""
    from memplan.model.compiled import with_deferred_mlp
    from memplan.model.layer import LayerMoment

    moments = [LayerMoment("mlp_act", 10, 1, ()), LayerMoment("mlp_norm", 10, 1, ("mlp",)),
               LayerMoment("attn_in", 10, 1, ("mlp", "mlp_norm", "attn")),
               LayerMoment("compiled_end", 0, 1, ("mlp", "mlp_norm", "attn"))]
    got = with_deferred_mlp(moments, TINY, AMP, AMP_DM)
    assert [(m.name, m.alive_bytes, m.grads_before) for m in got] == [
        ("mlp_act", 10, ()), ("mlp_norm", 75_786, ()),
        ("attn_in", 83_978, ("mlp_norm", "attn")),
        ("compiled_end", 0, ("mlp", "mlp_norm", "attn"))]
    assert with_deferred_mlp(moments, TINY, WL, DM) == moments


# OLMo 2's layer on the tiny widths (``NormPlacement.POST``: no norm before the mixers, an
# RMSNorm after each; q/k norms over the whole projection), traced on transformers'
# Olmo2DecoderLayer in tests/traced/test_compile_trace.py
POST = ModelSpec.model_validate({**TINY.model_dump(), "norm_placement": "post",
                                 "qk_norm": "full"})


def _post_kind(recompute: str):
    wl = Workload.model_validate({**WL.model_dump(), "recompute": recompute})
    validate(POST, ParallelConfig(), wl)  # no longer refused
    dm = Dims.of(POST, ParallelConfig(), wl)
    return {m.name: m for m in layer_kind(POST, wl, dm, False, Recompute(recompute)).moments}


def test_compiled_post_norm_layer_terms() -> None:
    """Without recompute, by hand (S = T*h*e = 8,192, rows fp32 r = 256, F = T*f*e = 22,528):
    the layer's input (the q/k/v projections read the stream itself) S; q and k before their
    norms (8,192 and 4,096: matmul outputs, the norms' inputs) with a statistic r each;
    RoPE'd q 8,192 and k 4,096, v 4,096, SDPA's output 8,192 and logsumexp 1,024; each post
    norm's input (the output and down projections' outputs, S) and statistic r; the residual
    sum the MLP reads S; gate, up and their product 3 F: 139,264 B (traced on the OLMo 2
    toy: the partitioner's saved set, exact)."""
    wl = Workload.model_validate({**WL.model_dump()})
    dm = Dims.of(POST, ParallelConfig(), wl)
    terms = {t.name: t.size_bytes
             for t in layer_terms(POST, wl, dm, moe_layer=False, recompute=Recompute.NONE)
             if t.size_bytes}
    assert terms == {
        "attn_input.output": 8_192, "attn.q_norm.input": 8_192, "attn.q_norm.stats": 256,
        "attn.k_norm.input": 4_096, "attn.k_norm.stats": 256, "attn.q": 8_192,
        "attn.k": 4_096, "attn.v": 4_096, "attn.out": 8_192, "attn.lse": 1_024,
        "attn_post_norm.input": 8_192, "attn_post_norm.stats": 256,
        "mlp_input.output": 8_192, "mlp.gate": 22_528, "mlp.up": 22_528,
        "mlp.prod": 22_528, "mlp_post_norm.input": 8_192, "mlp_post_norm.stats": 256}
    assert sum(terms.values()) == 139_264


def test_compiled_post_norm_backward_moments() -> None:
    """The compiled post norms' backward (``compiled.post_norm_backward_bytes``,
    ``with_post_norm_schedule``, ``swiglu_moments``' ``post_grad``), by hand (S 8,192, r
    256, F 22,528; the saved set 139,264):

    - the MLP post norm's kernel: beside the saved set, the incoming gradient S, its input
      gradient S and its fp32 row sums r: transient 16,640;
    - the down projection's grad-input matmul: the product freed (139,264 - F = 116,736,
      the post norm's input and statistic still alive for its weight gradient's reduction,
      run after the MLP), the incoming gradient, the product's gradient F and the post
      norm's input gradient S: 38,912; the down weight's gradient made, the post norm's not;
    - the MLP's kernel: the post norm's input gradient freed, the gate's gradient new: the
      incoming S + 2 F = 53,248 beside 116,736;
    - at the attention post norm's kernel the MLP post norm's weight gradient exists.

    Full recompute inside the compiled graph (``rerun_whole_mlp``): the rerun runs the whole
    MLP, the product among it, beside the saved set and the token-major copy of SDPA's
    output (T*q*e = 8,192): 139,264 + 8,192 = 147,456 at the rerun's end, no SiLU(gate)
    buffer (inlined, as a GPU's Inductor lowers it; on CPU a buffer of its own, F more until
    the MLP's kernel: ``StorageBox.should_realize_on_reuse``'s heavy ``sigmoid``); at the
    down projection 124,928 (the product freed), the same transient; at the kernel the
    gate's gradient a new buffer: 124,928 (the layer not rebuilt's 116,736 + the copy)."""
    none = _post_kind("none")
    assert none["mlp_post_norm"].alive_bytes == 139_264
    assert none["mlp_post_norm"].transient_bytes == 16_640
    assert (none["mlp"].alive_bytes, none["mlp"].transient_bytes) == (116_736, 38_912)
    assert none["mlp"].grads_before == ("mlp_out",)
    assert (none["mlp_act"].alive_bytes, none["mlp_act"].transient_bytes) == (116_736, 53_248)
    assert "mlp_post_norm" not in none["mlp_in"].grads_before
    assert "mlp_post_norm" in none["attn_post_norm"].grads_before
    full = _post_kind("full")
    assert full["rebuild_out"].alive_bytes == 147_456
    assert (full["mlp"].alive_bytes, full["mlp"].transient_bytes) == (124_928, 38_912)
    assert full["mlp_act"].alive_bytes == 124_928


def test_compiled_post_norm_checkpointed_forward_holds_the_qk_statistics() -> None:
    """Checkpointed inside the compiled graph, RoPE's moment holds the q and k norms'
    statistics (``compiled.qk_norm_stats_bytes``: 2 x T fp32 = 512 B) beside what it holds
    eagerly; the same layer without q/k norms holds neither."""
    from memplan.model.compiled import qk_norm_stats_bytes

    wl = Workload.model_validate({**WL.model_dump(), "recompute": "full"})
    dm = Dims.of(POST, ParallelConfig(), wl)
    assert qk_norm_stats_bytes(POST, dm) == 512
    assert qk_norm_stats_bytes(TINY, Dims.of(TINY, ParallelConfig(), wl)) == 0
    eager = wl.model_copy(update={"compile": False})
    assert qk_norm_stats_bytes(POST, Dims.of(POST, ParallelConfig(), eager)) == 0


@pytest.mark.parametrize(("update", "recompute", "why"), [
    ({"norm_placement": "sandwich"}, "none", r"sandwich norms and q/k norms full \(traced: none"),
    ({"qk_norm": "head"}, "none", r"post norms and q/k norms head \(traced: full"),
    ({"norm_placement": "sandwich", "qk_norm": "none"}, "full",
     "sandwich norms, recompute full and an MLP other than GeGLU"),
    ({"sliding_window": 32}, "none", "sliding-window attention over a sequence as long"),
    ({"qkv_bias": True}, "none", "post norms and biases"),
    ({"mlp": "geglu"}, "full", "an MLP other than SwiGLU or GeGLU"),
])
def test_compiled_post_norms_refuse_what_is_not_traced(update: dict, recompute: str,
                                                       why: str) -> None:
    spec = ModelSpec.model_validate({**POST.model_dump(), **update})
    wl = Workload.model_validate({**WL.model_dump(), "recompute": recompute})
    with pytest.raises(LayoutError, match=why):
        validate(spec, ParallelConfig(), wl)
    # a window longer than the sequence: transformers skips SDPA's mask, as traced
    validate(ModelSpec.model_validate({**POST.model_dump(), "sliding_window": 33}),
             ParallelConfig(), WL)
    amp = WL.model_copy(update={"precision": "amp-bf16"})
    with pytest.raises(LayoutError, match="post norms and precision amp-bf16"):
        validate(POST, ParallelConfig(), Workload.model_validate(amp.model_dump()))
    with pytest.raises(LayoutError, match="post norms, tp 2, cp 1"):
        validate(POST, ParallelConfig(tp=2), WL)


# Gemma 2's layer on the tiny widths: sandwich norms, no q/k norms, GeGLU (traced on
# transformers' Gemma2DecoderLayer: benchmarks/compiled_backward.py)
SANDWICH = ModelSpec.model_validate({**TINY.model_dump(), "norm_placement": "sandwich",
                                     "mlp": "geglu"})


def test_compiled_sandwich_layer_terms_and_moments() -> None:
    """Without recompute, by hand (S = 8,192, r = 256, F = 22,528, k and v 4,096 each): the
    input norm's input (the layer's) S, statistic r and output S; q (RoPE'd) S, k, v, SDPA's
    output S, logsumexp 1,024; the post-attention norm's input (the output projection's
    output) S and r; the pre-feedforward norm's statistic r and output S but not its input,
    the residual sum, recomputed from the layer's input and the post-attention norm's saved
    tensors (``compiled.norm_input_e``); gate, up, product 3 F; the post-feedforward norm's
    input S and r: 7 S + 4 r + 8,192 + 1,024 + 3 F = 135,168 B (the eager-order count with
    the sum: 143,360).

    Backward: GeGLU's kernels are SwiGLU's (``compiled.swiglu_backward``); the MLP post
    norm's weight gradient is fused with the other norms' after the attention's backward, as
    a GPU's Inductor schedules it (``with_post_norm_schedule``; on CPU it runs first, its
    input freed there, a schedule of the CPU's realization thresholds): at the MLP's kernel
    the saved set less the product (the post norm's input S and statistic r still alive),
    beside the incoming gradient and 2 F: alive 135,168 - 22,528 = 112,640, transient
    8,192 + 45,056 = 53,248, and the MLP post norm's weight gradient not made yet.

    The attention's moments (``compiled_order.with_norm_reductions_last``) hold what the
    fused reduction of the three deferred norms reads: gate's and up's grad-input outputs
    2 S, the MLP post norm's input S and r, the pre-feedforward norm's r, the post-attention
    norm's input S and r, the fp32 residual gradient 2 S, the output projection's output
    gradient S and the post-attention norm's row dot product r: 7 S + 4 r = 58,368 over the
    eager order's 16,640 at the q/k/v grad-input matmuls, none of the three gradients made
    (nothing held by the attention norm's own kernel, after the reduction)."""
    wl = Workload.model_validate({**WL.model_dump()})
    validate(SANDWICH, ParallelConfig(), wl)
    dm = Dims.of(SANDWICH, ParallelConfig(), wl)
    terms = {t.name: t.size_bytes
             for t in layer_terms(SANDWICH, wl, dm, moe_layer=False, recompute=Recompute.NONE)
             if t.size_bytes}
    assert "mlp_norm.input" not in terms
    assert sum(terms.values()) == 135_168
    moments = {m.name: m for m in layer_kind(SANDWICH, wl, dm, False, Recompute.NONE).moments}
    act = moments["mlp_act"]
    assert (act.alive_bytes, act.transient_bytes) == (112_640, 53_248)
    assert "mlp_post_norm" not in act.grads_before
    assert moments["attn_in"].alive_bytes == 16_640 + 58_368
    assert not {"mlp_post_norm", "mlp_norm", "attn_post_norm"} & set(
        moments["attn_in"].grads_before)
    assert moments["attn_norm"].alive_bytes == 8_448
    assert "mlp_post_norm" in moments["attn_norm"].grads_before


def test_compiled_sandwich_layer_rebuilt_inside_the_graph() -> None:
    """Full recompute, the checkpoint inside the compiled graph (Gemma 2's layer rebuilt; by
    hand, S = 8,192, r = 256, F = 22,528, k and v 4,096 each, the logsumexp 1,024):

    - ``sandwich_rerun_norm_bytes``: the pre-feedforward norm's fp32 normalised input,
      T x h x 4 = 64 x 64 x 4 = 16,384; ``sandwich_sum_stats_bytes``: the post-attention
      norm's statistics, T x 4 = 256; both 0 eagerly, and for a post-norm (OLMo 2) layer;
    - forward at up's matmul: the input S, the output projection's output S (in the residual
      sum's place) and the statistics r, the pre-feedforward norm's output S, gate and up
      2 F: 3 S + r + 2 F = 69,888 B (before: 69,632, without r);
    - backward at GeGLU's fused kernel (the order of a layer not rebuilt: the down weight's
      gradient first, the product's buffer taking its gradient): the rerun's saved set less
      the product and the MLP post norm's input and statistics (freed at its own backward),
      6 S (input, input norm's output, RoPE'd q, SDPA's output, the output projection's
      output, the pre-feedforward norm's output) + 3 r + 8,192 + 1,024 + 2 F = 103,936 (nothing
      of it the rerun re-saves beyond), + SDPA output's token-major copy S
      (``rerun_output_copy_bytes``) + the fp32 normalised input 16,384 = 128,768 alive;
      beside them the incoming gradient S and the kernel's two new F (the product's gradient
      in the product's buffer, the gate's): 8,192 + 45,056 = 53,248."""
    from memplan.model.compiled import sandwich_rerun_norm_bytes, sandwich_sum_stats_bytes

    wl = Workload.model_validate({**WL.model_dump(), "recompute": "full"})
    validate(SANDWICH, ParallelConfig(), wl)  # no longer refused
    dm = Dims.of(SANDWICH, ParallelConfig(), wl)
    rerun = dm._replace(rerun=True)
    assert sandwich_rerun_norm_bytes(SANDWICH, rerun) == 16_384
    assert sandwich_rerun_norm_bytes(SANDWICH, dm) == 0  # the first forward's: nothing
    assert sandwich_sum_stats_bytes(SANDWICH, dm) == 256
    post = Dims.of(POST, ParallelConfig(), wl)
    assert sandwich_rerun_norm_bytes(POST, post._replace(rerun=True)) == 0
    assert sandwich_sum_stats_bytes(POST, post) == 0
    eager = Dims.of(SANDWICH, ParallelConfig(), wl.model_copy(update={"compile": False}))
    assert sandwich_sum_stats_bytes(SANDWICH, eager) == 0
    kind = layer_kind(SANDWICH, wl, dm, False, Recompute.FULL)
    assert kind.forward_peak_bytes == dict(kind.forward_blocks)["mlp"] == 69_888
    moments = {m.name: m for m in kind.moments}
    act = moments["mlp_act"]
    assert (act.alive_bytes, act.transient_bytes) == (128_768, 53_248)
    assert act.grads_before == ("mlp_post_norm", "mlp_out")
    # past the norm's weight gradient the fp32 tensor is gone: the norm's backward holds
    # neither it nor the MLP's tensors
    assert moments["mlp_norm"].alive_bytes < act.alive_bytes - 16_384 - 2 * 22_528
    # a sandwich layer with SwiGLU rebuilt: untraced, refused
    swiglu = ModelSpec.model_validate({**SANDWICH.model_dump(), "mlp": "swiglu"})
    with pytest.raises(LayoutError, match="sandwich norms, recompute full and an MLP other"):
        validate(swiglu, ParallelConfig(), wl)


def test_sdpa_grad_reuse_follows_inductors_estimate() -> None:
    """``compiled.with_sdpa_grad_reuse``: Inductor's wrapper holds the SDPA output's gradient
    (T x q x 2) for the q/k/v input gradient only where the RoPE backward's moment less dq
    (T x q x 2, freed early in its estimate) is no larger than every other moment. The tiny
    spec (T 64, q width 64: 8,192 B) with made-up moments, weight gradients of 2 bytes: the
    MLP's 3 x 64 x 176 x 2 = 67,584 B at the RoPE backward. RoPE 100,000 + 20,000 + 67,584 =
    187,584; less dq 179,392. Another moment of 179,392 B: held (the moments as given); of
    179,391: freed, 8,192 B less alive at both attention moments."""
    from memplan.model import compiled
    from memplan.model.layer import LayerMoment, grad_group_params

    groups = grad_group_params(TINY, 1, 1, False)
    assert 2 * groups["mlp"] == 67_584

    def moments(other: int) -> list[LayerMoment]:
        return [LayerMoment("mlp_act", other - 5_000, 5_000, ()),
                LayerMoment("attention_rope", 100_000, 20_000, ("mlp",)),
                LayerMoment("attention_qkv", 100_000, 10_000, ("mlp",))]

    assert compiled.with_sdpa_grad_reuse(moments(179_392), TINY, DM, groups) == moments(179_392)
    freed = compiled.with_sdpa_grad_reuse(moments(179_391), TINY, DM, groups)
    assert [m.alive_bytes for m in freed] == [174_391, 91_808, 91_808]


def _titan_toy(seq: int, fused: bool) -> ModelSpec:
    """torchtitan's Llama3 toy block of tests/traced/test_compile_trace.py (h 256, 8 heads of
    32, 2 k/v heads, f 768, fused wqkv or not), as ``frameworks.torchtitan_spec`` reads it."""
    from memplan.spec import spec_from_hf_dict

    data = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 1,
            "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 768,
            "vocab_size": 1000, "max_position_embeddings": seq, "hidden_act": "silu",
            "tie_word_embeddings": False}
    return spec_from_hf_dict(data, "torchtitan toy", "toy").model_copy(
        update={"fused_qkv": fused})


@pytest.mark.parametrize("seq,fused,first,lpmf", [(1024, False, 5_931_028, True),
                                                  (256, False, 1_900_564, False),
                                                  (64, False, 892_948, False),
                                                  (1024, True, None, False)])
def test_float8_lpmf_grad_in_first(seq: int, fused: bool, first: int | None,
                                   lpmf: bool) -> None:
    """Tensorwise Float8Linears, compiled, no recompute (``compiled.float8_lpmf_grad_in_
    first``): beyond the saved set and the product's gradient, lpmf's moment holds gate's and
    up's dim-0 casts 2 x T x 768, the casts of SDPA's output and the incoming gradient
    T x (256 + 256), the transposed float8 weights of q, k, v, o, gate, up 256 x (256 + 64 +
    64 + 256 + 768 + 768) = 557,056, up's input gradient T x 256 x 2, the RoPE table's
    conjugate seq x 16 x 8 and the scalars: seven fp32 scales and five bf16 amaxes written,
    seven bf16 weight amaxes and a 4 B inverse scale freed: 28 + 10 - 14 - 4 = 20. Inductor's
    estimate adds two tables; the baseline's: the four T x 768 casts, down's weight gradient
    256 x 768 x 2 = 393,216 and its scalars, 4 - 2 - 4 = -2.
    2 x 1,024 (T 2,048): 3,145,728 + 1,048,576 + 557,056 + 1,048,576 + 131,072 + 20 =
    5,931,028; + 262,144 = 6,193,172 against 6,291,456 - 2 + 393,216 = 6,684,670: lpmf,
    491,498 B below (Inductor's log: 491,498). 2 x 256 (T 512): 786,432 + 262,144 + 557,056 +
    262,144 + 32,768 + 20 = 1,900,564; + 65,536 = 1,966,100 against 1,572,862 + 393,216 =
    1,966,078: the baseline, 22 B below (Inductor's log: 22). 2 x 64 (T 128): 196,608 +
    65,536 + 557,056 + 65,536 + 8,192 + 20 = 892,948; + 16,384 against 786,430: the
    baseline. Fused wqkv: None (lpmf's estimate peaks elsewhere there)."""
    from memplan.model import compiled
    from memplan.model.mlp import mlp_linears

    spec = _titan_toy(seq, fused)
    wl = Workload(micro_batch_size=2, seq_len=seq, precision="bf16-pure", compile=True,
                  rope_cache="layer", float8="tensorwise")
    dm = Dims.of(spec, ParallelConfig(), wl)
    linears = mlp_linears(spec, spec.ffn_hidden_size)
    assert compiled.float8_lpmf_grad_in_first(spec, wl, dm, linears) == first
    kernel, = compiled.float8_swiglu_casts(spec, wl, dm, linears, 0)
    product = 2 * seq * 768 * 2
    assert kernel.transient_bytes == product + (first if lpmf else 4 * (2 * seq * 768 + 4))
    assert kernel.grads == (() if lpmf else ("mlp_out",))


def test_float8_lpmf_grad_in_first_leaves_full_ac_out() -> None:
    """Rebuilt under full AC Inductor keeps its baseline order for torchtitan's block with
    separate q/k/v (traced: tests/traced/test_compile_trace.py
    ``test_compiled_float8_separate_qkv_rebuilt``): no lpmf moment; per-op SAC keeps it (the
    2 x 1,024 value of ``test_float8_lpmf_grad_in_first``, 5,931,028 B)."""
    from memplan.model import compiled
    from memplan.model.mlp import mlp_linears

    spec = _titan_toy(1024, False)
    linears = mlp_linears(spec, spec.ffn_hidden_size)
    found = {}
    for recompute in (Recompute.FULL, Recompute.SELECTIVE):
        wl = Workload(micro_batch_size=2, seq_len=1024, precision="bf16-pure", compile=True,
                      rope_cache="layer", float8="tensorwise", recompute=recompute,
                      selective_impl="op")
        dm = Dims.of(spec, ParallelConfig(), wl)
        found[recompute] = compiled.float8_lpmf_grad_in_first(spec, wl, dm, linears)
    assert found == {Recompute.FULL: None, Recompute.SELECTIVE: 5_931_028}


@pytest.mark.parametrize(("model", "update"), [
    ("qwen2.5-7b", {}), ("qwen3-8b", {}), ("gemma-7b", {}), ("mistral-7b", {"seq_len": 2048}),
    ("granite-3.3-8b", {}), ("granite-3.3-8b", {"recompute": "full"}),
    ("gemma-2-9b", {"seq_len": 2048}), ("gemma-3-12b", {"seq_len": 512, "recompute": "full"}),
    ("qwen3-8b", {"recompute": "full"}), ("phi-3-mini-4k", {"seq_len": 1024}),
    ("phi-3-mini-4k", {"seq_len": 1024, "recompute": "full"}),
    ("phi-4-mini", {"seq_len": 1024, "recompute": "full"})])
def test_compile_under_autocast_accepts_the_traced_families(model: str, update: dict) -> None:
    """The families traced under autocast (tests/traced/test_compile_trace.py
    ``test_compiled_autocast_hf_layers``: q/k/v biases, Qwen3's q/k norms, GeGLU, Granite's
    scaled residual, Gemma 2's and 3's sandwich norms, a sliding
    window longer than the sequence, Phi-3's fused projections) pass the
    compile rule, where the rest stays refused (``test_compile_refuses_what_is_not_modelled``)."""
    wl = Workload.model_validate({**WL.model_dump(), "precision": "amp-bf16", **update})
    validate(load_model(model), ParallelConfig(), wl)


def test_compiled_norm_reductions_held_through_attention() -> None:
    """The tiny Llama-like layer compiled without recompute (S = 64 tokens x 64 x 2 B =
    8,192, r = 64 x 4 = 256): at the q/k/v grad-input matmuls (``attn_in``) the eager order
    holds the layer's input S, the attention norm's output S (its weight gradients' operand)
    and statistics r; Inductor's fused reduction of the MLP norm's weight gradient, after
    the attention's backward (``compiled_order.with_norm_reductions_last``), adds gate's and
    up's grad-input outputs 2 S, the MLP norm's saved input S and statistics r, and the
    residual gradient S beside the incoming gradient the caller holds: 6 S + 2 r = 49,664,
    the MLP norm's weight gradient not made. After that kernel (the attention norm's own)
    nothing is held: the input S and statistics r."""
    dm = Dims.of(TINY, ParallelConfig(), WL)
    moments = {m.name: m for m in layer_kind(TINY, WL, dm, False, Recompute.NONE).moments}
    assert moments["attn_in"].alive_bytes == 6 * 8_192 + 2 * 256
    assert "mlp_norm" not in moments["attn_in"].grads_before
    assert moments["attn_norm"].alive_bytes == 8_192 + 256
    assert "mlp_norm" in moments["attn_norm"].grads_before
