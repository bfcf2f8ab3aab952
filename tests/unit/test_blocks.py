"""Each block of a layer, and the layer composed of them, on the tiny spec, by hand.

tiny: h = 64, f = 176 (SwiGLU), a = 4 query heads, g = 2 KV heads, d = 16 (q width 64, KV width
32), RMSNorm, RoPE, no biases, no dropout. Workload: mbs 2, seq 32, bf16 (e = 2), tp 1, so
T = 64 tokens and a residual-stream tensor is T*h*e = 8,192 B.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from memplan.model.attention import Attention
from memplan.model.block import Block
from memplan.model.dims import Dims, total, whole_bytes
from memplan.model.embedding import EmbeddingBlock
from memplan.model.head import HeadBlock
from memplan.model.layer import (
    ALL_BLOCKS,
    backward_moments,
    forward_moments,
    grad_group_params,
    layer_blocks,
    layer_kind,
    layer_tensor_sizes,
    layer_terms,
)
from memplan.model.mlp import Mlp
from memplan.model.moe import MoE
from memplan.model.norm import Norm
from memplan.parallel import ParallelConfig
from memplan.spec import ModelSpec, layer_params, load_model
from memplan.workload import NormImpl, Recompute, Workload

TINY = load_model("tiny")
WL = Workload(micro_batch_size=2, seq_len=32)
DM = Dims.of(TINY, ParallelConfig(), WL)
STREAM = 64 * 64 * 2  # T*h*e


def _moments(ms: list) -> list[tuple]:
    return [(m.name, m.own_bytes, m.transient_bytes) for m in ms]


def test_dims_are_derived_once() -> None:
    """T = 2*32 = 64 tokens; with SP at tp 2 the residual rows halve; the vocabulary shard is
    ceil(128 / 2) = 64 rows."""
    assert (DM.tokens, DM.rows, DM.e, DM.vocab_shard) == (64, 64, 2, 128)
    dm = Dims.of(TINY, ParallelConfig(tp=2, sequence_parallel=True, cp=2), WL)
    assert (dm.s, dm.tokens, dm.rows, dm.vocab_shard) == (16, 32, 16, 64)


def test_upcast_norm() -> None:
    """fp32 input copy T*h*4 = 16,384, output 8,192, rstd T*4 = 256, normed 8,192; at its
    backward the fp32 input and rstd (16,640) remain and five fp32 hidden-sized tensors
    (81,920) are in flight; forward: its fp32 normalised tensor (16,384) beside what it saved;
    checkpointed: two fp32 copies, two compute-dtype tensors and rstd (49,408)."""
    norm = Norm("attn_norm")
    saved = {t.name: t.size_bytes for t in norm.saved(TINY, WL, DM, Recompute.NONE)}
    assert saved == {"attn_norm.input_fp32": 16_384, "attn_norm.output": 8_192,
                     "attn_norm.stats": 256, "attn_norm.normed": 8_192}
    assert _moments(norm.forward_moments(TINY, WL, DM, Recompute.NONE)) == [
        ("attn_norm", 33_024, 16_384)]
    assert _moments(norm.working_set(TINY, WL, DM)) == [("attn_norm", 0, 49_408)]
    assert _moments(norm.backward_moments(TINY, WL, DM, Recompute.NONE)) == [
        ("attn_norm", 16_640, 81_920)]
    assert norm.grad_groups(TINY, 1, 1) == {"attn_norm": 64}


def test_fused_norm() -> None:
    """Input 8,192, output 8,192, rstd 256; at its backward the output was freed by the next
    linear's (input and rstd, 8,448, remain) and the reference fused RMSNorm holds three
    compute-dtype hidden-sized tensors (24,576)."""
    wl = WL.model_copy(update={"norm_impl": NormImpl.FUSED})
    norm = Norm("mlp_norm")
    assert total(norm.saved(TINY, wl, DM, Recompute.NONE)) == 16_640
    assert _moments(norm.forward_moments(TINY, wl, DM, Recompute.NONE)) == [
        ("mlp_norm", 16_640, 0)]
    assert _moments(norm.backward_moments(TINY, wl, DM, Recompute.NONE)) == [
        ("mlp_norm", 8_448, 24_576)]


def test_flash_attention() -> None:
    """q 8,192, k and v 4,096 each (GQA), output 8,192, logsumexp b*a*s*4 = 1,024. Backward:
    output and q, k, v gradients T*(2*64 + 2*32)*2 = 24,576; the input projections: two input
    gradients and q's output gradient (24,576) with q's weight (64*64) just made."""
    att = Attention()
    saved = {t.name: t.size_bytes for t in att.saved(TINY, WL, DM, Recompute.NONE)}
    assert saved == {"attn.q": 8_192, "attn.k": 4_096, "attn.v": 4_096, "attn.out": 8_192,
                     "attn.lse": 1_024}
    assert _moments(att.forward_moments(TINY, WL, DM, Recompute.NONE)) == [
        ("attention", 25_600, STREAM), ("attention_core", 17_408, 0)]
    back = att.backward_moments(TINY, WL, DM, Recompute.NONE)
    assert [(m.name, m.own_bytes, m.transient_bytes, m.grads, m.fresh_params) for m in back] == [
        ("attention.0", 25_600, 24_576, ("attn_out",), 0),
        ("attn_in", 0, 24_576, ("attn",), 4_096)]
    # selective: no logsumexp saved; rerun in backward, the core's output and logsumexp again
    assert total(att.saved(TINY, WL, DM, Recompute.SELECTIVE)) == 24_576
    assert att.backward_moments(TINY, WL, DM, Recompute.SELECTIVE)[0].own_bytes == 33_792
    assert att.grad_groups(TINY, 1, 1) == {"attn_out": 4_096, "attn": 12_288}
    assert att.tensor_sizes(TINY, 1, 1) == [4_096, 2_048, 2_048, 4_096]


def test_attention_in_a_checkpointed_layer() -> None:
    """Flash: its output, q, k, v, the core's output and logsumexp (33,792); RoPE's rotated
    copies at q's: four q-sized tensors and k, v (40,960)."""
    assert _moments(Attention().working_set(TINY, WL, DM)) == [
        ("attention", 0, 33_792), ("rope", 0, 40_960)]


