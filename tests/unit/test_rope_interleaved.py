"""ERNIE 4.5's RoPE as transformers writes it (models/ernie4_5_moe/modeling_ernie4_5_moe.py,
models/ernie4_5/modeling_ernie4_5.py): Ernie4_5_MoeRotaryEmbedding.forward returns its cos
and sin tables in fp32 whatever the dtype ("keeping it in full precision",
``ModelSpec.rope_tables_fp32``), and apply_rotary_pos_emb repeats their first halves pairwise
in every layer (``cos[..., :d // 2].repeat_interleave(2, dim=-1)``, ``rope_interleaved``):
the rotation's products (q.float() * cos, rotate_half(q).float() * sin) save those copies,
not the model's tables, which are then a local of the model's forward, saved only as the
checkpointed layers' inputs.

ERNIE-4.5-21B-A3B (head_dim 128), 1 x 1,024 tokens in bf16: one pair of tables 2 x 1,024 x
128 x 4 = 1,048,576 B, where Llama's bf16 pair is 524,288 B.
"""

from __future__ import annotations

import json
from pathlib import Path

from memplan.api import make_layout, make_workload
from memplan.model import attention
from memplan.model.dims import Dims
from memplan.spec import spec_from_hf_dict
from memplan.workload import Recompute

HELDOUT = Path(__file__).resolve().parents[1] / "data" / "hf" / "heldout"
PAIR_FP32 = 2 * 1024 * 128 * 4  # 1,048,576


def _ernie(name: str = "ERNIE-4.5-21B-A3B-PT", **update):
    data = json.loads((HELDOUT / name / "config.json").read_text())
    spec = spec_from_hf_dict(data, "config.json", name)
    return spec.model_copy(update=update) if update else spec


def _dims(spec, recompute: str = "none"):
    wl = make_workload(spec, seq_len=1024, micro_batch_size=1, precision="bf16-pure",
                       framework="hf", **({"recompute": recompute} if recompute != "none"
                                          else {}))
    return wl, Dims.of(spec, make_layout(1), wl)


def test_readers_set_the_flags() -> None:
    for name in ("ERNIE-4.5-21B-A3B-PT", "ERNIE-4.5-0.3B-PT"):
        spec = _ernie(name)
        assert spec.rope_tables_fp32 and spec.rope_interleaved and spec.rope_keeps_dtype


def test_each_layer_saves_its_fp32_copies() -> None:
    """Without checkpointing: every attention block saves its pair (1,048,576 B), the
    model's tables are no saved term but a local of the forward (1,048,576 B)."""
    spec = _ernie()
    wl, dm = _dims(spec)
    terms = {t.name: t.size_bytes
             for t in attention.attention_terms(spec, wl, dm, Recompute.NONE)}
    assert terms["attn.rope_tables"] == PAIR_FP32
    assert attention.rope_terms(spec, wl, dm) == []
    assert attention.rope_local_bytes(spec, wl, dm) == PAIR_FP32


def test_checkpointed_layers_keep_the_model_tables() -> None:
    """Under full recompute the model's fp32 tables are the checkpoints' input, saved once
    (1,048,576 B); the layers save their input only, their copies rebuilt in backward."""
    spec = _ernie()
    wl, dm = _dims(spec, "full")
    assert [(t.name, t.size_bytes) for t in attention.rope_terms(spec, wl, dm)] == [
        ("rope.cos_sin", PAIR_FP32)]
    assert attention.rope_local_bytes(spec, wl, dm) == 0


def test_without_the_flags_llama_tables() -> None:
    """The same spec read as Llama's RoPE: one bf16 pair, saved by the layers' products
    through views (2 x 1,024 x 128 x 2 = 524,288 B), no copy per layer."""
    spec = _ernie(rope_tables_fp32=False, rope_interleaved=False)
    wl, dm = _dims(spec)
    terms = {t.name for t in attention.attention_terms(spec, wl, dm, Recompute.NONE)}
    assert "attn.rope_tables" not in terms
    assert [(t.name, t.size_bytes) for t in attention.rope_terms(spec, wl, dm)] == [
        ("rope.cos_sin", 524_288)]


def test_glm4_repeats_its_tables_in_the_activations_dtype() -> None:
    """GLM-4's apply_rotary_pos_emb (models/glm4/modeling_glm4.py) repeats its tables the same
    way, on the first half of each head (rotary_dim 64 of GLM-4-9B-0414's head_dim 128), the
    tables cast to the hidden states' dtype (Glm4RotaryEmbedding.forward: cos.to(x.dtype)):
    each layer saves 2 x 1,024 x 64 x 2 = 262,144 B in bf16, the model's tables a local of
    its forward."""
    data = json.loads((HELDOUT / "GLM-4-9B-0414" / "config.json").read_text())
    spec = spec_from_hf_dict(data, "config.json", "GLM-4-9B-0414")
    assert spec.rope_interleaved and not spec.rope_tables_fp32 and spec.rope_dim == 64
    wl, dm = _dims(spec)
    terms = {t.name: t.size_bytes
             for t in attention.attention_terms(spec, wl, dm, Recompute.NONE)}
    assert terms["attn.rope_tables"] == 262_144
    assert attention.rope_local_bytes(spec, wl, dm) == 262_144


def test_gpt_oss_tables_are_one_column_per_frequency() -> None:
    """GPT-OSS (models/gpt_oss/modeling_gpt_oss.py GptOssRotaryEmbedding.forward: emb =
    freqs, no torch.cat((freqs, freqs))) returns cos and sin of head_dim / 2 columns, cast to
    the activations' dtype. gpt-oss-20b (head_dim 64), 1 x 1,024 tokens in bf16: 2 x 1,024 x
    32 x 2 = 131,072 B, half of a Llama-style pair of that head width (2 x 1,024 x 64 x 2 =
    262,144 B); the catalog entry and the config reader both say so."""
    from memplan.spec import load_model

    spec = load_model("gpt-oss-20b")
    assert spec.rope_half_tables and spec.head_dim == 64
    # the reader of a config.json (GptOssConfig's keys; head_dim 64 by default)
    read = spec_from_hf_dict({"model_type": "gpt_oss", "num_hidden_layers": 2,
                              "hidden_size": 256, "intermediate_size": 256,
                              "num_attention_heads": 4, "num_key_value_heads": 2,
                              "vocab_size": 1000, "num_local_experts": 4,
                              "num_experts_per_tok": 2}, "config.json", "gpt-oss-toy")
    assert read.rope_half_tables
    wl, dm = _dims(spec)
    assert attention.rope_terms(spec, wl, dm)[0].size_bytes == 2 * 1024 * 32 * 2 == 131_072
    llama_style = spec.model_copy(update={"rope_half_tables": False})
    assert attention.rope_terms(llama_style, wl, dm)[0].size_bytes == 262_144
