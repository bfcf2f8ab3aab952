"""Op-level checkpointing of MLA layers (``memplan.model.sac_mla``), bytes derived by hand.

deepseek-v3 (the catalog's: h 7,168, 128 heads, q_lora_rank 1,536, kv_lora_rank 512, q/k
heads of 128 + 64 RoPE = 192, value heads of 128) at 16 tokens, micro-batch 1, in bf16
(e = 2), one rank: T = 16 tokens. A dense layer's attention items, in execution order
(models/deepseek_v3/modeling_deepseek_v3.py DeepseekV3Attention.forward):

- ``mla.q_a``: T*1,536*e = 49,152 B, 2*7,168*1,536 = 22,020,096 FLOPs per token;
- the q_a norm's fp32 cast T*1,536*4 = 98,304, rsqrt T*4 = 64, cast back and weighted
  output T*1,536*e = 49,152 each (one FLOP per element: 1,536 per token);
- ``mla.q_b``: T*128*192*e = 786,432 B, 2*1,536*24,576 = 75,497,472;
- ``mla.kv_a``: T*(512 + 64)*e = 18,432 B, 2*7,168*576 = 8,257,536;
- the kv_a norm's T*512*4 = 32,768, 64, 16,384 and 16,384;
- ``mla.kv_b`` (the saved ``mla.kv_up``): T*128*256*e = 1,048,576 B, 2*512*32,768 =
  33,554,432;
- ``mla.q`` and ``mla.k`` (the concatenations, ``aten.cat`` of width 192): T*24,576*e =
  786,432 B each, 24,576 FLOPs (one per element);
- ``mla.out``: the kernel's output T*128*128*e = 524,288 and fp32 logsumexp 128*16*4 =
  8,192: 532,480 B; s*a*(192 + 128) = 16*128*320 = 655,360 FLOPs per token;
- ``mla.o_proj``: T*7,168*e = 229,376 B, 2*16,384*7,168 = 234,881,024.
"""

from __future__ import annotations

import pytest

from memplan.api import estimate, make_layout, make_workload
from memplan.errors import MemplanError
from memplan.model import sac_ops
from memplan.model.dims import Dims
from memplan.model.layer import ops_items
from memplan.report.sac_policy import emit_for
from memplan.spec import ModelSpec, load_model

DSV3 = load_model("deepseek-v3")
FIELDS = dict(seq_len=16, micro_batch_size=1, moe_impl="grouped")


def _items(precision: str = "bf16-mixed") -> dict:
    wl = make_workload(DSV3, **FIELDS, precision=precision, recompute="ops")
    items = ops_items(DSV3, wl, Dims.of(DSV3, make_layout(1), wl), moe=False)
    return {i.name: (i.terms, i.size_bytes, i.flops_per_token, i.op, i.width, i.nth)
            for i in items if i.name.startswith("mla.")}


def test_mla_items_by_hand() -> None:
    """The module docstring's bytes and FLOPs; the latent norms named by their ops (each
    op's index among the layer's of its family and width: the four rsqrts are the attention
    norm's, q_a's, kv_a's and the MLP norm's)."""
    assert _items() == {
        "mla.q_a": ((), 49_152, 22_020_096.0, "matmul", 1536, 0),
        "mla.q_norm.input_fp32": (("mla.q_norm.input_fp32",), 98_304, 1536.0, "copy", 1536, 0),
        "mla.q_norm.stats": (("mla.q_norm.stats",), 64, 1536.0, "rsqrt", 1, 1),
        "mla.q_norm.normed": (("mla.q_norm.normed",), 49_152, 1536.0, "copy", 1536, 1),
        "mla.q_norm.output": (("mla.q_norm.output",), 49_152, 1536.0, "mul", 1536, 1),
        "mla.q_b": ((), 786_432, 75_497_472.0, "matmul", 24_576, 0),
        "mla.kv_a": ((), 18_432, 8_257_536.0, "matmul", 576, 0),
        "mla.kv_norm.input_fp32": (("mla.kv_norm.input_fp32",), 32_768, 512.0, "copy", 512, 0),
        "mla.kv_norm.stats": (("mla.kv_norm.stats",), 64, 512.0, "rsqrt", 1, 2),
        "mla.kv_norm.normed": (("mla.kv_norm.normed",), 16_384, 512.0, "copy", 512, 1),
        "mla.kv_norm.output": (("mla.kv_norm.output",), 16_384, 512.0, "mul", 512, 1),
        "mla.kv_b": (("mla.kv_up",), 1_048_576, 33_554_432.0, "matmul", 32_768, 0),
        "mla.q": (("mla.q",), 786_432, 24_576.0, "cat", 192, 0),
        "mla.k": (("mla.k",), 786_432, 24_576.0, "cat", 192, 1),
        "mla.out": (("mla.out", "mla.lse"), 532_480, 655_360.0, "sdpa", 24_576, 0),
        "mla.o_proj": ((), 229_376, 234_881_024.0, "matmul", 7168, 0),
    }