def test_swiglu_mlp() -> None:
    """gate, act, up, prod: T*f*e = 22,528 each; its output beside the residual add's (2 x
    8,192). Backward: the down projection's gradient
    (22,528) with its weight (64*176) fresh, two intermediate gradients at the activation;
    the up projection's backward (run first: made last in forward) beside the gate's saved
    output (22,528) and the activation's waiting gradient: its output gradient (22,528, freed
    before its hook), its input gradient (8,192) and its weight's fresh; then the gate's,
    the last input projection: two input gradients and one output gradient (38,912)."""
    mlp = Mlp()
    assert total(mlp.saved(TINY, WL, DM, Recompute.NONE)) == 4 * 22_528
    assert _moments(mlp.forward_moments(TINY, WL, DM, Recompute.NONE)) == [
        ("mlp", 90_112, 2 * STREAM)]
    assert _moments(mlp.working_set(TINY, WL, DM)) == [("mlp", 0, 3 * 22_528)]
    back = mlp.backward_moments(TINY, WL, DM, Recompute.NONE)
    assert [(m.name, m.own_bytes, m.transient_bytes, m.grads, m.fresh_params) for m in back] == [
        ("mlp", 90_112, 22_528, ("mlp_out",), 11_264),
        ("mlp_act", 90_112, 45_056, ("mlp_out",), 0),
        ("mlp_up", 22_528, 8_192 + 2 * 22_528, ("mlp_out",), 11_264),
        ("mlp_in", 0, 38_912, ("mlp",), 11_264)]
    assert back[2].hook_freed == 22_528
    # litgpt's order (the activation after both projections): the activation's backward ran
    # first, its saved input freed, the gate output's gradient in its incoming one's place
    litgpt = Workload(micro_batch_size=2, seq_len=32, mlp_impl="litgpt")
    lit = mlp.backward_moments(TINY, litgpt, DM, Recompute.NONE)
    assert (lit[2].name, lit[2].own_bytes, lit[2].transient_bytes) == (
        "mlp_up", 0, 8_192 + 2 * 22_528)
    assert mlp.grad_groups(TINY, 1, 1) == {"mlp_out": 11_264, "mlp": 33_792}


