"""Reading Hugging Face ``config.json`` files.

The fixtures under ``tests/data/hf`` are the config.json files published on the Hub for each
model; loading one must give exactly the catalog entry's parameter count.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.errors import MemplanError
from memplan.spec import load_model, spec_from_hf_config

HF = Path(__file__).parent.parent / "data" / "hf"

# fixture folder (named as the Hub repository) -> catalog name
PAIRS = {
    "Llama-2-7b-hf": "llama-2-7b",
    "Meta-Llama-3-8B": "llama-3-8b",
    "Mistral-7B-v0.1": "mistral-7b",
    "Mixtral-8x7B-v0.1": "mixtral-8x7b",
    "Qwen2.5-7B": "qwen2.5-7b",
    "gpt2": "gpt2",
}

# Fields that must agree between a config.json and its catalog entry (name and source differ).
SHAPE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size",
    "max_seq_len", "norm", "mlp", "position", "tied_embeddings", "qkv_bias", "attn_out_bias",
    "mlp_bias", "norm_bias", "dropout", "moe",
)


@pytest.mark.parametrize("folder", sorted(PAIRS))
def test_config_json_matches_catalog(folder: str) -> None:
    spec = spec_from_hf_config(HF / folder / "config.json")
    catalog = load_model(PAIRS[folder])
    assert spec.num_params == catalog.num_params
    for field in SHAPE_FIELDS:
        assert getattr(spec, field) == getattr(catalog, field), field


def test_name_is_the_folder_and_source_names_the_file() -> None:
    path = HF / "Qwen2.5-7B" / "config.json"
    spec = spec_from_hf_config(path)
    assert spec.name == "Qwen2.5-7B"
    assert str(path) in spec.source


def test_load_model_accepts_a_folder_or_file() -> None:
    folder = HF / "gpt2"
    assert load_model(str(folder)).num_params == 124_439_808
    assert load_model(str(folder / "config.json")).name == "gpt2"


def test_family_specifics() -> None:
    qwen = spec_from_hf_config(HF / "Qwen2.5-7B" / "config.json")
    assert (qwen.qkv_bias, qwen.attn_out_bias, qwen.mlp_bias) == (True, False, False)
    gpt2 = spec_from_hf_config(HF / "gpt2" / "config.json")
    assert gpt2.tied_embeddings and gpt2.norm_bias and gpt2.ffn_hidden_size == 4 * 768
    assert gpt2.dropout == pytest.approx(0.1)
    mixtral = spec_from_hf_config(HF / "Mixtral-8x7B-v0.1" / "config.json")
    assert mixtral.moe is not None
    assert (mixtral.moe.num_experts, mixtral.moe.top_k) == (8, 2)
    assert not mixtral.moe.router_bias


def _write(tmp_path: Path, data: dict, stem: str = "config") -> Path:
    path = tmp_path / "m" / f"{stem}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def _base(folder: str = "Meta-Llama-3-8B") -> dict:
    return json.loads((HF / folder / "config.json").read_text())


def _error(path: Path) -> str:
    with pytest.raises(MemplanError) as err:
        spec_from_hf_config(path)
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message
    return message


def test_llama_defaults(tmp_path: Path) -> None:
    """num_key_value_heads defaults to the head count, head_dim to hidden / heads."""
    data = _base("Llama-2-7b-hf")
    del data["num_key_value_heads"], data["tie_word_embeddings"]
    spec = spec_from_hf_config(_write(tmp_path, data))
    assert spec.num_kv_heads == 32 and spec.head_dim == 128 and not spec.tied_embeddings
    assert spec.num_params == 6_738_415_616


def test_explicit_head_dim_and_biases(tmp_path: Path) -> None:
    data = _base() | {"head_dim": 64, "attention_bias": True, "mlp_bias": True}
    spec = spec_from_hf_config(_write(tmp_path, data))
    assert spec.head_dim == 64 and spec.q_size == 2048
    assert spec.qkv_bias and spec.attn_out_bias and spec.mlp_bias


def test_name_is_the_stem_for_other_file_names(tmp_path: Path) -> None:
    assert spec_from_hf_config(_write(tmp_path, _base(), stem="my-model")).name == "my-model"


def test_malformed_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", ')
    _error(path)


def test_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    assert "JSON object" in _error(path)


def test_missing_key(tmp_path: Path) -> None:
    data = _base()
    del data["num_hidden_layers"]
    assert "num_hidden_layers" in _error(_write(tmp_path, data))


def test_missing_model_type(tmp_path: Path) -> None:
    data = _base()
    del data["model_type"]
    assert "model_type" in _error(_write(tmp_path, data))


def test_unknown_model_type(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, _base() | {"model_type": "mamba"}))
    assert "model_type" in message and "'mamba'" in message


@pytest.mark.parametrize(("key", "value"), [
    ("hidden_size", "4096"),
    ("hidden_size", 4096.0),
    ("num_hidden_layers", True),
    ("vocab_size", 0),
    ("tie_word_embeddings", "no"),
    ("hidden_act", "tanh"),
])
def test_wrong_value_is_named(tmp_path: Path, key: str, value: object) -> None:
    message = _error(_write(tmp_path, _base() | {key: value}))
    assert key in message and repr(value).strip("'") in message


def test_heads_not_dividing_hidden(tmp_path: Path) -> None:
    assert "num_attention_heads" in _error(_write(tmp_path, _base() | {"num_attention_heads": 30}))


def test_model_spec_validation_becomes_one_line(tmp_path: Path) -> None:
    """32 heads with 5 KV heads passes the reader but not ModelSpec's own check."""
    assert "num_kv_heads" in _error(_write(tmp_path, _base() | {"num_key_value_heads": 5}))


