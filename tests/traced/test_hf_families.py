"""Parameter counts of the newer transformers families against the models transformers builds.

For each family's published ``config.json`` (``tests/data/hf``), ``AutoModelForCausalLM.
from_config`` builds the model on the meta device (no memory, every parameter's shape), and
memplan's spec of the same file must count the same parameters, to the parameter, and lay them
out in the same tensors (so the optimizer's per-tensor step counters and the largest tensor
are exact too). Toy configs exercise the options the published ones leave at their defaults
(q_proj without q_lora_rank, attention biases, dense leading layers, a sparse step).

Versions: transformers 5.3.0, torch 2.13.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memplan.model.model_states import count_stage_params  # noqa: E402
from memplan.spec import load_model, spec_from_hf_config, spec_from_hf_dict  # noqa: E402

HF = Path(__file__).resolve().parents[1] / "data" / "hf"

# fixture folder -> catalog entry (the same map tests/unit/test_hf_config.py reads)
PUBLISHED: dict[str, str] = json.loads((HF / "catalog.json").read_text())

TOY = {
    "qwen3-bias-window": dict(model_type="qwen3", hidden_size=256, intermediate_size=512,
                              num_hidden_layers=4, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=48, vocab_size=1000,
                              attention_bias=True, layer_types=["sliding_attention"] * 4,
                              sliding_window=64, use_sliding_window=True),
    "qwen2_moe-dense-first": dict(model_type="qwen2_moe", hidden_size=128,
                                  intermediate_size=256, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                  num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=64,
                                  shared_expert_intermediate_size=96, mlp_only_layers=[0]),
    "qwen3_moe-step2": dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=256,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=500, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=64, decoder_sparse_step=2),
    "gemma2-untied": dict(model_type="gemma2", hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=48, vocab_size=500, tie_word_embeddings=False),
    "phi3-gqa": dict(model_type="phi3", hidden_size=128, intermediate_size=256,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=500, pad_token_id=None),
    "olmo2-bias": dict(model_type="olmo2", hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=500, attention_bias=True, pad_token_id=None,
                       eos_token_id=None),
    "deepseek_v3-no-q-lora": dict(model_type="deepseek_v3", hidden_size=128,
                                  intermediate_size=256, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=500,
                                  n_routed_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=32, first_k_dense_replace=1,
                                  q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                                  qk_rope_head_dim=8, v_head_dim=24, n_group=2, topk_group=1,
                                  attention_bias=True, n_shared_experts=2),
    "granite-bias-untied": dict(model_type="granite", hidden_size=128, intermediate_size=256,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=500, attention_bias=True,
                                mlp_bias=True, embedding_multiplier=12.0,
                                residual_multiplier=0.22, logits_scaling=8.0),
    "gemma-mqa-untied": dict(model_type="gemma", hidden_size=128, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                             head_dim=48, vocab_size=500, tie_word_embeddings=False,
                             attention_bias=True, pad_token_id=None),
    "ministral-alternating": dict(model_type="ministral", hidden_size=128,
                                  intermediate_size=256, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                  head_dim=32, sliding_window=64, layer_types=["sliding_attention",
                                                                  "full_attention"] * 2),
    "smollm3-interval2": dict(model_type="smollm3", hidden_size=128,
                                     intermediate_size=256, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=500, no_rope_layer_interval=2,
                                     attention_bias=True, pad_token_id=None),
    "olmo3-bias-default-window": dict(model_type="olmo3", hidden_size=128,
                                      intermediate_size=256, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=500, attention_bias=True, pad_token_id=None,
                                      eos_token_id=None),
    "phi3-partial-rotary": dict(model_type="phi3", hidden_size=128, intermediate_size=256,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=500, pad_token_id=None,
                                partial_rotary_factor=0.5, tie_word_embeddings=True),
    "cohere2-bias-untied": dict(model_type="cohere2", hidden_size=128, intermediate_size=256,
                                num_hidden_layers=6, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=500, attention_bias=True,
                                tie_word_embeddings=False, sliding_window_pattern=3,
                                pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "ministral3-window": dict(model_type="ministral3", hidden_size=128, intermediate_size=256,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              vocab_size=500, sliding_window=64, pad_token_id=None),
}


def _built(data: dict) -> torch.nn.Module:
    """The model transformers builds for a config dict, on the meta device. A published
    fp8 checkpoint's quantization_config describes its stored weights, not the model: left
    out."""
    data = {k: v for k, v in data.items() if k not in ("quantization_config", "auto_map")}
    config = transformers.AutoConfig.for_model(**data)
    if data["model_type"] == "gemma3":  # its language model: Gemma3ForCausalLM(text_config)
        config = config.text_config
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _tensor_sizes(spec) -> list[int]:
    layers = tuple(range(spec.num_layers))
    return sorted(count_stage_params(spec, 1, 1, 1, layers, True, True, 1).tensor_sizes)


def _check(model: torch.nn.Module, spec) -> None:
    params = list(model.parameters())  # tied weights appear once
    assert spec.num_params == sum(p.numel() for p in params)
    assert _tensor_sizes(spec) == sorted(p.numel() for p in params)


@pytest.mark.parametrize("folder", sorted(PUBLISHED))
def test_published_config_counts_as_transformers_builds_it(folder: str) -> None:
    path = HF / folder / "config.json"
    spec = spec_from_hf_config(path)
    _check(_built(json.loads(path.read_text())), spec)
    assert load_model(PUBLISHED[folder]).num_params == spec.num_params


@pytest.mark.parametrize("name", sorted(TOY))
def test_toy_config_counts_as_transformers_builds_it(name: str) -> None:
    """Both the file's own keys and transformers' ``to_dict()`` of the config it builds
    (every default written out) give the model's count."""
    model = _built(TOY[name])
    _check(model, spec_from_hf_dict(TOY[name], name, name))
    _check(model, spec_from_hf_dict(model.config.to_dict(), name, name))