def test_swiglu_checkpointed_forward_by_module() -> None:
    """Under a checkpoint (nothing saved) transformers' LlamaMLP holds, module by module: the
    gate's output (22,528); it and the activation's (2 x); the activation's and up's (2 x);
    both and their product (3 x 22,528 = 67,584, the working set's); the product and the
    output (22,528 + 8,192). litgpt's order (both projections, then the activation) is not
    given by module."""
    from memplan.model.mlp import working_steps

    assert working_steps(TINY, WL, DM) == (
        ("gate", 22_528), ("act", 45_056), ("up", 45_056), ("prod", 67_584),
        ("down", 22_528 + STREAM))
    assert max(t for _, t in working_steps(TINY, WL, DM)) == Mlp().working_set(
        TINY, WL, DM)[0].transient_bytes
    assert working_steps(TINY, Workload(micro_batch_size=2, seq_len=32, mlp_impl="litgpt"),
                         DM) == ()


def test_layer_forward_is_a_running_sum() -> None:
    """Each moment: the saved bytes of the blocks before it (0, 33,024, 58,624, 91,648) plus
    its own, beside the unsaved residual input (8,192; an upcast norm saves an fp32 copy);
    in the MLP's sub-layer the post-attention residual (8,192) too, as the layer's input
    stays alive until the layer returns (its caller's loop variable: traced,
    tests/traced/test_hf_moe_families.py); at the MLP's residual add its output and the
    add's (2 x 8,192) beside them: 16,384 + 16,384 = 32,768."""
    moments = forward_moments(TINY, WL, DM, moe_layer=False, recompute=Recompute.NONE)
    assert [(m.name, m.alive_bytes, m.transient_bytes) for m in moments] == [
        ("attn_norm", 33_024, 24_576), ("attention", 58_624, 16_384),
        ("attention_core", 50_432, 8_192), ("mlp_norm", 91_648, 32_768),
        ("mlp", 181_760, 32_768)]
    kind = layer_kind(TINY, WL, DM, False, Recompute.NONE)
    assert kind.saved_bytes == 181_760 and kind.forward_peak_bytes == 214_528


def test_layer_backward_is_a_running_sum() -> None:
    """Backward, last block first: the blocks before each one still saved, the incoming
    gradient (8,192) beside, and the groups of the blocks after it with gradients; at the
    up projection's backward the gate's saved output (22,528) beside the blocks before."""
    moments = backward_moments(TINY, WL, DM, moe_layer=False, recompute=Recompute.NONE)
    assert [(m.name, m.alive_bytes, m.transient_bytes, m.grads_before) for m in moments] == [
        ("mlp", 181_760, 30_720, ("mlp_out",)),
        ("mlp_act", 181_760, 53_248, ("mlp_out",)),
        ("mlp_up", 91_648 + 22_528, 8_192 + 53_248, ("mlp_out",)),
        ("mlp_in", 91_648, 47_104, ("mlp",)),
        ("mlp_norm", 75_264, 90_112, ("mlp",)),
        ("attention.0", 58_624, 32_768, ("mlp", "mlp_norm", "attn_out")),
        ("attn_in", 33_024, 32_768, ("mlp", "mlp_norm", "attn")),
        ("attn_norm", 16_640, 90_112, ("mlp", "mlp_norm", "attn"))]