def test_mixtral_top_k_above_experts(tmp_path: Path) -> None:
    data = _base("Mixtral-8x7B-v0.1") | {"num_experts_per_tok": 9}
    assert "top_k" in _error(_write(tmp_path, data))


def test_gpt2_bad_dropout(tmp_path: Path) -> None:
    data = _base("gpt2") | {"resid_pdrop": "0.1"}
    assert "resid_pdrop" in _error(_write(tmp_path, data))


@pytest.mark.parametrize(("act", "impl"), [("gelu", "kernel"), ("gelu_pytorch_tanh", "kernel"),
                                           ("gelu_new", "gelu_new"), ("relu", "kernel")])
def test_gpt2_activation_names_map_to_what_transformers_runs(tmp_path: Path, act: str,
                                                            impl: str) -> None:
    """ACT2FN (transformers activations.py): gelu and gelu_pytorch_tanh are one kernel,
    gelu_new is NewGELUActivation's Python formula; other formulas are refused by name."""
    data = json.loads((HF / "gpt2" / "config.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**data, "activation_function": act}))
    assert spec_from_hf_config(path).activation_impl.value == impl
    path.write_text(json.dumps({**data, "activation_function": "quick_gelu"}))
    with pytest.raises(MemplanError, match="activation_function.*quick_gelu"):
        spec_from_hf_config(path)


def test_gelu_new_saves_three_more_intermediates() -> None:
    """GPT-2 (its published config: gelu_new) at b 1, s 1024 in bf16: 12 layers, each saving
    3 more ffn-sized tensors (tanh output, 0.5*x, 1+tanh) than the fused GELU: T * 4h * 2 B
    each."""
    import memplan
    from memplan.overheads import no_overheads

    spec = spec_from_hf_config(HF / "gpt2" / "config.json")
    formula = memplan.estimate(spec, seq_len=1024, overheads=no_overheads()).worst
    kernel = memplan.estimate(spec.model_copy(update={"activation_impl": "kernel"}),
                              seq_len=1024, overheads=no_overheads()).worst
    assert formula.activations_bytes - kernel.activations_bytes == 12 * 3 * 1024 * 3072 * 2
