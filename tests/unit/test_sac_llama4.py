"""Op-level checkpointing of Llama 4's layers (``memplan.model.sac_ops._complex_rope_ops``,
``_l2_norm_ops``): the L2 q/k norms after complex RoPE on the RoPE layers, chunked attention,
the NoPE layers without either; bytes and policy indices derived by hand.

tiny-l4: tiny (h 64, 4 heads / 2 KV heads of d 16, SwiGLU f 176) on 4 layers, as Llama 4
runs them (models/llama4/modeling_llama4.py): layers 0-2 rotate q and k by the complex table
and L2-norm them, attention chunked over 64 tokens; layer 3 neither, full attention. At seq
128 and micro-batch 2 in bf16 a layer's tokens are T = 256; the q norm runs on T x 4 = 1,024
rows of 16, the k norm on 512: q norm's fp32 input 1,024 x 16 x 4 = 65,536 B, its rsqrt
1,024 x 4 = 4,096 B; the k norm's half of each (32,768 and 2,048 B). Its cast back is the q
(k) SDPA saves, the layer's ``attn.q`` (``attn.k``) term; its x * rstd is saved by no one.
"""

from __future__ import annotations

import pytest
from memplan.api import estimate, make_layout, make_workload
from memplan.errors import LayoutError
from memplan.model.dims import Dims
from memplan.model.layer import ops_items, ops_unkept
from memplan.profile.sac_policy import emitted_module
from memplan.spec import ModelSpec, load_model

TINY_L4 = ModelSpec.model_validate({
    **load_model("tiny").model_dump(), "name": "tiny-l4", "num_layers": 4, "qk_norm": "l2",
    "rope_complex": True, "nope_layer_interval": 4, "sliding_window": 64,
    "sliding_window_pattern": 4, "window_chunked": True, "max_seq_len": 1024})
FIELDS = dict(seq_len=128, micro_batch_size=2)


def _wl(**fields):
    return make_workload(TINY_L4, **{**FIELDS, **fields}, recompute="ops")


def _items(variant: str | None = None, **fields):
    wl = _wl(**fields)
    return ops_items(TINY_L4, wl, Dims.of(TINY_L4, make_layout(1), wl), False, variant)


def test_l2_norm_items_by_hand() -> None:
    """Each norm's fp32 input (``_to_copy``) and rsqrt, in the attention block: bytes as
    above, one FLOP per element of the rank's q (64) or k (32) width per token. Indices: the
    16-wide casts run RoPE's two x.float() and two type_as (0-3), the q norm's x.float() (4)
    and type_as (5), the k norm's (6, 7); the rsqrts attention norm, q norm, k norm, MLP norm
    (0-3)."""
    l2 = {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth, i.block)
          for i in _items() if "_norm." in i.name and i.name.startswith("attn.")}
    assert l2 == {
        "attn.q_norm.input_fp32": (65_536, 64.0, "copy", 16, 4, "attn"),
        "attn.q_norm.stats": (4_096, 64.0, "rsqrt", 1, 1, "attn"),
        "attn.k_norm.input_fp32": (32_768, 32.0, "copy", 16, 6, "attn"),
        "attn.k_norm.stats": (2_048, 32.0, "rsqrt", 1, 2, "attn"),
    }
    assert {i.name: i.nth for i in _items()}["mlp_norm.stats"] == 3


def test_l2_norm_inputs_in_fp32_are_ropes_products() -> None:
    """In fp32 x.float() is RoPE's output itself, the view of its complex product (8 pairs
    wide, ``aten.mul``: q's the first, k's the second); the casts are no ops. Bytes as in
    bf16: the fp32 input is the same tensor size."""
    l2 = {i.name: (i.size_bytes, i.op, i.width, i.nth)
          for i in _items(precision="fp32") if "_norm." in i.name and i.name.startswith("attn.")}
    assert l2 == {"attn.q_norm.input_fp32": (65_536, "mul", 8, 0),
                  "attn.q_norm.stats": (4_096, "rsqrt", 1, 1),
                  "attn.k_norm.input_fp32": (32_768, "mul", 8, 1),
                  "attn.k_norm.stats": (2_048, "rsqrt", 1, 2)}


def test_nope_layer_has_no_l2_items_and_counts_the_temperature_tuning() -> None:
    """The NoPE layer: no q/k norm items. At seq 64 = h its temperature tuning's cast of the
    positions (``cache_position.float()``, 64 wide) runs between the attention norm's two
    casts (0, 1) and the MLP norm's, which become the 3rd and 4th 64-wide casts (2 and 3 in
    the RoPE layers)."""
    nope = {i.name: i.nth for i in _items("nope", seq_len=64)}
    rope = {i.name: i.nth for i in _items(seq_len=64)}
    assert not [n for n in nope if "q_norm" in n or "k_norm" in n]
    assert (nope["mlp_norm.input_fp32"], nope["mlp_norm.normed"]) == (3, 4)
    assert (rope["mlp_norm.input_fp32"], rope["mlp_norm.normed"]) == (2, 3)
    wl = _wl(seq_len=64)
    unkept = ops_unkept(TINY_L4, wl, Dims.of(TINY_L4, make_layout(1), wl), False, "nope")
    assert unkept.count(("copy", 64)) == 1  # the positions' cast