def test_checkpointed_layer() -> None:
    """Full recompute saves the input (8,192). Its forward holds the input, then the
    post-attention residual, and each mixer's norm output: norm 8,192 + 49,408; attention
    2*8,192 + 33,792; RoPE 2*8,192 + 40,960; second norm 2*8,192 + 49,408; MLP 3*8,192 +
    67,584 = 92,160, the peak. Its backward first rebuilds the layer: all 181,760 B it saves
    and the checkpointed input (an upcast norm does not save it) beside the incoming gradient,
    the MLP's output and the post-attention residual."""
    assert [(t.name, t.size_bytes) for t in layer_terms(
        TINY, WL, DM, moe_layer=False, recompute=Recompute.FULL)] == [("layer.input", 8_192)]
    kind = layer_kind(TINY, WL, DM, False, Recompute.FULL)
    assert kind.forward_peak_bytes == 92_160
    rebuild = kind.moments[0]
    assert (rebuild.name, rebuild.alive_bytes, rebuild.transient_bytes) == (
        "rebuild_out", 8_192 + 181_760, 3 * 8_192)
    # the rebuilt blocks' moments sit on top of the checkpointed input
    assert kind.moments[1].alive_bytes == 8_192 + 181_760


@pytest.mark.parametrize("model", ["tiny", "gpt2", "llama-3-8b", "mixtral-8x7b", "qwen2.5-7b"])
@pytest.mark.parametrize("t", [1, 2])
def test_block_parameters_add_up_to_the_layer(model: str, t: int) -> None:
    """The blocks' tensors on a TP rank add up to the layer's parameters split as the spec
    counts them (sharded by t, replicated whole; experts by ep), and so do the blocks' whole
    gradient groups."""
    spec = load_model(model)
    index = next((i for i in range(spec.num_layers) if spec.is_moe_layer(i)), 0)
    counts = layer_params(spec, index)
    sizes = layer_tensor_sizes(spec, t, 1, spec.is_moe_layer(index))
    assert sum(sizes) == counts.tp_sharded // t + counts.replicated + counts.expert // t
    groups = grad_group_params(spec, t, 1, spec.is_moe_layer(index))
    assert groups["attn_norm"] + groups["attn"] + groups["mlp_norm"] + groups["mlp"] == sum(sizes)


@pytest.mark.parametrize("model", ["tiny", "gpt2", "llama-3-8b", "mixtral-8x7b"])
def test_block_flops_count_two_per_parameter(model: str) -> None:
    """2 FLOPs per parameter a token passes, counted by ``layer_params`` (all but the routed
    experts, of which the top-k), and causal attention's 2*s*q per layer: the blocks' FLOPs
    per token (``memplan.model.flops``, which the step-time model reads)."""
    from memplan.model.flops import layer_flops

    spec = load_model(model)
    seq = 2048
    for i, layer in enumerate(layer_flops(spec, seq)):
        counts = layer_params(spec, i)
        weights = counts.tp_sharded + counts.replicated
        if spec.moe is not None and spec.is_moe_layer(i):
            weights += counts.expert * spec.moe.top_k // spec.moe.num_experts
        assert layer == (2 * weights, 2 * seq * spec.q_size)


def test_every_block_has_the_interface() -> None:
    """Norms, stream inputs, attention (full, windowed, and NoPE beside an L2 q/k norm), MLA,
    gated DeltaNet, LFM2's short convolution and Mamba2 with the norms before them, Falcon-H1's
    mixer and attention side by side with its norm, MLP and MoE (its pre norm a block of its
    own: ``norm.moe_output_unread``), the head and the embedding all expose the same methods
    (``memplan.model.block``), and each answers them."""
    methods = [name for name in Block.__dict__ if not name.startswith("_") and name != "name"]
    assert len(ALL_BLOCKS) == 20
    for block in (*ALL_BLOCKS, HeadBlock(), EmbeddingBlock()):
        assert all(callable(getattr(block, name)) for name in methods), block
        assert isinstance(block.name, str)
    for block in (HeadBlock(), EmbeddingBlock()):
        assert total(block.saved(TINY, WL, DM, Recompute.NONE)) > 0
        assert block.forward_moments(TINY, WL, DM, Recompute.NONE)
        assert block.backward_moments(TINY, WL, DM, Recompute.NONE)
        assert block.working_set(TINY, WL, DM) == block.rebuild_moments(TINY, WL, DM) == []
        assert isinstance(block.flops_per_token(TINY, 32), float)


