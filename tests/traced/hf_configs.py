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