def test_l2_items_kept_on_the_rope_layers_alone() -> None:
    """The q norm's rsqrt and the k norm's fp32 input kept: 3 RoPE layers x (4,096 + 32,768)
    = 110,592 B beyond keeping nothing; the NoPE layer has neither."""
    def act(save: str) -> int:
        return estimate(TINY_L4, **FIELDS, recompute="ops",
                        recompute_save=save).stages[0].activations_bytes

    assert act("attn.q_norm.stats,attn.k_norm.input_fp32") - act("") == 110_592


def test_emitted_policy_gives_the_nope_layer_its_own_counts() -> None:
    """Layer 3's set and counts are its own (``LAYER_SAVE``, ``LAYER_COUNTS``): the k norm's
    input is the 7th 16-wide cast (nth 6) of a RoPE layer, v's projection the 2nd 32-wide
    matmul (after k's) of every layer; the NoPE layer keeps v alone and counts no 16-wide
    cast (at seq 128 in bf16 its temperature tuning's cast back is the only one: no item's)."""
    wl = _wl(recompute_save=("attn.k_norm.input_fp32", "attn.v"))
    module = emitted_module(TINY_L4, wl)
    assert module["SAVE"] == {("copy", 16, 6), ("matmul", 32, 1)}
    assert module["LAYER_SAVE"] == {3: {("matmul", 32, 1)}}
    assert set(module["LAYER_COUNTS"]) == {3}
    assert ("copy", 16) not in module["LAYER_COUNTS"][3]


@pytest.mark.parametrize(("fields", "why"), [
    (dict(norm_impl="fused"), "l2 q/k norms of norm_impl fused"),
])
def test_refusals_name_what_is_not_modelled(fields: dict, why: str) -> None:
    with pytest.raises(LayoutError, match=why):
        estimate(TINY_L4, **FIELDS, recompute="ops", **fields)


def test_every_expert_moe_is_refused_by_name() -> None:
    """transformers' Llama4TextMoe (``moe_impl every``, the hf preset's for Llama 4) stays
    refused; the grouped experts (``moe_impl grouped``) are modelled."""
    with pytest.raises(LayoutError, match="moe_impl every .Llama 4's Llama4TextMoe"):
        estimate("llama-4-scout", seq_len=4096, micro_batch_size=1, gpus=8, zero=3,
                 recompute="ops", moe_impl="every")
    assert estimate("llama-4-scout", seq_len=4096, micro_batch_size=1, gpus=8, zero=3,
                    recompute="ops", moe_impl="grouped",
                    recompute_save=("attn.q_norm.stats",)).peak_bytes > 0


def test_l2_without_complex_rope_is_refused() -> None:
    spec = TINY_L4.model_copy(update={"rope_complex": False})
    with pytest.raises(LayoutError, match="without Llama 4's complex RoPE"):
        estimate(spec, **FIELDS, recompute="ops")


def test_nope_layers_without_l2_norms_count_their_own_ops() -> None:
    """Without q/k norms (Maverick's: ``use_qk_norm`` false) the NoPE layer's items are the
    RoPE layers', but its ops are not: at seq 64 = h the positions' cast is a 64-wide cast
    between the attention norm's two and the MLP norm's, so keeping the MLP norm's fp32 input
    is the 3rd such cast (nth 2) of a RoPE layer and the 4th (nth 3) of the NoPE layer, which
    runs five where the others run four."""
    spec = ModelSpec.model_validate({**TINY_L4.model_dump(), "qk_norm": "none",
                                     "name": "tiny-l4-noqk"})
    wl = make_workload(spec, seq_len=64, micro_batch_size=2, recompute="ops",
                       recompute_save=("mlp_norm.input_fp32",))
    module = emitted_module(spec, wl)
    assert module["SAVE"] == {("copy", 64, 2)}
    assert module["LAYER_SAVE"] == {3: {("copy", 64, 3)}}
    assert module["PER_LAYER"][("copy", 64)] == 4
    assert module["LAYER_COUNTS"][3][("copy", 64)] == 5


def test_a_kind_of_nope_layers_alone_is_emitted() -> None:
    """Llama 4 Maverick's config.json (no q/k norm, MoE on every second layer) cut to two
    layers with a NoPE layer every second: the MoE kind is its NoPE layer alone, whose op
    counts are the policy's own (``PER_LAYER``), the dense RoPE layer's apart
    (``LAYER_COUNTS``); the projections and kernel kept in both (the q and output
    projections 128 wide, the 1st and 2nd such matmuls; k and v 64 wide; the kernel 4 heads x
    32)."""
    from memplan.report.sac_policy import emit_for
    from memplan.spec import spec_from_hf_dict

    config = {"model_type": "llama4_text", "hidden_size": 128, "intermediate_size": 64,
              "intermediate_size_mlp": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 512, "num_local_experts": 4,
              "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "use_qk_norm": False,
              "no_rope_layer_interval": 2, "attention_chunk_size": 32,
              "max_position_embeddings": 4096}
    spec = spec_from_hf_dict(config, "config.json", "maverick-toy")
    est = estimate(spec, seq_len=64, micro_batch_size=2, recompute="ops", moe_impl="grouped",
                   recompute_save=("attention",))
    lines = {line.split(" = ")[0]: eval(line.split(" = ")[1])  # noqa: S307 (our own text)
             for line in emit_for("torch", est).splitlines()
             if line.startswith(("SAVE =", "LAYER_SAVE =", "LAYER_COUNTS ="))}
    assert lines["SAVE"] == {("matmul", 128, 0), ("matmul", 64, 0), ("matmul", 64, 1),
                             ("matmul", 128, 1), ("sdpa", 128, 0)}
    assert lines["LAYER_SAVE"] == {} and set(lines["LAYER_COUNTS"]) == {0}