def test_head_block() -> None:
    """The final norm as ``test_upcast_norm``'s (33,024 B: fp32 input 16,384, output 8,192,
    rstd 256, normed 8,192), the log-softmax T*V*4 = 64*128*4 = 32,768 (fp32 logits, the
    workload's default), the targets T*8 = 512 and the loss's two fp32 scalars 8. Parameters
    on a TP rank: the final norm's weight h = 64, then the head's vocabulary shard ceil(128 /
    t) rows of h: 8,192 at t 1, 43*64 = 2,752 at t 3; its gradient first (64*64 = 4,096 at t
    2), then the final norm's (+64). Tied: only the final norm. FLOPs per token: 2*h*V =
    16,384 (the step-time model's head term) and the final norm's 2*h = 128."""
    head = HeadBlock()
    saved = {t.name: t.size_bytes for t in head.saved(TINY, WL, DM, Recompute.NONE)}
    assert saved == {"final_norm.input_fp32": 16_384, "final_norm.output": 8_192,
                     "final_norm.stats": 256, "final_norm.normed": 8_192,
                     "loss.log_softmax": 32_768, "loss.targets": 512, "loss.scalars": 8}
    assert [m[:2] for m in head.forward_moments(TINY, WL, DM, Recompute.NONE)] == [
        ("final_norm", 33_024), ("loss", 66_312)]
    back = head.backward_moments(TINY, WL, DM, Recompute.NONE)
    assert [(m.name, m.own_bytes, m.grads, m.fresh_params) for m in back] == [
        ("loss", 66_312, (), 0), ("head", 33_024, ("head",), 8_192),
        ("final_norm", 16_640, ("head", "final_norm"), 0)]
    assert head.tensor_sizes(TINY, 1, 1) == [64, 8_192]
    assert head.tensor_sizes(TINY, 3, 1) == [64, 2_752]
    assert head.grad_groups(TINY, 2, 1) == {"head": 4_096, "final_norm": 4_160}
    tied = ModelSpec.model_validate({**TINY.model_dump(), "tied_embeddings": True})
    assert head.tensor_sizes(tied, 1, 1) == [64]
    assert head.grad_groups(tied, 1, 1) == {"head": 0, "final_norm": 64}
    assert head.flops_per_token(TINY, 32) == 16_384 + 128


def test_embedding_block() -> None:
    """RoPE: the token ids T*8 = 512 saved; the token rows ceil(128 / t) * h: 8,192 at t 1,
    43*64 = 2,752 at t 3. Its backward: the ids still saved, the incoming gradient of its
    output T*h*2 = 8,192 in flight, the token rows' gradient (8,192 elements) just made.
    Learned positions: their ids s*8 = 256 saved too, their table max_seq_len*h = 256*64 =
    16,384 after the token rows, its gradient first (then 16,384 + 64*64 = 20,480 at t 2).
    No FLOPs: a lookup."""
    emb = EmbeddingBlock()
    assert {t.name: t.size_bytes for t in emb.saved(TINY, WL, DM, Recompute.NONE)} == {
        "embedding.ids": 512}
    assert _moments(emb.forward_moments(TINY, WL, DM, Recompute.NONE)) == [("embedding", 512, 0)]
    back = emb.backward_moments(TINY, WL, DM, Recompute.NONE)
    assert [(m.name, m.own_bytes, m.transient_bytes, m.grads, m.fresh_params) for m in back] == [
        ("embedding", 512, 8_192, ("embedding",), 8_192)]
    assert emb.tensor_sizes(TINY, 1, 1) == [8_192]
    assert emb.tensor_sizes(TINY, 3, 1) == [2_752]
    assert emb.grad_groups(TINY, 1, 1) == {"embedding": 8_192}
    learned = ModelSpec.model_validate({**TINY.model_dump(), "position": "learned"})
    dm = Dims.of(learned, ParallelConfig(), WL)
    assert total(emb.saved(learned, WL, dm, Recompute.NONE)) == 512 + 256
    assert emb.tensor_sizes(learned, 1, 1) == [8_192, 16_384]
    assert emb.grad_groups(learned, 2, 1) == {"position_embedding": 16_384, "embedding": 20_480}
    assert emb.flops_per_token(TINY, 32) == 0.0


