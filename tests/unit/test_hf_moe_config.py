"""Reading the MoE / hybrid families' ``config.json`` (memplan.hf.families_moe): the keys each
family's configuration class defaults, and the families refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.errors import MemplanError
from memplan.spec import spec_from_hf_dict
from memplan.workload import Recompute

# hidden 16, 2 query heads and 1 key/value head of 8, ffn 32, one layer, vocabulary 10
GLM4_TINY = {"model_type": "glm4", "hidden_size": 16, "intermediate_size": 32,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 8, "vocab_size": 10}


def _error(data: dict) -> str:
    with pytest.raises(MemplanError) as err:
        spec_from_hf_dict(data, "cfg.json", "m")
    message = str(err.value)
    assert "\n" not in message and "cfg.json" in message
    return message


def test_glm4_counts_by_hand() -> None:
    """Glm4Config's defaults: attention_bias true (q, k, v; o_proj has none), untied.
    q 16*16 + 16, k and v 16*8 + 8 each, o 16*16: 800; gate_up 16*64 and down 32*16: 1,536;
    four norms of 16: 64; the layer 2,400; embedding and head 10*16 each, final norm 16:
    2,736 (transformers' meta build counts the same: tests/traced/test_hf_moe_families.py)."""
    spec = spec_from_hf_dict(GLM4_TINY, "cfg.json", "m")
    assert spec.num_params == 2_736
    assert spec.rotary_dim == 4 and spec.rope_dim == 4  # 0.5 of head_dim 8


def test_partial_rotary_factor_from_rope_parameters() -> None:
    """transformers 5 writes the factor into rope_parameters (PretrainedConfig.to_dict)."""
    data = GLM4_TINY | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                            "partial_rotary_factor": 0.25}}
    assert spec_from_hf_dict(data, "cfg.json", "m").rope_dim == 2


def test_bad_partial_rotary_factor_is_named() -> None:
    message = _error(GLM4_TINY | {"partial_rotary_factor": 1.5})
    assert "partial_rotary_factor" in message and "1.5" in message


