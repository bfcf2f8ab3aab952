"""Published transformers configs (tests/data/hf) cut down for traces, shared by the traced
suites that build transformers models."""

from __future__ import annotations

import json
from pathlib import Path

HF_DIR = Path(__file__).resolve().parents[1] / "data" / "hf"


def hf(name: str, **overrides) -> dict:
    """A published config.json (tests/data/hf), cut down by ``overrides``: a multimodal
    config's language model (``text_config``); without the quantization of a published fp8
    checkpoint (its stored weights, not the model trained)."""
    data = json.loads((HF_DIR / name / "config.json").read_text())
    data = data.get("text_config", data)
    data.pop("quantization_config", None)
    # ids beyond a cut vocabulary only draw a warning; drop them
    data.update({k: None for k in ("bos_token_id", "eos_token_id")}, **overrides)
    return data


# cut to two layers and narrowed; the head ratio (GQA 4:1) and the ffn ratio kept
LLAMA3_TOY = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=896,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
# MLA with a 48-wide q/k head and a 32-wide value head, one dense layer then an MoE layer
DEEPSEEK_TOY = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                    num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                    first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32,
                    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_group=2,
                    topk_group=1, rope_scaling=None)
# OLMo 2 (post norms, full-width q/k norms) at the Llama toy's width: 8 heads of 32, all KV
# heads (OLMo 2 7B's MHA), the ffn ratio kept (11,008 / 4,096 x 256 = 688)
OLMO2_TOY = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=688,
                 num_attention_heads=8, num_key_value_heads=8, vocab_size=1000)
# Gemma 2 (sandwich norms, GeGLU) at the Llama toy's widths: 8 heads of 32, 4 KV heads (9B's
# GQA 2:1), ffn 896; its sliding window (4,096) longer than the traced sequences
GEMMA2_TOY = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=896,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=1000)