def test_head_and_embedding_on_a_stage() -> None:
    """The head a stage walks, read from its block interface (``test_head_block``'s bytes):
    saved but the targets 66,312 - 512 = 65,800 in forward; saved but the batch (targets and
    scalars) 66,312 - 520 = 65,792; the final norm's 33,024 at the head's backward, 16,640 at
    its own; no held logits (``LogitsHeld.NONE``). On a stage with 100 B of head gradients,
    a 16,384 B compute-dtype head weight gradient and fp32 main gradients, the fp32 copy's
    moment holds 33,024 + 16,384 + 100 = 49,508 beyond the saved.

    The embedding on a first stage: 8,192 token rows at 4 held bytes each = 32,768 of
    gradients; its 16,384 B compute-dtype gradient (no autocast) lives until added into the
    fp32 one: 16,384 beyond the gradients (the dense moment, 16,384 + 8,192 incoming - 32,768
    < 0, is below it); freed before its backward the 1,000 B of rope tables and its saved
    terms but the ids (none here). At 3/2 bytes per parameter 8,191 parameters hold 12,286 B
    (12,286.5, rounded down, without a float)."""
    head = HeadBlock.of(TINY, WL, DM)
    assert (head.forward_saved, head.saved_bytes, head.final_norm_all, head.final_norm_saved,
            head.held_logits) == (65_800, 65_792, 33_024, 16_640, 0)
    back = HeadBlock().backward_moments(TINY, WL, DM, Recompute.NONE)
    assert (head.loss, head.linear, head.final_norm_bwd) == tuple(
        m.transient_bytes for m in back)
    on = head.on_stage(100, 16_384, True, 7)
    assert (on.grads, on.main_grads, on.tied_grad) == (100, 49_508, 7)
    emb = EmbeddingBlock().on_stage(TINY, WL, DM, num_params=8_192, per_param=Fraction(4),
                                    vocab_grad=16_384, main_grads=True, tied=False,
                                    rope_bytes=1_000)
    assert emb == EmbeddingBlock(grads=32_768, extra=16_384, freed_before=1_000)
    assert whole_bytes(8_191, Fraction(3, 2)) == 12_286
    assert whole_bytes(-3, Fraction(1, 2)) == -1


@pytest.mark.parametrize("t", [1, 3])
def test_head_and_embedding_tensors_match_the_stage(t: int) -> None:
    """The head's and the embedding's tensor sizes are the first and last of a one-stage
    model's (``count_stage_params``, untied tiny: 8,192 / 2,752 token rows, the final norm's
    64 and the head's shard)."""
    from memplan.model.model_states import count_stage_params

    stage = count_stage_params(TINY, t, 1, 1, (0, 1), True, True, t)
    sizes = list(stage.tensor_sizes)
    assert sizes[:stage.embedding_tensors] == EmbeddingBlock().tensor_sizes(TINY, t, 1)
    assert sizes[len(sizes) - stage.head_tensors:] == HeadBlock().tensor_sizes(TINY, t, 1)