def test_glm4_moe_groups_must_divide_experts() -> None:
    data = {"model_type": "glm4_moe", "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 10, "n_routed_experts": 6, "n_group": 4}
    message = _error(data)
    assert "n_group" in message and "6" in message


# Llama 4 text at hidden 16: 2 query heads and 1 key/value head of 8, experts of 8, dense
# MLPs of 32, two layers, vocabulary 10
LLAMA4_TINY = {"model_type": "llama4_text", "hidden_size": 16, "intermediate_size": 8,
               "intermediate_size_mlp": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 10,
               "num_local_experts": 4, "interleave_moe_layer_step": 2,
               "no_rope_layer_interval": 2, "attention_chunk_size": 32}


def test_llama4_counts_by_hand() -> None:
    """Llama4TextConfig: no biases, untied, moe_layers [1] (interleave_moe_layer_step 2),
    no_rope_layers [1, 0]. Attention: q and o 16*16 each, k and v 16*8 each: 768; the L2 q/k
    norm of layer 0 has no weights. Layer 0: dense gate, up, down 3*16*32 = 1,536. Layer 1:
    router 16*4 = 64, 4 experts of gate_up 16*16 and down 8*16: 4*384 = 1,536, the shared
    expert 3*16*8 = 384. Two norms of 16 per layer. Layers: (768 + 1,536 + 32) + (768 + 64 +
    1,536 + 384 + 32) = 2,336 + 2,784 = 5,120; embedding and head 10*16 each, final norm 16:
    5,456."""
    spec = spec_from_hf_dict(LLAMA4_TINY, "cfg.json", "m")
    assert spec.num_params == 5_456
    assert spec.is_moe_layer(1) and not spec.is_moe_layer(0)
    assert spec.qk_norm.value == "l2" and spec.is_nope_layer(1) and not spec.is_nope_layer(0)
    assert spec.is_sliding_layer(0) and not spec.is_sliding_layer(1)
    assert spec.sliding_window == 32 and spec.window_chunked and spec.moe.every_expert


def test_llama4_published_lists_read_as_the_class_builds_them() -> None:
    """moe_layers and no_rope_layers as a file lists them (the class's own rule) read alike;
    no_rope_layers [] is the class's every no_rope_layer_interval-th."""
    base = spec_from_hf_dict(LLAMA4_TINY, "cfg.json", "m")
    listed = LLAMA4_TINY | {"moe_layers": [1], "no_rope_layers": [1, 0],
                            "layer_types": ["chunked_attention", "full_attention"]}
    assert spec_from_hf_dict(listed, "cfg.json", "m") == base
    assert spec_from_hf_dict(LLAMA4_TINY | {"no_rope_layers": []}, "cfg.json", "m") == base


@pytest.mark.parametrize(("key", "value"), [("moe_layers", [0]), ("no_rope_layers", [0, 1]),
                                            ("layer_types", ["full_attention"] * 2)])
def test_llama4_other_layouts_are_refused(key: str, value: list) -> None:
    message = _error(LLAMA4_TINY | {key: value})
    assert key in message and repr(value) in message


def test_chunked_attention_flops_by_hand() -> None:
    """A chunked layer's core at s = 96 tokens over chunks of 32: each chunk's queries attend
    to 1..32 keys, 3 * 528 = 1,584 pairs, 16.5 per query; in the full layer's units (context
    s/2 for (s+1)/2) 16 keys: 4 * 16 * q_size = 64 * 16 = 1,024 per token; the full layer's
    4 * 48 * 16 = 3,072."""
    from memplan.model.attention import Attention, WindowAttention

    spec = spec_from_hf_dict(LLAMA4_TINY, "cfg.json", "m")
    assert WindowAttention().core_flops_per_token(spec, 96) == 1_024
    assert Attention().core_flops_per_token(spec, 96) == 3_072


def test_unmodelled_family_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family named in ``NOT_MODELLED`` (none at present: Llama 4 text and Qwen3-Next were
    the last) is refused with one line naming the type and what it lacks."""
    from memplan.hf import families_moe

    monkeypatch.setitem(families_moe.NOT_MODELLED, "glm4_moe", "its router is not modelled")
    message = _error({"model_type": "glm4_moe", "hidden_size": 16})
    assert "'glm4_moe'" in message and "its router is not modelled" in message


def _llama4_dims(seq_len: int = 8, **workload):
    from memplan import api
    from memplan.model.dims import Dims

    spec, par, wl = api.resolve(spec_from_hf_dict(LLAMA4_TINY, "cfg.json", "m"), gpus=1,
                                framework="hf", precision="fp32", micro_batch_size=1,
                                seq_len=seq_len, **workload)
    return spec, wl, Dims.of(spec, par, wl)


def test_llama4_every_expert_terms_by_hand() -> None:
    """The hf preset runs Llama 4's own MoE (moe_impl every). T = 1 * 8 tokens, E = 4, h = 16,
    f = 8, fp32: top-1 indices 8 * 8 = 64; the fp32 sigmoid scores 8 * 4 * 4 = 128; the
    repeated input and the scaled one, E*T = 32 rows of 16: 2,048 each; the score column
    32 * 4 = 128; the experts' gate, up, activation and product over 32 rows of 8: 4 * 1,024;
    the shared expert's over 8 rows: 4 * 256. In all 9,536 B."""
    from memplan.model.moe import MoE
    from memplan.model.dims import total
    from memplan.workload import MoeImpl, Recompute

    spec, wl, dm = _llama4_dims()
    assert wl.moe_impl is MoeImpl.EVERY
    terms = {t.name: t.size_bytes for t in MoE().saved(spec, wl, dm, Recompute.NONE)}
    assert terms["moe.repeated_in"] == terms["moe.dispatched"] == 2_048
    assert total(MoE().saved(spec, wl, dm, Recompute.NONE)) == 9_536


def test_llama4_l2_qk_norm_terms_by_hand() -> None:
    """The weightless L2 norm saves its fp32 input and the per-row rsqrt, no weighted
    product: q 8 tokens * 2 heads of 8: 512 + 16 * 4 = 64; k one head: 256 + 32. In all 864 B,
    on the RoPE layer only (the NoPE layer's block has none)."""
    from memplan.model.attention import qk_norm_terms
    from memplan.model.dims import total
    from memplan.model.layer import layer_blocks

    spec, wl, dm = _llama4_dims()
    assert total(qk_norm_terms(spec, wl, dm)) == 864
    rope, nope = layer_blocks(spec, False, "window")[1], layer_blocks(spec, True)[1]
    assert not any(t.name.startswith("attn.q_norm") for t in nope.saved(spec, wl, dm,
                                                                         Recompute.NONE))
    assert any(t.name.startswith("attn.q_norm") for t in rope.saved(spec, wl, dm,
                                                                    Recompute.NONE))


def test_llama4_rope_table_and_window_mask_under_recompute() -> None:
    """Llama 4's RoPE table: s * d/2 complex64 pairs, 8 * 4 * 8 = 256 B in any dtype. Under
    full recompute the chunk mask (bool, b * s * s = 1,024 B at s 32 over chunks of 32;
    none under 32 tokens, where transformers skips it) is every checkpointed layer's input:
    saved."""
    from memplan.model.attention import rope_terms, window_mask_terms

    spec, wl, dm = _llama4_dims()
    assert [(t.name, t.size_bytes) for t in rope_terms(spec, wl, dm)] == [("rope.freqs_cis",
                                                                           256)]
    assert window_mask_terms(spec, wl, dm) == []
    assert window_mask_terms(*_llama4_dims(recompute="full")) == []  # 8 tokens: no mask
    assert [t.size_bytes for t in window_mask_terms(*_llama4_dims(32, recompute="full"))] == [
        1_024]


def test_llama4_moe_flops_by_hand() -> None:
    """FLOPs per token of the MoE block: 2 per parameter every token passes, the router
    16 * 4 = 64 and the shared expert 3 * 16 * 8 = 384, and 2 per parameter of the top-1
    of 4 experts (4 * 384 / 4 = 384): 2 * 448 + 2 * 384 = 1,664 (the routed top-k's; with every
    expert, as transformers' own MoE runs them: the next test)."""
    from memplan.model.moe import MoE

    spec = spec_from_hf_dict(LLAMA4_TINY, "cfg.json", "m")
    assert MoE().flops_per_token(spec, 32) == 1_664


def test_llama4_every_expert_flops_by_hand() -> None:
    """transformers' Llama4TextMoe.forward runs every token through all 4 experts (the bmm of
    Llama4TextExperts.forward over hidden_states.repeat(4, 1)): 2 * 448 + 2 * 1,536 = 3,968
    per token through the MoE block. The step's model FLOPs stay the routed top-1's; its
    hardware FLOPs add the other experts' forward and backward: 3 * (3,968 - 1,664) = 6,912
    per token of the one MoE layer, 8 tokens: 55,296 (no recompute, pp 1)."""
    from memplan.model.moe import MoE
    from memplan.planning.timing import step_flops
    from memplan.workload import MoeImpl

    spec, wl, _ = _llama4_dims()
    assert wl.moe_impl.value == "every"
    assert MoE().flops_per_token(spec, 8, every=True) == 3_968
    model, hardware = step_flops(spec, wl, 1, pp=1)
    grouped, grouped_hw = step_flops(spec, wl.model_copy(update={"moe_impl": MoeImpl.GROUPED}), 1,
                                     pp=1)
    assert model == grouped == grouped_hw
    assert hardware - model == 55_296


def test_gpt_oss_checkpointed_gate_holds_its_clamped_swiglu_and_gathered_biases() -> None:
    """GPT-OSS's grouped experts without saving (grouped_mm_experts_forward, GptOssExperts.
    _apply_gate): at the gate the biased gate/up output (R x 2f), the gate/up biases gathered
    per row (selected_biases, R x 2f) and the clamped gate, clamped up, glu, up + 1 and their
    product (R x f each): 9 R f where a plain SwiGLU holds 4; at the unsort the down
    projection's gathered biases (R x h) beside the rest. GPT-OSS 20B at 128 tokens in bf16:
    R = 128 x 4 = 512 rows, f = h = 2,880: R f e = R h e = 2,949,120 B, so 5 x 2,949,120 =
    14,745,600 B more at the gate and 2,949,120 B more at the unsort."""
    from memplan.api import make_layout, make_workload
    from memplan.model.dims import Dims
    from memplan.model.moe import _grouped_moments
    from memplan.spec import load_model

    spec = load_model("gpt-oss-20b")
    wl = make_workload(spec, micro_batch_size=1, seq_len=128, precision="bf16-pure")
    dm = Dims.of(spec, make_layout(1), wl)
    plain = spec.model_copy(update={"moe": spec.moe.model_copy(update={"clamped_swiglu": False})})
    (gate, unsort), (gate0, unsort0) = _grouped_moments(spec, dm), _grouped_moments(plain, dm)
    assert spec.mlp_bias and (gate - gate0, unsort - unsort0) == (14_745_600, 2_949_120)


def test_qwen_routers_cast_the_top_k_weights_to_the_compute_dtype() -> None:
    """transformers 5.23's Qwen2MoeTopKRouter.forward (Qwen3-MoE's and Qwen3-Next's the same)
    casts the top-k weights to router_logits.dtype, the linear's bf16 output: the readers and
    the catalog set ``router_weights_cast``, so the grouped experts' saved routing weights
    are R * 2 bytes in bf16. qwen1.5-moe-a2.7b, one sequence of 1,024 tokens, top-4: R =
    4,096 routed rows, 8,192 B (fp32 weights, as 5.3 kept them: 16,384 B)."""
    from memplan.api import make_layout, make_workload
    from memplan.model.dims import Dims
    from memplan.model.moe import moe_terms
    from memplan.spec import load_model
    from memplan.workload import MoeImpl

    for name in ("qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "qwen3-next-80b-a3b"):
        moe = load_model(name).moe
        assert moe is not None and moe.router_weights_cast
    hf = Path(__file__).resolve().parents[1] / "data" / "hf"
    for name in ("Qwen1.5-MoE-A2.7B", "Qwen3-30B-A3B", "Qwen3-Next-80B-A3B-Instruct"):
        data = json.loads((hf / name / "config.json").read_text())
        spec = spec_from_hf_dict(data, "config.json", name)
        assert spec.moe is not None and spec.moe.router_weights_cast
    spec = load_model("qwen1.5-moe-a2.7b")
    wl = make_workload(spec, framework="hf", seq_len=1024, micro_batch_size=1,
                       precision="bf16-mixed")
    dm = Dims.of(spec, make_layout(1), wl)

    def weights(s) -> int:
        return next(t.size_bytes for t in moe_terms(s, dm, MoeImpl.GROUPED)
                    if t.name == "moe.routing_weights")

    fp32 = spec.model_copy(update={"moe": spec.moe.model_copy(
        update={"router_weights_cast": False})})
    assert (weights(spec), weights(fp32)) == (8_192, 16_384)
