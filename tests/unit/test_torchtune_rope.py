"""torchtune's RoPE buffers up to 0.1 (``rope_cache layer-max``): every decoder layer's own
``RotaryPositionalEmbeddings`` with fp32 ``theta`` and ``cache`` over the model's
``max_seq_len`` positions (torchtune modules/position_embeddings.py ``_rope_init``,
``build_rope_cache`` at 0914d5cf, ff594c23 and fef3ed10; one copy per layer by
``_get_clones`` in modules/transformer.py)."""

from __future__ import annotations

import memplan
from memplan.model.attention import max_positions_rope_bytes
from memplan.spec import ModelSpec, load_model

LORA = dict(gpus=1, micro_batch_size=2, seq_len=512, precision="bf16-pure", recompute="full",
            optimizer="adamw", lora_rank=8, lora_targets="q,v", lora_dropout=0.0,
            adapters_in_model_dtype=True, logits_held="step")


def test_one_layer_of_llama_2_7b() -> None:
    """head_dim 128: theta has 64 fp32 frequencies (256 B); cache is (4096, 64, 2) fp32,
    4096 x 64 x 2 x 4 = 2,097,152 B; together 2,097,408 B."""
    assert max_positions_rope_bytes(load_model("llama-2-7b")) == 2_097_408


def test_traced_toy() -> None:
    """The traced toy (torchtune 0.1.1 ``lora_llama2``: 4 layers, embed_dim 256, 4 heads,
    max_seq_len 128): per layer theta 32 x 4 = 128 B and cache 128 x 32 x 2 x 4 = 32,768 B;
    4 x 32,896 = 131,584 B, the buffers the tensor tracker counted."""
    tiny = load_model("tiny")
    spec = ModelSpec.model_validate({**tiny.model_dump(), "name": "tt-toy", "hidden_size": 256,
                                     "ffn_hidden_size": 688, "num_attention_heads": 4,
                                     "num_kv_heads": 4, "head_dim": 64, "num_layers": 4,
                                     "vocab_size": 512, "max_seq_len": 128})
    est = memplan.estimate(spec, **{**LORA, "seq_len": 64}, rope_cache="layer-max")
    assert est.stages[0].buffers_bytes == 131_584


def test_llama_2_7b_estimate() -> None:
    """32 layers x 2,097,408 B = 67,117,056 B of buffers (the fake-tensor trace of torchtune
    0.1.1's lora_llama2_7b counted the same), held in every phase; no cos and sin tables are
    made per forward (each layer slices its cache), so the saved activations are the
    forward-computed tables' 2 x 512 x 128 x 2 = 262,144 B (bf16) smaller."""
    model = load_model("llama-2-7b")
    fwd = memplan.estimate(model, **LORA).stages[0]
    buf = memplan.estimate(model, **LORA, rope_cache="layer-max").stages[0]
    assert buf.buffers_bytes == 67_117_056
    assert fwd.activations_bytes - buf.activations_bytes == 262_144
    assert buf.params_bytes == fwd.params_bytes
    assert buf.steady.optimizer - fwd.steady.optimizer == 67_117_056