def test_moe_block_terms() -> None:
    """A hand-made MoE: 4 experts, top-2, T = 64: router probabilities T*4*4 = 1,024; indices
    T*2*8 = 1,024; renormalised weights T*2*4 + T*4 = 768; gathered-row index 1,024; gathered
    rows, expert outputs and weighted outputs T*2*h*e = 16,384 each; routing weights T*2*e =
    256; expert SwiGLU over T*2 rows at f = 32: 4 * 128*32*2 = 32,768."""
    spec = ModelSpec.model_validate({
        **TINY.model_dump(), "name": "tiny-moe",
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 32}})
    dm = Dims.of(spec, ParallelConfig(), WL)
    saved = total(MoE().saved(spec, WL, dm, Recompute.NONE))
    assert saved == 1_024 + 1_024 + 768 + 1_024 + 3 * 16_384 + 256 + 32_768


def test_gelu_new_backward_holds_fp32_gradients_under_autocast() -> None:
    """gelu_new's backward at its last product holds the output's gradient and both factors'
    beyond its saved tensors, the down projection's saved input (counted among the saved)
    standing for one: in bf16 2 + 2 + 2 - 2 = 4 B per element; under autocast the product
    is fp32, so are the three gradients, and 0.5 * x's is cast down to bf16:
    4 + 4 + 4 + 2 - 2 = 12 B (traced, tests/traced/test_frameworks.py gpt2-toy amp-bf16)."""
    from memplan.model.dims import Dims
    from memplan.model.mlp import gelu_new_grad_bytes

    bf16 = Dims(b=1, s=1, s_kv=1, tokens=1, res_tokens_div=1, tp=1, e=2, vocab_shard=1,
                stream_e=2)
    assert gelu_new_grad_bytes(bf16) == 4
    assert gelu_new_grad_bytes(bf16._replace(stream_e=4, autocast=True)) == 12


def test_xielu_saved_and_backward_bytes() -> None:
    """transformers' xIELU formula (activations.py _xielu_python) per intermediate element.
    Saved: x, alpha_p * x, expm1's output, the difference, the where's bool condition and the
    down projection's input: bf16 2 + 2 + 2 + 2 + 1 + 2 = 11 B; under autocast alpha_p * x,
    expm1 (an fp32 op of CUDA's autocast) and the difference are fp32, the down projection's
    input a bf16 cast: 2 + 4 + 4 + 4 + 1 + 2 = 17 B. Forward peak beyond the saved: the
    positive branch's sum, the product with alpha_n, beta * x and their sum: bf16 4 x 2 = 8 B,
    autocast 4 + 4 + 2 + 4 = 14 B. Backward peak beyond the saved (the product with
    alpha_n's): the where's two gradients, x's so far, the difference's and the product
    summed for alpha_n, less the down projection's input and the condition: bf16
    5 x 2 - 2 - 1 = 7 B; autocast 4 + 4 + 2 + 4 + 4 - 2 - 1 = 15 B."""
    from memplan.model.mlp import xielu_forward_bytes, xielu_grad_bytes, xielu_saved

    bf16 = Dims(b=1, s=1, s_kv=1, tokens=1, res_tokens_div=1, tp=1, e=2, vocab_shard=1,
                stream_e=2)
    amp = bf16._replace(stream_e=4, autocast=True)
    assert sum(xielu_saved(bf16).values()) == 11 and sum(xielu_saved(amp).values()) == 17
    assert (xielu_forward_bytes(bf16), xielu_forward_bytes(amp)) == (8, 14)
    assert (xielu_grad_bytes(bf16), xielu_grad_bytes(amp)) == (7, 15)


def test_xielu_parameters_are_the_mlps() -> None:
    """alpha_p and alpha_n, one element each, after the MLP's projections; in its last
    gradient group."""
    from memplan.model.mlp import Mlp

    spec = ModelSpec.model_validate({**TINY.model_dump(), "name": "tiny-xielu", "mlp": "gelu",
                                     "activation_impl": "xielu"})
    sizes = Mlp().tensor_sizes(spec, 1, 1)
    assert sizes[-2:] == [1, 1] and sum(sizes) == 2 * 64 * 176 + 2
    assert Mlp().grad_groups(spec, 1, 1)["mlp"] == 2 * 64 * 176 + 2