def test_gemma3_vision_tower_is_what_is_not_counted() -> None:
    """The multimodal model transformers builds from gemma-3-12b-pt's config is the language
    model memplan counts plus the vision tower and the projector."""
    data = json.loads((HF / "gemma-3-12b-pt" / "config.json").read_text())
    config = transformers.AutoConfig.for_model(**data)
    with torch.device("meta"):
        full = transformers.Gemma3ForConditionalGeneration(config)
    vision = sum(p.numel() for name, p in full.named_parameters()
                 if not name.startswith("model.language_model."))
    spec = spec_from_hf_config(HF / "gemma-3-12b-pt" / "config.json")
    assert sum(p.numel() for p in full.parameters()) == spec.num_params + vision
    assert 0.4e9 < vision < 0.45e9


def test_mistral3_counts_its_language_model() -> None:
    """A mistral3 config (Ministral 3's Mistral3ForConditionalGeneration) is counted as its
    language model, text_config's, with the head tied by the outer tie_word_embeddings
    (Mistral3Config: default true, which the text config's false does not change): the
    multimodal model transformers builds is that model's parameters plus the vision tower
    and the projector, none of them under ``model.language_model.`` or ``lm_head``."""
    text = dict(model_type="ministral3", hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                vocab_size=500, pad_token_id=None)
    vision = dict(model_type="pixtral", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=16)
    data = dict(model_type="mistral3", text_config=text, vision_config=vision)
    config = transformers.AutoConfig.for_model(**data)
    with torch.device("meta"):
        full = transformers.Mistral3ForConditionalGeneration(config)
    language = sum(p.numel() for name, p in full.named_parameters()
                   if name.startswith(("model.language_model.", "lm_head.")))
    spec = spec_from_hf_dict(data, "mistral3-toy", "mistral3-toy")
    assert spec.tied_embeddings and spec.num_params == language
    assert spec.num_params == spec_from_hf_dict(text, "t", "t").num_params - 500 * 128
    assert sum(p.numel() for p in full.parameters()) > language
    untied = data | {"tie_word_embeddings": False}
    with torch.device("meta"):
        full = transformers.Mistral3ForConditionalGeneration(
            transformers.AutoConfig.for_model(**untied))
    assert spec_from_hf_dict(untied, "u", "u").num_params == sum(
        p.numel() for name, p in full.named_parameters()
        if name.startswith(("model.language_model.", "lm_head.")))