def test_mla_items_in_fp32() -> None:
    """In fp32 the latent norms' casts are no ops: their input is the down projection's
    output itself, which that projection's item keeps (T*1,536*4 = 98,304 B; kv_a's whole
    output, T*576*4 = 36,864 B, of which the norm reads a slice); their other tensors are
    no op outputs a policy names (``NORM``)."""
    items = _items("fp32")
    assert items["mla.q_a"][:2] == (("mla.q_norm.input_fp32",), 98_304)
    assert items["mla.kv_a"][:2] == (("mla.kv_norm.input_fp32",), 36_864)
    assert "mla.q_norm.input_fp32" not in items and "mla.kv_norm.input_fp32" not in items
    assert items["mla.q_norm.stats"][3] == sac_ops.NORM


def test_kept_items_add_their_bytes() -> None:
    """Keeping the query's concatenation and the kernel's output in the dense layers adds
    786,432 + 532,480 B per dense layer (3 of deepseek-v3's 61) to the saved activations."""
    def saved(save: str) -> int:
        return estimate(DSV3, **FIELDS, recompute="ops", recompute_save=save,
                        framework="hf").stages[0].activations_bytes

    assert saved("dense:mla.q,dense:mla.out") - saved("") == 3 * (786_432 + 532_480)


def test_mla_under_autocast_is_refused_by_name() -> None:
    """Autocast around MLA is not traced (and around MoE layers not modelled at all): its
    layers without experts are refused by name."""
    dense = ModelSpec.model_validate({**DSV3.model_dump(), "name": "dsv3-dense", "moe": None})
    with pytest.raises(MemplanError, match="MLA attention under autocast"):
        estimate(dense, **FIELDS, precision="amp-bf16", recompute="ops", recompute_save="")


def _emit(target: str, save: str) -> str:
    est = estimate(DSV3, **FIELDS, recompute="ops", recompute_save=save, framework="hf")
    return emit_for(target, est)


def test_torch_policy_names_the_concatenations() -> None:
    """``mla.q`` is the layer's first ``aten.cat`` of width 192, ``mla.kv_b`` its first
    32,768-wide matmul; the policy counts ``aten.cat`` by its output's last dimension."""
    text = _emit("torch", "dense:mla.q,dense:mla.kv_b")
    compile(text, "policy.py", "exec")
    assert "0: {('cat', 192, 0), ('matmul', 32768, 0)}" in text
    assert "_aten.cat.default" in text


def test_megatron_and_torchtitan_say_what_they_cannot_express() -> None:
    """Megatron-LM's mla_up_proj recomputes q_b, kv_b, RoPE and the concatenations whole
    (multi_latent_attention.py ``qkv_up_proj_and_rope_apply``); the down projections, the
    latent norms and o_proj never. torchtitan's op list has no ``aten.cat`` and no norm op."""
    mega = _emit("megatron", "dense:mla.out,dense:mla.q_a,dense:mla.kv_a,dense:mla.o_proj")
    assert "--recompute-modules mla_up_proj mlp layernorm" in mega
    assert "never recomputed" in mega
    partial = _emit("megatron", "dense:attention")
    assert "--recompute-modules mlp layernorm" in partial and "mla_up_proj" not in partial
    part_up = _emit("megatron", "dense:mla.q")
    assert "core_attn layernorm" not in part_up and "up projections partly kept" in part_up
    titan = _emit("torchtitan", "dense:mla.q,dense:mla.kv_b")
    assert "attention.wkv_a" in titan and "attention.wkv_b" not in titan
    assert "no aten.cat" in titan
