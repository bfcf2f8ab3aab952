"""Reading the MoE / hybrid families' ``config.json`` (memplan.hf.families_moe): the keys each
family's configuration class defaults, and the families refused by name."""

from __future__ import annotations

import pytest

from memplan.errors import MemplanError
from memplan.spec import spec_from_hf_dict

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


@pytest.mark.parametrize(("model_type", "missing"), [
    ("llama4_text", "chunked local attention")])
def test_unmodelled_family_is_refused_by_name(model_type: str, missing: str) -> None:
    message = _error({"model_type": model_type, "hidden_size": 16})
    assert f"'{model_type}'" in message and missing in message
